"""The bench's fair comparison: rounds in alternating order, every speed-up against the fastest baseline that fits,
a warning when a graph baseline is slower than eager, the memory accounting of static caches, and the compiled path
only where CUDA is."""

import pytest
import torch

from nha_retrofit.bench.decoders import COMPILED, EAGER, EVERY_WINDOW_FULL, NHA
from nha_retrofit.bench.engine import Bench, baseline_warnings, batch_speedups, machine_tag, run_benchmark, speedups
from nha_retrofit.bench.memory import cache_bytes, largest_batch, static_bytes_per_sequence
from nha_retrofit.bench.options import decode_room
from nha_retrofit.bench.timing import fits
from nha_retrofit.modeling.nha_cache import NHAStaticCache
from tiny_models import tiny_nha_pair

BASELINES = [EAGER, COMPILED, EVERY_WINDOW_FULL]


def row(model, context, decode=None, prefill=None, fits=True):
    return {"model": model, "context": context, "fits": fits, "decode_ms_per_token": decode, "prefill_ms": prefill}


def test_speedups_are_against_the_fastest_baseline_that_fits():
    latency = [row(NHA, 4096, 7.3, 120.0), row(EAGER, 4096, 28.0, 118.0), row(COMPILED, 4096, 8.3),
               row(EVERY_WINDOW_FULL, 4096, 8.0),
               row(NHA, 32768, 7.5, 1000.0), row(EAGER, 32768, 30.0, 1400.0), row(COMPILED, 32768, fits=False),
               row(EVERY_WINDOW_FULL, 32768, 9.65)]
    first, second = speedups(latency, BASELINES)
    assert first["decode_ms_per_token"]["baseline"] == EVERY_WINDOW_FULL
    assert first["decode_ms_per_token"]["speedup"] == pytest.approx(8.0 / 7.3)
    assert first["prefill_ms"] == {"baseline": EAGER, "baseline_ms": 118.0, "nha_ms": 120.0,
                                   "speedup": pytest.approx(118 / 120)}
    assert second["decode_ms_per_token"]["baseline"] == EVERY_WINDOW_FULL
    assert second["decode_ms_per_token"]["speedup"] == pytest.approx(9.65 / 7.5)
    weights = {"nha": 16_100, "original": 16_000}
    [_, bound] = speedups([{**r, "cache_bytes": 4_300 if r["model"] != NHA else 500} for r in latency], BASELINES,
                          weights)
    assert bound["decode_ms_per_token"]["bytes_bound"] == pytest.approx(20_300 / 16_600)
    assert "bytes_bound" not in first["decode_ms_per_token"]
    no_nha = speedups([row(NHA, 64, fits=False), row(EAGER, 64, 3.0, 2.0)], BASELINES)
    assert no_nha == [{"context": 64}]


def test_batch_speedups_compare_the_best_rates_that_fit():
    throughput = [{"model": NHA, "context": 32768, "batch": b, "fits": b < 256, "tokens_per_s": 18.0 * b}
                  for b in (16, 64, 208, 256)]
    throughput += [{"model": EVERY_WINDOW_FULL, "context": 32768, "batch": b, "fits": b <= 28,
                    "tokens_per_s": 18.5 * b} for b in (16, 28, 64)]
    largest = [{"model": NHA, "context": 32768, "largest_batch": 208, "first_failing": 256},
               {"model": EVERY_WINDOW_FULL, "context": 32768, "largest_batch": 28, "first_failing": 34}]
    [record] = batch_speedups(throughput, largest, EVERY_WINDOW_FULL)
    assert record["nha_tokens_per_s"] == 18.0 * 208 and record["baseline_tokens_per_s"] == 18.5 * 28
    assert record["speedup"] == pytest.approx(208 * 18.0 / (28 * 18.5))
    assert (record["nha_largest_batch"], record["baseline_largest_batch"]) == (208, 28)
    assert batch_speedups(throughput[:4], largest, EVERY_WINDOW_FULL) == []


def test_a_graph_baseline_slower_than_eager_is_warned_about():
    latency = [row(EAGER, 4096, 28.0), row(COMPILED, 4096, 11.9), row(EVERY_WINDOW_FULL, 4096, 8.0),
               row(EAGER, 32768, 30.0), row(COMPILED, 32768, 68.9), row(EVERY_WINDOW_FULL, 32768, 9.6)]
    warnings = baseline_warnings(latency, [COMPILED, EVERY_WINDOW_FULL])
    assert len(warnings) == 1 and "at context 32768" in warnings[0] and f"'{COMPILED}'" in warnings[0]
    assert "68.90" in warnings[0] and "30.00" in warnings[0]
    assert baseline_warnings(latency, [EVERY_WINDOW_FULL]) == []


@pytest.mark.parametrize("length", [40, 3000])
def test_bytes_per_sequence_are_what_a_static_cache_allocates(length):
    """The accounting (on the meta device) equals the bytes of a real cache of 3 sequences, per sequence, with the
    full layers' keys and values in bfloat16 and in float8."""
    _, nha = tiny_nha_pair([None, 4, None, 4], max_position_embeddings=4096)
    for kv_dtype in (None, torch.float8_e4m3fn):
        per_sequence = static_bytes_per_sequence(nha.config, length, torch.bfloat16, kv_dtype)
        real = NHAStaticCache(nha.config, 3, length, torch.bfloat16, "cpu", kv_cache_dtype=kv_dtype)
        assert 3 * per_sequence == cache_bytes(real)
    assert largest_batch(141 * 2**30, 17 * 2**30, 2**30) == 124 and largest_batch(2**30, 2**31, 1) == 0


def test_rounds_alternate_their_order_after_an_untimed_one(monkeypatch):
    _, nha = tiny_nha_pair([None, 4, None, 4])
    calls = []
    monkeypatch.setattr(Bench, "nha_once", lambda self, ids, warm, keep: calls.append(("nha", warm, keep)) or {})
    monkeypatch.setattr(Bench, "original_once",
                        lambda self, ids, warm, keep: calls.append(("original", warm, keep)) or {})
    Bench(nha, decode_steps=1, rounds=3).latency(8, keep=True)
    assert calls == [("original", True, False), ("nha", True, False), ("nha", False, False),
                     ("original", False, False), ("original", False, False), ("nha", False, False),
                     ("nha", False, True), ("original", False, True)]


def test_the_compiled_baseline_is_left_out_without_cuda():
    _, nha = tiny_nha_pair([None, 4, None, 4])
    bench = Bench(nha, decode_steps=1, rounds=1, compile_original=True)
    assert list(bench.paths) == [NHA, EAGER, EVERY_WINDOW_FULL] and bench.graph_baselines == []
    assert bench.original.compiled is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile(mode='reduce-overhead') needs CUDA")
def test_the_compiled_baseline_decodes_the_eager_tokens_on_cuda():
    _, nha = tiny_nha_pair([None, 4, None, 4])
    bench = Bench(nha.cuda(), decode_steps=2, rounds=1)
    ids = bench.tokens(24)
    results = bench.original_once(ids, False, False)
    assert COMPILED in bench.graph_baselines and EVERY_WINDOW_FULL in bench.graph_baselines
    assert all(results[path]["decode_ms_per_token"] > 0 for path in BASELINES)


def test_a_float8_kv_cache_is_what_nha_decodes_on_and_what_it_holds():
    _, nha = tiny_nha_pair([None, 4, None, 4])
    report = run_benchmark(nha, contexts=[24], decode_steps=1, rounds=1, kv_cache="float8_e4m3")
    row = next(r for r in report["latency"] if r["model"] == NHA)
    expected = static_bytes_per_sequence(nha.config, 24 + decode_room(1), torch.float32, torch.float8_e4m3fn)
    assert report["kv_cache_dtype"] == "float8_e4m3fn" and row["cache_bytes"] == expected
    assert "float8_e4m3fn" in report["paths"][NHA]
    accounting = {(r["model"], r["kv_cache_dtype"]): r["bytes_per_sequence"] for r in report["memory_accounting"]}
    assert accounting[NHA, "float8_e4m3fn"] == expected < accounting[NHA, "float32"]


@pytest.mark.parametrize("name, tag", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", "l40s"), ("cpu", "cpu")])
def test_result_files_name_the_accelerator_model(name, tag):
    assert machine_tag(name) == tag


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   torch.AcceleratorError("CUDA error: out of memory")])
def test_running_out_of_memory_is_a_batch_that_does_not_fit(error):
    """A CUDA graph that runs out while it is instantiated raises a plain AcceleratorError: still "does not fit"."""
    def run():
        raise error

    assert fits(run, torch.device("cpu")) == (None, False)
    assert fits(lambda: 3.5, torch.device("cpu")) == (3.5, True)


def test_other_accelerator_errors_are_not_taken_for_a_full_memory():
    def run():
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        fits(run, torch.device("cpu"))
