"""Shared fixtures: the real SmolLM2 (embedded default) converted once per test session."""

import pytest

from tiny_models import tiny_llama


@pytest.fixture(scope="session")
def smollm2_nha(tmp_path_factory):
    """SmolLM2-135M converted with the default plan (4 full layers, w=64, M=64): (source folder, NHA folder)."""
    from nha_retrofit.convert import convert, resolve_model

    output = tmp_path_factory.mktemp("smollm2") / "nha"
    convert("smollm2-135m", output, full_layers=4, log=lambda *_: None)
    return resolve_model("smollm2-135m"), output


@pytest.fixture
def tiny_llama_folder(tmp_path):
    """A tiny random GQA Llama checkpoint on disk (no tokenizer)."""
    folder = tmp_path / "tiny-llama"
    tiny_llama(seed=7, attention_bias=True).save_pretrained(folder)
    return folder
