"""`nha-retrofit bench` on a checkpoint: its context tokens, the cache sizes it reports (the bytes the caches hold,
checked against the plan's formula), and one error line per bad input."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from cli_helpers import cli
from nha_retrofit.conversion import convert
from nha_retrofit.bench.engine import context_tokens
from nha_retrofit.bench.options import decode_room
from nha_retrofit.bench.run import benchmark_checkpoint
from nha_retrofit.eval.texts import load_heldout_tokens
from nha_retrofit.plan import PlanSpec, nha_state_bytes
from tiny_models import TINY_LLAMA, families, tiny_llama

WINDOW, SLOTS = 8, 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny converted Llama without a tokenizer: layer 0 full, layers 1-3 NHA (w=8, M=5)."""
    folder = tmp_path_factory.mktemp("bench")
    tiny_llama(seed=11).save_pretrained(folder / "original")
    return convert(folder / "original", folder / "nha", PlanSpec(full_layer_ids=[0], window=WINDOW, slots=SLOTS),
                   log=lambda *_: None)


@families("qwen2.5", "qwen3_moe")
def test_context_is_held_out_text_or_random_ids(family, checkpoint):
    """With a tokenizer: the held-out Python text, repeated when the context is longer; without: random ids."""
    _, original, _, out = family
    text = load_heldout_tokens(AutoTokenizer.from_pretrained(out), "python-stdlib", 100_000)[0]
    ids = context_tokens(out, text.numel() + 7, original.config.vocab_size, "cpu")
    assert ids.shape == (1, text.numel() + 7)
    assert torch.equal(ids[0, : text.numel()], text) and torch.equal(ids[0, text.numel() :], text[:7])
    ids = context_tokens(checkpoint, 300, TINY_LLAMA["vocab_size"], "cpu")
    assert ids.shape == (1, 300) and 0 <= ids.min() and ids.max() < TINY_LLAMA["vocab_size"] and ids.unique().numel() > 50


@pytest.mark.parametrize("contexts", [(9, 111), (63,)])
def test_bench_reports_the_bytes_each_cache_holds(checkpoint, contexts):
    """The static caches are sized for the context plus the decode steps: the original every window full per token
    and layer, NHA per token for its one full layer plus the fixed state of each NHA layer; the original's dynamic
    cache holds the context per token and layer."""
    report = benchmark_checkpoint(checkpoint, contexts, decode_steps=3, rounds=2)
    heads, layers = TINY_LLAMA["num_key_value_heads"], TINY_LLAMA["num_hidden_layers"]
    head_dim = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
    full_layer_per_token = 2 * heads * head_dim * 4  # float32 keys and values
    rows = {(r["context"], r["model"]): r for r in report["latency"]}
    paths = ("nha", "original, eager", "original, every window full")
    assert sorted(rows) == sorted((t, m) for t in contexts for m in paths)
    for t in contexts:
        positions = t + decode_room(3)
        assert rows[t, "original, every window full"]["cache_bytes"] == layers * positions * full_layer_per_token
        assert rows[t, "original, eager"]["cache_bytes"] == layers * t * full_layer_per_token
        nha_state = nha_state_bytes(heads, head_dim, SLOTS, WINDOW, 4)
        assert rows[t, "nha"]["cache_bytes"] == positions * full_layer_per_token + (layers - 1) * nha_state
        for row in rows[t, "nha"], rows[t, "original, eager"], rows[t, "original, every window full"]:
            assert row["fits"] and row["decode_ms_per_token"] > 0 and row["peak_bytes"] is None
            assert len(row["rounds"]["decode_ms_per_token"]) == 2
        assert rows[t, "nha"]["prefill_ms"] > 0 and rows[t, "original, eager"]["prefill_ms"] > 0
    assert report["windows"] == [None, WINDOW, WINDOW, WINDOW] and report["machine"]["device"] == "cpu"
    assert report["throughput"] == [] and report["model"]["checkpoint"] == str(checkpoint)


def test_cli_bench_prints_a_table_and_writes_json(checkpoint, tmp_path):
    code, output = cli("bench", checkpoint, "--contexts", "16,40", "--decode-steps", "2", "--rounds", "1", "--json",
                       tmp_path / "out" / "bench.json")
    assert code == 0, output
    assert "| 16 | nha |" in output and "| 40 | original, eager |" in output and "decode ms per token" in output
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert len(report["latency"]) == 6 and [p.name for p in (tmp_path / "out").iterdir()] == ["bench.json"]


@pytest.mark.parametrize("args, message", [
    (["--contexts", "0"], "context lengths must be >= 1"),
    (["--contexts", "500"], "500 + 40 decode positions exceeds the model's max_position_embeddings (512)"),
    (["--contexts", "16", "--kv-cache-dtype", "int4"], "unknown KV cache dtype 'int4'; use auto, float8_e4m3"),
    (["--decode-steps", "0"], "decode steps and rounds must be >= 1"),
    (["--dtype", "int8"], "unknown dtype 'int8'"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--not-nha"], "is not an NHA checkpoint"),
])
def test_cli_bench_bad_input_is_one_line(checkpoint, tmp_path, args, message):
    if args == ["--not-nha"]:
        args, target = [], checkpoint.parent / "original"
    else:
        target = checkpoint
    code, output = cli("bench", target, *args, "--json", tmp_path / "bench.json")
    assert code == 1 and output.startswith("error: ") and message in output and len(output.splitlines()) == 1
    assert not any(tmp_path.iterdir())
