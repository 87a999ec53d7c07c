"""Shared fixtures: the real SmolLM2 (embedded default) converted once per pytest run; one small converted model
of every supported family; the evaluation fixtures (tests/support/eval_fixtures.py)."""

import os

import torch

# Without CUDA the Triton kernel tests run under Triton's CPU interpreter, which must be chosen before any kernel
# is defined (at import of the package's operator): here, before the test modules are collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from real_tokenizers import FAMILY_TOKENIZERS
from tiny_models import FAMILY_CONFIGS, tiny_family_model, tiny_llama

pytest_plugins = ["eval_fixtures"]


@pytest.fixture(autouse=True)
def fixed_seed():
    """Every test starts from the same global random state: a test's random draws are the same on every run."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2_nha(tmp_path_factory):
    """SmolLM2-135M converted with the paper's plan (4 full layers, w=64, M=64): (source folder, NHA folder)."""
    from nha_retrofit.conversion import convert, resolve_model
    from nha_retrofit.plan import PlanSpec

    output = tmp_path_factory.mktemp("smollm2") / "nha"
    convert("smollm2-135m", output, PlanSpec(select="even", full_layers=4, window=64, slots=64), log=lambda *_: None)
    return resolve_model("smollm2-135m"), output


@pytest.fixture
def tiny_llama_folder(tmp_path):
    """A tiny random GQA Llama checkpoint on disk (no tokenizer)."""
    folder = tmp_path / "tiny-llama"
    tiny_llama(seed=7, attention_bias=True).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=list(FAMILY_CONFIGS))
def family(request, tmp_path_factory):
    """(family, original model, original folder, converted folder): 2 of 6 layers full, w=3, M=5."""
    from nha_retrofit.conversion import convert
    from nha_retrofit.plan import PlanSpec

    name = request.param
    folder = tmp_path_factory.mktemp(name)
    original = tiny_family_model(name, seed=3)
    original.save_pretrained(folder / "original")
    FAMILY_TOKENIZERS[name]().save_pretrained(folder / "original")
    out = convert(folder / "original", folder / "nha", PlanSpec(select="even", full_layers=2, window=3, slots=5, slot_bias_init=-1.0),
                  log=lambda *_: None)
    return name, original, folder / "original", out
