"""`nha-retrofit bench --random-weights`: models from a config alone, the report files, out-of-memory sizes recorded
as the limit, and one error line per bad input. Tiny configs on the CPU."""

import json

import pytest
import torch

from cli_helpers import cli
from nha_retrofit.bench.engine import run_benchmark
from nha_retrofit.bench.options import decode_room
from nha_retrofit.bench.random_weights import NAMED_CONFIGS, random_nha_model
from nha_retrofit.bench.report import CPU_NOTE, format_report
from nha_retrofit.modeling import nha_cache
from nha_retrofit.modeling.decoding import original_sharing_weights
from nha_retrofit.plan import PlanSpec, build_plan

TINY_CONFIG = {
    "model_type": "qwen2", "vocab_size": 200, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False,
    "use_sliding_window": False,
}


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_CONFIG))
    return path


def tiny_model(windows=(8, None, 8, 0)):
    plan = build_plan(4, PlanSpec(windows=list(windows), slots=16))
    torch.manual_seed(0)
    return random_nha_model(TINY_CONFIG, plan, "cpu", torch.float32)


@pytest.mark.parametrize("name, parameters", [
    ("llama3-8b", 8_030_261_248), ("qwen2.5-7b", 7_615_616_512), ("qwen3-30b-a3b", 30_532_122_624)])
def test_named_configs_have_the_published_sizes(name, parameters):
    """Built without memory (meta device): the original's parameter count is the published model's, and NHA adds
    a gate projection (with the default gate bias) and slot offsets per layer."""
    config = NAMED_CONFIGS[name]
    plan = build_plan(config["num_hidden_layers"], PlanSpec(select="even"))
    model = random_nha_model(config, plan, "meta", torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.config.nha_windows == list(plan.windows)
    assert sum(p.numel() for p in original_sharing_weights(model).parameters()) == parameters
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    added = config["num_hidden_layers"] * (kv_heads * 64 * (config["hidden_size"] + 1) + heads)
    assert sum(p.numel() for p in model.parameters()) == parameters + added


def test_random_weights_are_made_in_the_asked_dtype():
    model = random_nha_model(TINY_CONFIG, build_plan(4, PlanSpec(select="even", full_layers=1)), "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32 and model.model.rotary_emb.inv_freq.abs().min() > 0
    assert all(p.std() > 0 for name, p in model.named_parameters() if name.endswith("proj.weight"))


def test_cli_bench_random_weights_writes_json_markdown_and_charts(config_file, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    code, output = cli("bench", "--random-weights", config_file, "--contexts", "24,40", "--batch-sizes", "1,2",
                       "--batch-contexts", "40", "--decode-steps", "2", "--rounds", "1", "--full-layers", "1",
                       "--window", "8", "--slots", "16", "--longest", "--layers", "3", "-o", out)
    assert code == 0, output
    names = {"bench.json", "bench.md", "bench_latency.png", "bench_memory.png", "bench_throughput.png"}
    assert {p.name for p in out.iterdir()} == names
    assert all((out / n).read_bytes().startswith(b"\x89PNG") for n in names if n.endswith(".png"))
    report = json.loads((out / "bench.json").read_text())
    assert report["model"]["random_weights"] and report["model"]["layers"] == 3
    assert report["model"]["plan"]["windows"] == [8, None, 8] and report["windows"] == [8, None, 8]
    paths = ["nha", "original, eager", "original, every window full"]
    assert [(r["model"], r["context"], r["fits"]) for r in report["latency"]] == [
        (m, c, True) for c in (24, 40) for m in paths]
    assert report["baselines"] == paths[1:] and report["rounds"] == 1 and list(report["paths"]) == paths
    assert [s["context"] for s in report["speedups"]] == [24, 40]
    assert {(r["model"], r["batch"]) for r in report["throughput"]} == {
        (m, b) for m in ("nha", "original, every window full") for b in (1, 2)}
    assert all(r["tokens_per_s"] > 0 for r in report["throughput"])
    assert [r["context"] for r in report["batch_speedups"]] == [40] and report["batch_speedups"][0]["speedup"] > 0
    assert [r["limited_by"] for r in report["longest_context"]] == ["positions", "positions"]
    assert (out / "bench.md").read_text().strip() == format_report(report) and "| 40 | 2 |" in output


def test_cli_bench_fewer_layers_than_the_default_full_layers(config_file):
    """`--layers 2` of a 4-layer model: the default full-layer count follows the layers kept, not the config's."""
    code, output = cli("bench", "--random-weights", config_file, "--layers", "2", "--contexts", "24",
                       "--decode-steps", "1", "--rounds", "1", "--json", config_file.parent / "bench.json")
    assert code == 0, output
    report = json.loads((config_file.parent / "bench.json").read_text())
    full = PlanSpec().full_layer_count(2)
    assert report["model"]["layers"] == 2 and report["windows"].count(None) == full and len(report["windows"]) == 2


def test_a_cpu_report_says_where_nha_pays_off():
    report = run_benchmark(tiny_model(), contexts=[24], decode_steps=1, rounds=1)
    assert report["machine"]["device"] == "cpu" and format_report(report).endswith(CPU_NOTE)
    on_gpu = {**report, "machine": {**report["machine"], "device": "NVIDIA H200"}}
    assert CPU_NOTE not in format_report(on_gpu)


def test_an_allocation_that_does_not_fit_is_the_limit_and_the_run_goes_on(monkeypatch):
    """A static cache of 3 or more sequences, or of more than 40 positions, 'runs out of memory' (the memory
    accounting's caches on the meta device allocate nothing): those sizes are recorded as not fitting, the largest
    batch is found between the last fit and the first failure, and every other measurement still runs (the
    original's dynamic cache is not limited)."""
    allocate = nha_cache.StaticPositions.__init__

    def limited(self, batch_size, length, device):
        if str(device) != "meta" and (batch_size >= 3 or length > 40 + decode_room(1)):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        allocate(self, batch_size, length, device)

    monkeypatch.setattr(nha_cache.StaticPositions, "__init__", limited)
    report = run_benchmark(tiny_model(), contexts=[24, 40, 64], decode_steps=1, rounds=1, batch_sizes=[1, 2, 4, 8],
                           batch_contexts=[24, 64])
    fits = {(r["model"], r["context"]): r["fits"] for r in report["latency"]}
    static = ("nha", "original, every window full")
    assert fits == {**{(m, c): c < 64 for m in static for c in (24, 40, 64)},
                    **{("original, eager", c): True for c in (24, 40, 64)}}
    tried = {(r["model"], r["context"], r["batch"]): r["fits"] for r in report["throughput"]}
    assert tried == {(m, 24, b): b < 3 for m in static for b in (1, 2, 4, 3)}
    largest = {(r["model"], r["context"]): (r["largest_batch"], r["first_failing"]) for r in report["largest_batch"]}
    assert largest == {(m, 24): (2, 3) for m in static}
    assert [s.get("decode_ms_per_token", {}).get("baseline") for s in report["speedups"]][-1] is None
    table = format_report(report)
    assert "| 64 | nha | does not fit |" in table and "2 (3 does not fit)" in table


@pytest.mark.parametrize("args, message", [
    (["--random-weights", "llama-9000"], "unknown --random-weights 'llama-9000': use llama3-8b, qwen2.5-7b"),
    (["--random-weights", "CONFIG", "--contexts", "250"], "250 + 40 decode positions exceeds the model's "
     "max_position_embeddings (256)"),
    (["--random-weights", "CONFIG", "--layers", "9"], "--layers 9: the model has 1..4 layers"),
    (["--random-weights", "CONFIG", "--batch-sizes", "1,2", "--batch-contexts", "99", "--contexts", "24"],
     "batch context 99 is not one of the contexts [24]"),
    (["--random-weights", "CONFIG", "--contexts", "24", "--batch-sizes", "0"], "batch sizes must be >= 1"),
    (["CHECKPOINT", "--random-weights", "CONFIG"], "give a checkpoint folder or --random-weights CONFIG"),
    ([], "give a checkpoint folder or --random-weights CONFIG"),
    (["--random-weights", "GPT2"], "unsupported architecture gpt2"),
    (["CHECKPOINT", "--window", "8"], "--window applies only with --random-weights"),
    (["CHECKPOINT", "--full-layers", "2"], "--full-layers applies only with --random-weights"),
    (["--random-weights", "CONFIG", "--contexts", "24,abc"], "invalid value for --contexts: '24,abc': expected"),
])
def test_cli_bench_bad_input_is_one_line(config_file, tmp_path, args, message):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({**TINY_CONFIG, "model_type": "gpt2"}))
    args = [{"CONFIG": config_file, "GPT2": gpt2 / "config.json", "CHECKPOINT": tmp_path}.get(a, a) for a in args]
    code, output = cli("bench", *args, "-o", tmp_path / "out")
    assert code == 1 and output.startswith("error: ") and message in output and len(output.splitlines()) == 1
    assert not (tmp_path / "out").exists()
