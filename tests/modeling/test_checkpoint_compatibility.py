"""A checkpoint converted by an earlier version of the package (tests/fixtures/nha_checkpoint_v0: a tiny Llama with
windows 3 / full / 0, its remote code in the files of that version, and the logits it gave then) loads through the
package's classes and gives the same logits, and its remote code files are what `push` would send."""

import inspect
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import dynamic_module_utils

from nha_retrofit.modeling.load import nha_checkpoint_class
from nha_retrofit.modeling.modeling_nha import NHALlamaForCausalLM
from nha_retrofit.modeling.remote_code import checkpoint_remote_code

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "nha_checkpoint_v0"
EXPECTED = FIXTURE.with_name("nha_checkpoint_v0_expected.safetensors")


def test_an_earlier_checkpoint_gives_its_logits_through_the_package(tmp_path, monkeypatch):
    """The package's classes give bit for bit the logits of the checkpoint's own (earlier) remote code in this
    process, and the logits recorded when it was converted (to fp32 summation order: the thread count may differ)."""
    assert nha_checkpoint_class(FIXTURE) is NHALlamaForCausalLM  # its model_type is the earlier nha_llama
    model = NHALlamaForCausalLM.from_pretrained(FIXTURE).eval()
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    # an earlier test's remote code may have imported `transformers_modules` from another cache folder
    for name in [name for name in sys.modules if name.split(".")[0] == "transformers_modules"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    earlier_class = dynamic_module_utils.get_class_from_dynamic_module("modeling_nha.NHALlamaForCausalLM", FIXTURE)
    earlier = earlier_class.from_pretrained(FIXTURE).eval()
    assert earlier_class is not NHALlamaForCausalLM
    assert "from .nha_chunked import" in inspect.getsource(inspect.getmodule(earlier_class))  # the earlier files
    expected = load_file(EXPECTED)
    inputs = dict(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"])
    with torch.no_grad():
        logits, earlier_logits = model(**inputs).logits, earlier(**inputs).logits
    assert torch.equal(logits, earlier_logits)
    assert (logits - expected["logits"]).abs().max() <= 1e-6


def test_an_earlier_checkpoints_remote_code_is_found_by_its_imports():
    assert checkpoint_remote_code(FIXTURE) == sorted(
        ["configuration_nha.py", "modeling_nha.py", "nha_cache.py", "nha_chunked.py", "nha_gates.py",
         "nha_recurrent.py", "nha_state.py"])
