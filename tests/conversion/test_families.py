"""Every supported family converts exactly, caches correctly, ships its real tokenizer and loads as remote code."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from fresh_process import run_without_nha_retrofit, tokenize_without_nha_retrofit
from nha_retrofit.conversion import convert
from nha_retrofit.modeling.load import load_nha_checkpoint
from nha_retrofit.plan import PlanSpec
from real_tokenizers import FAMILY_TOKENIZERS
from tiny_models import families, tiny_family_model


def sample_ids(model, length=48, batch=2, seed=0):
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@families("qwen2.5", "qwen3_moe")
def test_all_full_windows_equal_the_original(family):
    name, original, _, out = family
    nha = load_nha_checkpoint(out)
    ids = sample_ids(original)
    with torch.no_grad():
        hybrid = nha(ids).logits
        nha.set_windows([None] * nha.config.num_hidden_layers)
        assert (nha(ids).logits - original(ids).logits).abs().max() <= 1e-5
    assert (hybrid - original(ids).logits).abs().max() > 1e-4


@families("qwen2.5", "qwen3_moe")
def test_cached_generation_equals_a_full_forward(family):
    _, original, _, out = family
    nha = load_nha_checkpoint(out)
    ids = sample_ids(original, length=40)
    with torch.no_grad():
        full = nha(ids, use_cache=False).logits
        step = nha(ids[:, :30], use_cache=True)
        pieces, cache = [step.logits], getattr(step, "cache", None) or step.past_key_values
        for t in range(30, 40):
            step = nha(ids[:, t : t + 1], cache=cache, use_cache=True)
            pieces.append(step.logits)
    assert (torch.cat(pieces, 1) - full).abs().max() <= 1e-5


@families("qwen3_moe")
def test_real_tokenizer_is_copied(family):
    name, _, _, out = family
    text = "Native Hybrid Attention: slots + a sliding window, one softmax."
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == FAMILY_TOKENIZERS[name]()(text).input_ids


@families("qwen2.5", "qwen3_moe")  # a fresh interpreter per family: 7-9 s each
def test_tokenizer_loads_without_nha_retrofit_with_no_prompt_and_no_warning(family, tmp_path):
    """The README's `AutoTokenizer.from_pretrained(DIR)` where only torch and transformers are installed: it reads
    config.json first, which asked to run the remote code and warned about an unknown model type."""
    name, _, _, out = family
    text = "Native Hybrid Attention: slots + a sliding window, one softmax."
    ids, printed = tokenize_without_nha_retrofit(out, text, tmp_path)
    assert ids == FAMILY_TOKENIZERS[name]()(text).input_ids
    assert printed.strip() == "", printed


def test_plan_replaces_the_original_window_settings(family):
    name, _, _, out = family
    config = json.loads((out / "config.json").read_text())
    assert config["nha_windows"] == [3, None, 3, 3, None, 3]
    assert config.get("use_sliding_window", False) is False
    assert set(config.get("layer_types") or ["full_attention"]) == {"full_attention"}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_moe_routing_is_untouched_and_reports_router_logits(family):
    name, original, _, out = family
    nha = load_nha_checkpoint(out)
    assert nha.config.mlp_only_layers == [0] and nha.config.decoder_sparse_step == 2
    for ours, theirs in zip(nha.model.layers, original.model.layers):
        assert type(ours.mlp) is type(theirs.mlp)
    ids = sample_ids(original, length=20)
    nha.train()
    output = nha(ids, labels=ids, output_router_logits=True, use_cache=False)
    assert output.aux_loss is not None and torch.isfinite(output.aux_loss) and len(output.router_logits) > 0
    output.loss.backward()
    assert nha.model.layers[2].self_attn.g_proj.weight.grad is not None


@families("llama3", "qwen2.5", "qwen3_moe")  # the default tier loads a Llama checkpoint so in test_converter
def test_fresh_process_remote_code_without_nha_retrofit(family, tmp_path):
    _, original, _, out = family
    nha = load_nha_checkpoint(out)
    ids = sample_ids(original, length=24, batch=1)
    with torch.no_grad():
        expected = nha(ids).logits
    name, diff, length = run_without_nha_retrofit(out, ids, expected, tmp_path, prompt_tokens=24, new_tokens=4)
    assert name == type(nha).__name__ and diff <= 1e-6 and length == 28


def test_bf16_checkpoint_keeps_its_dtype(tmp_path):
    model = tiny_family_model("qwen2.5").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    out = convert(tmp_path / "bf16", tmp_path / "nha", PlanSpec(select="even", full_layers=1), log=lambda *_: None)
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    gate = "model.layers.0.self_attn.g_proj.weight"
    with safe_open(out / index[gate], "pt") as handle:
        assert handle.get_tensor(gate).dtype == torch.bfloat16
    assert load_nha_checkpoint(out, dtype=None).dtype == torch.bfloat16
