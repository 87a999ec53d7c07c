"""The retrieval probe behind `select="retrieval"` and the default plan's full KV heads: prompts of exact length
holding their record, the per-layer and per-head scores against a brute-force recomputation from the attention weights,
and the conversion's use of them."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ft_helpers import write_tiny_original
from tiny_models import families
from nha_retrofit.conversion import convert
from nha_retrofit.conversion.layer_ranking import probe_prompts, prompt_scores, rank_heads, rank_layers
from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.modeling.load import load_nha_checkpoint
from nha_retrofit.plan import PlanSpec, build_plan

LENGTH = 96


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer (4 layers, 128 positions)."""
    return write_tiny_original(tmp_path_factory.mktemp("original"))


def test_probe_prompts_are_exact_and_hold_their_record(original):
    tokenizer = AutoTokenizer.from_pretrained(original)
    for prompt, record, answer in probe_prompts(tokenizer, samples=3, length=LENGTH):
        assert len(prompt) == LENGTH
        record_text = tokenizer.decode(prompt[record.start : record.stop])
        assert record_text.strip().startswith("# registry entry ")
        value = record_text.split()[-1]
        assert tokenizer.decode(prompt[answer.start + 1 : LENGTH]).strip() == value
        assert answer.stop == LENGTH - 1 and record.stop <= LENGTH // 2 + len(record)


def brute_force_scores(folder, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """(per layer, per layer and KV head) scores read off eager attention's weights, one element at a time."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    assert groups > 1
    layers = torch.zeros(model.config.num_hidden_layers, dtype=torch.float64)
    heads = torch.zeros(model.config.num_hidden_layers, model.config.num_key_value_heads, dtype=torch.float64)
    for prompt, record, answer in prompts:
        with torch.no_grad():
            attentions = model(torch.tensor([prompt]), output_attentions=True).attentions
        for layer, weights in enumerate(attentions):
            per_head = weights[0].double()
            means = [sum(sum(float(per_head[h, q, k]) for k in record) for q in answer) / len(answer)
                     for h in range(per_head.shape[0])]
            layers[layer] += max(means) / len(prompts)
            for kv_head in range(model.config.num_key_value_heads):
                heads[layer, kv_head] += max(means[kv_head * groups : (kv_head + 1) * groups]) / len(prompts)
    return layers, heads


def assert_probe_matches_eager(folder, samples: int):
    """The probe runs SDPA and computes the answer rows' weights itself; the reference reads eager attention's."""
    prompts = probe_prompts(AutoTokenizer.from_pretrained(folder), samples=samples, length=LENGTH)
    probed = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    scores = prompt_scores(probed, prompts)
    assert probed.config._attn_implementation == "sdpa"
    layers, heads = brute_force_scores(folder, prompts)
    assert torch.allclose(torch.tensor(scores.layers, dtype=torch.float64), layers, atol=1e-5)
    assert torch.allclose(torch.tensor(scores.heads, dtype=torch.float64), heads, atol=1e-5)


def test_scores_match_a_brute_force_reading_of_the_attention_weights(original):
    assert_probe_matches_eager(original, samples=3)
    assert rank_layers([0.1, 0.5, 0.5, 0.2]) == [1, 2, 3, 0]
    assert rank_heads([[0.1, 0.5], [0.5, 0.2]]) == [(0, 1), (1, 0), (1, 1), (0, 0)]


@families("qwen2.5", "qwen3_moe")
def test_every_family_probes_as_eager_attention_reads(family):
    """Qwen2's q/k/v biases and Qwen3-MoE's q/k norms and head dim reach the probe's attention function as they
    reach eager attention."""
    assert_probe_matches_eager(family[2], samples=2)


def test_the_default_plan_keeps_the_strongest_retrieval_kv_heads_full(original, tmp_path):
    """Nothing named: the cache of one layer in six (here one of 4 layers, its 2 KV heads) stays full, as the probe's
    2 strongest KV heads wherever they are (both in one layer here, which makes it a full layer)."""
    out = convert(original, tmp_path / "nha", PlanSpec(window=4, slots=4), log=lambda *_: None)
    record = json.loads((out / "nha_conversion.json").read_text())
    config = json.loads((out / "config.json").read_text())
    chosen = rank_heads(record["head_retrieval_scores"])[:2]
    assert len(record["head_retrieval_scores"][0]) == 2 and chosen[0][0] == chosen[1][0] == 3
    assert config["nha_windows"] == [4, 4, 4, None] and config["nha_full_kv_heads"] == [[], [], [], []]


def test_full_layers_are_the_strongest_retrieval_layers(original, tmp_path):
    out = convert(original, tmp_path / "nha", PlanSpec(full_layers=2, window=4, slots=4), log=lambda *_: None)
    record = json.loads((out / "nha_conversion.json").read_text())
    scores = record["layer_retrieval_scores"]
    windows = json.loads((out / "config.json").read_text())["nha_windows"]
    assert [i for i, w in enumerate(windows) if w is None] == sorted(rank_layers(scores)[:2])
    with pytest.raises(NHARetrofitError, match="--select retrieval ranks the layers by probing"):
        build_plan(len(windows), PlanSpec(full_layers=2))
    assert build_plan(4, PlanSpec(full_layers=2), ranking=[3, 0, 1, 2]).windows == (None, 256, 256, None)


def test_full_kv_heads_are_the_strongest_retrieval_heads_and_the_checkpoint_runs(original, tmp_path):
    out = convert(original, tmp_path / "nha", PlanSpec(full_kv_heads=3, window=4, slots=4), log=lambda *_: None)
    record = json.loads((out / "nha_conversion.json").read_text())
    config = json.loads((out / "config.json").read_text())
    chosen = rank_heads(record["head_retrieval_scores"])[:3]
    whole = {layer for layer in range(4) if sum(pair[0] == layer for pair in chosen) == 2}  # every head: full layer
    assert config["nha_windows"] == [None if layer in whole else 4 for layer in range(4)]
    heads = config["nha_full_kv_heads"]
    kept = {(layer, head) for layer, ids in enumerate(heads) for head in ids}
    full = {(layer, head) for layer, window in enumerate(config["nha_windows"]) if window is None
            for head in range(len(record["head_retrieval_scores"][layer]))}
    assert kept | (full & set(chosen)) == set(chosen) and kept
    model = load_nha_checkpoint(out, torch.float32)
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    assert [list(h) for h in model.config.nha_layer_full_kv_heads] == [sorted(ids_) for ids_ in heads]


def test_a_model_without_a_tokenizer_gets_evenly_spaced_full_layers_and_is_told(tiny_llama_folder, tmp_path):
    lines = []
    out = convert(tiny_llama_folder, tmp_path / "nha", PlanSpec(full_layers=2, window=4), log=lines.append)
    windows = json.loads((out / "config.json").read_text())["nha_windows"]
    assert [i for i, w in enumerate(windows) if w is None] == [0, 2]  # evenly_spaced(4, 2)
    assert any("no tokenizer that can build the retrieval probe" in line for line in lines)
    default = convert(tiny_llama_folder, tmp_path / "default", PlanSpec(window=4), log=lambda *_: None)
    config = json.loads((default / "config.json").read_text())  # the default's one layer in six: one whole layer
    assert config["nha_windows"] == [4, None, 4, 4] and config["nha_full_kv_heads"] is None
