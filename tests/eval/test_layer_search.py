"""`nha-retrofit search`: each layer's score is the KL divergence a separately built float64 model gives, the chosen
layers are the highest scores, the plans' numbers are reproduced independently, and the printed convert command
builds the chosen plan."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli_helpers import cli
from nha_retrofit.conversion.converter import build_nha_model
from nha_retrofit.eval.layer_search import search_full_layers
from nha_retrofit.eval.perplexity import perplexity
from nha_retrofit.eval.texts import load_heldout_tokens
from nha_retrofit.plan import PlanSpec, build_plan
from tiny_models import families

WINDOW, SLOTS, CHUNK, TOKENS = 3, 5, 40, 130  # 3 whole chunks of 40 tokens; the last 10 are dropped


@pytest.fixture(scope="module")
def searched(family):
    name, original, source, _ = family
    report = search_full_layers(str(source), PlanSpec(select="even", full_layers=2, window=WINDOW, slots=SLOTS, slot_bias_init=-1.0),
                                max_tokens=TOKENS, chunk_len=CHUNK, device="cpu")
    # float64 references, but for Qwen3-MoE, whose grouped expert matmul has no float64 kernel
    return report, original, source, torch.float32 if name == "qwen3_moe" else torch.float64


def heldout_chunks(tokenizer, text):
    ids = load_heldout_tokens(tokenizer, text, TOKENS)[0]
    return ids[: TOKENS // CHUNK * CHUNK].view(-1, CHUNK)


def independent_kl(source, windows, chunks, dtype):
    """Mean KL per token from the original (transformers' own class) to an NHA model built for `windows`."""
    original = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
    plan = build_plan(len(windows), PlanSpec(windows=windows, slots=SLOTS, slot_bias_init=-1.0))
    nha = build_nha_model(source, plan).to(dtype)
    with torch.no_grad():
        reference = F.log_softmax(original(chunks).logits, -1)
        converted = F.log_softmax(nha(chunks).logits, -1)
    return ((reference.exp() * (reference - converted)).sum() / chunks.numel()).item(), converted


@families("qwen2.5", "qwen3_moe")
def test_scores_and_plans_match_independent_float64_models(searched):
    report, original, source, dtype = searched
    layers = original.config.num_hidden_layers
    chunks, check_chunks = (heldout_chunks(AutoTokenizer.from_pretrained(source), text) for text in (
        "python-stdlib", "python-docs"))
    assert report["tokens"] == chunks.numel() == report["check_tokens"] and len(report["layer_kl"]) == layers
    for layer in (0, layers - 1):
        expected, _ = independent_kl(source, [WINDOW if i == layer else None for i in range(layers)], chunks, dtype)
        assert report["layer_kl"][layer] == pytest.approx(expected, rel=1e-3, abs=1e-7)
    ranked = sorted(range(layers), key=lambda i: -report["layer_kl"][i])
    assert report["full_layer_ids"] == sorted(ranked[:2]) and min(report["layer_kl"]) > 0
    plan = report["plans"]["searched"]
    expected, log_probs = independent_kl(source, [None if i in plan["full_layer_ids"] else WINDOW
                                                  for i in range(layers)], check_chunks, dtype)
    assert plan["kl"] == pytest.approx(expected, rel=1e-3, abs=1e-7)
    nll = -log_probs[:, :-1].gather(-1, check_chunks[:, 1:, None]).mean()
    assert plan["perplexity"] == pytest.approx(nll.exp().item(), rel=1e-4)
    assert report["original_perplexity"] == pytest.approx(
        perplexity(original, check_chunks.flatten(), chunk_len=CHUNK, max_tokens=None), rel=1e-4)
    assert report["plans"]["even"]["full_layer_ids"] == [1, 4]


@families("llama3", "qwen2.5", "qwen3_moe")  # 7 s each; the default tier scores llama3 against float64 above
def test_a_window_covering_the_chunk_changes_nothing(family):
    _, _, source, _ = family
    report = search_full_layers(str(source), PlanSpec(select="even", full_layers=1, window=CHUNK, slots=SLOTS), max_tokens=CHUNK,
                                chunk_len=CHUNK, device="cpu")
    assert max(report["layer_kl"]) < 1e-6
    for plan in report["plans"].values():
        assert plan["perplexity"] == pytest.approx(report["original_perplexity"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2.5"], indirect=True)
def test_cli_prints_scores_and_a_convert_command_that_builds_the_plan(searched, tmp_path):
    report, _, source, _ = searched
    code, output = cli("search", source, "--full-layers", 2, "--window", WINDOW, "--slots", SLOTS, "--slot-bias-init",
                       -1, "--max-tokens", TOKENS, "--chunk-len", CHUNK, "--device", "cpu", "--json",
                       tmp_path / "search.json")
    assert code == 0, output
    assert json.loads((tmp_path / "search.json").read_text())["full_layer_ids"] == report["full_layer_ids"]
    command = next(line for line in output.splitlines() if line.startswith("nha-retrofit convert"))
    arguments = command.split()[2:]
    arguments[arguments.index("OUT")] = str(tmp_path / "nha")
    code, output = cli("convert", *arguments)
    assert code == 0, output
    windows = json.loads((tmp_path / "nha" / "config.json").read_text())["nha_windows"]
    assert [i for i, w in enumerate(windows) if w is None] == report["full_layer_ids"]
    assert {w for w in windows if w is not None} == {WINDOW}


@pytest.mark.parametrize("args, message", [
    (["--full-layers", "7"], "--full-layers 7: must be between 0 and 6"),
    (["--texts", "nope"], "unknown text 'nope'"),
    (["--check-texts", "python-docs,nope"], "unknown text 'nope'"),
    (["--chunk-len", "5000"], "gives no whole chunk of 5000 tokens"),
    (["--window", "-1"], "--window -1"),
])
@pytest.mark.parametrize("family", ["llama3"], indirect=True)
def test_cli_bad_input_is_one_line(family, args, message):
    _, _, source, _ = family
    code, output = cli("search", source, "--device", "cpu", "--max-tokens", TOKENS, *args)
    assert code == 1 and output.startswith("error: ") and message in output and len(output.splitlines()) == 1


def test_cli_search_downloads_a_hub_id_at_its_revision_with_the_token(monkeypatch):
    """`search` takes Hub ids, so it takes `--revision` and `--token` as `convert` and `plan` do."""
    import nha_retrofit.eval.layer_search as layer_search
    from nha_retrofit.errors import NHARetrofitError

    asked = {}

    def resolve_model(model, **options):
        asked.update(model=model, **options)
        raise NHARetrofitError("not on this machine")

    monkeypatch.setattr(layer_search, "resolve_model", resolve_model)
    code, output = cli("search", "org/model", "--revision", "v2", "--token", "hf_secret")
    assert (code, output) == (1, "error: not on this machine")
    assert asked == {"model": "org/model", "revision": "v2", "token": "hf_secret"}


def test_the_search_leaves_full_kv_heads_to_the_probe():
    from nha_retrofit.errors import NHARetrofitError

    with pytest.raises(NHARetrofitError, match="the search chooses whole full layers; full KV heads are placed by"):
        search_full_layers("smollm2-135m", PlanSpec(full_kv_heads=2))
