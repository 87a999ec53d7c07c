"""Inference at real size in one GPU run: the `nha-retrofit bench` report of Llama-3-8B, Qwen2.5-7B and
Qwen3-30B-A3B shapes (random bf16 weights at their published configs, `bench/random_weights.py`), each converted
with 4 full layers spread evenly and w = 64, M = 64 elsewhere, against the original with the same weights:

- batch 1 at contexts 4K .. the model's positions: prefill ms, decode ms per token (both decode steps replayed from
  a CUDA graph on a static cache), cache and peak memory; the longest context that fits;
- decode tokens per second at batch sizes 1, 2, 4, ... until one does not fit, at 4K and 32K (the largest batch
  by bisection);
- Llama-3-8B only: the original's decode through torch.compile at 4K (transformers' own fast path), and
  torch.profiler's tables of one NHA prefill at 32K (where its time goes, by CUDA time and by host time).

Usage (GPU machine, about 8 minutes): python benchmarks/inference_report.py [--families llama3-8b,...]
Writes benchmarks/results/inference_<family>_<gpu>.json and .md, and docs/images/inference_<family>_*.png; with OUT
set (the device machine), the same paths under $OUT. `--quick`: a tiny config on the CPU in seconds (the test suite
runs it), written to --out-dir.
"""

import argparse
import gc
import os
import time
import traceback
from pathlib import Path

import torch

from nha_retrofit.bench.output import write_report
from nha_retrofit.bench.random_weights import NAMED_CONFIGS, random_nha_model
from nha_retrofit.bench.report import format_report
from nha_retrofit.eval.speed import Bench, decode_room, run_benchmark
from nha_retrofit.plan import PlanSpec, build_plan

REPO = Path(__file__).resolve().parent.parent
DECODE_STEPS = 16
BATCH_SIZES = [1, 4, 16, 64, 256, 1024, 4096]
BATCH_CONTEXTS = [4096, 32768]
PROFILE_CONTEXT = 32768
QUICK_CONFIG = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": False,
}


def family_contexts(config: dict) -> list[int]:
    """4K, 8K, ... doubling while the positions hold it with the decode steps, then the longest they hold."""
    limit = config["max_position_embeddings"] - decode_room(DECODE_STEPS)
    contexts, length = [], 4096
    while length < limit:
        contexts.append(length)
        length *= 2
    return contexts + [limit]


def profile_prefill(model, length: int) -> dict:
    """torch.profiler over one NHA prefill of `length` tokens (static cache, last-position logits, kernels warm):
    the wall time with and without the profiler, and the top ops by CUDA time and by host time."""
    from nha_retrofit.modeling.nha_cache import NHAStaticCache

    ids = torch.randint(0, model.config.vocab_size, (1, length), device=model.device)

    def prefill():
        cache = NHAStaticCache(model.config, 1, length + 1, model.dtype, model.device)
        model(ids, cache=cache, logits_to_keep=1)
        torch.cuda.synchronize()

    with torch.no_grad():
        prefill()
        start = time.perf_counter()
        prefill()
        plain_ms = 1000 * (time.perf_counter() - start)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profiler:
            prefill()
    events = profiler.key_averages()
    return {"context": length, "prefill_ms": plain_ms,
            "by_cuda_time": events.table(sort_by="cuda_time_total", row_limit=20),
            "by_host_time": events.table(sort_by="self_cpu_time_total", row_limit=20)}


def family_model(config: dict, device: str, dtype, quick: bool):
    spec = PlanSpec(full_layers=1, select="even", window=8, slots=16) if quick else \
        PlanSpec(full_layers=4, select="even", window=64, slots=64)
    plan = build_plan(config["num_hidden_layers"], spec)
    return plan, random_nha_model(config, plan, device, dtype)


def run_family(name: str, config: dict, device: str, dtype, quick: bool, contexts=None, batch_sizes=None) -> dict:
    """The `bench` report of one family."""
    plan, model = family_model(config, device, dtype, quick)
    limit = config["max_position_embeddings"] - decode_room(DECODE_STEPS)
    contexts = sorted({min(c, limit) for c in contexts}) if contexts else family_contexts(config)
    options = dict(contexts=[32, 64] if quick else contexts, decode_steps=2 if quick else DECODE_STEPS, rounds=1,
                   batch_sizes=[1, 2, 4] if quick else batch_sizes or BATCH_SIZES,
                   batch_contexts=[64] if quick else [c for c in BATCH_CONTEXTS if c in contexts], longest=True,
                   progress=True)
    report = run_benchmark(model, **options)
    report = {"model": {"name": name, "random_weights": True, "layers": config["num_hidden_layers"],
                        "plan": plan.as_dict(), "plan_description": plan.describe(), "config": config}, **report}
    if hasattr(model.config, "num_experts"):
        report["model"]["experts_implementation"] = model.config._experts_implementation
    release(model)
    return report


def llama_extras(report: dict, compile_original: bool) -> dict:
    """Llama-3-8B's report with the original's decode through torch.compile at 4K and the 32K prefill profile."""
    _, model = family_model(NAMED_CONFIGS["llama3-8b"], "cuda", torch.bfloat16, False)
    if compile_original:
        bench = Bench(model, decode_steps=DECODE_STEPS, rounds=1, compile_original=True)
        report["original_compiled"] = [bench.compiled_latency(4096)]
        del bench
    report["profile"] = profile_prefill(model, PROFILE_CONTEXT)
    release(model)
    return report


def release(model) -> None:
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(NAMED_CONFIGS), help="comma-separated named configs")
    parser.add_argument("--quick", action="store_true", help="a tiny config on the CPU (what the tests run)")
    parser.add_argument("--out-dir", type=Path, help="where to write (default: the repository, or $OUT)")
    parser.add_argument("--contexts", help="comma-separated contexts instead of 4K..the positions (capped by them)")
    parser.add_argument("--batch-sizes", help=f"comma-separated batch sizes instead of {BATCH_SIZES}")
    parser.add_argument("--no-compile", action="store_true", help="skip the original's torch.compile timing")
    args = parser.parse_args()
    root = args.out_dir or Path(os.environ.get("OUT") or REPO)
    results, images = (root, root) if args.quick or args.out_dir else (root / "benchmarks" / "results",
                                                                       root / "docs" / "images")
    if args.quick:
        families = {"tiny-llama": QUICK_CONFIG}
        device, dtype, machine = "cpu", torch.float32, "cpu"
    else:
        families = {name: NAMED_CONFIGS[name] for name in args.families.split(",")}
        device, dtype, machine = "cuda", torch.bfloat16, torch.cuda.get_device_name().split()[-1].lower()
    ints = lambda text: [int(x) for x in text.split(",")] if text else None  # noqa: E731
    for name, config in families.items():  # each family written as soon as it is measured
        start = time.perf_counter()
        try:
            report = run_family(name, config, device, dtype, args.quick, ints(args.contexts), ints(args.batch_sizes))
            write(report, f"inference_{name}_{machine}", results, images)
            if name == "llama3-8b" and not args.quick:
                report = llama_extras(report, not args.no_compile)
                write(report, f"inference_{name}_{machine}", results, images)
                print(f"\nNHA prefill at {report['profile']['context']}: {report['profile']['prefill_ms']:.0f} ms\n"
                      + report["profile"]["by_cuda_time"] + "\n" + report["profile"]["by_host_time"])
        except Exception:  # noqa: BLE001 - one family's failure must not cost the others' measurements
            if args.quick:
                raise
            traceback.print_exc()
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)


def write(report: dict, stem: str, results: Path, images: Path) -> None:
    write_report(report, results, stem, charts_folder=images)
    print(format_report(report), flush=True)

if __name__ == "__main__":
    main()
