"""Inference at real size in one GPU run: the `nha-retrofit bench` report of Llama-3-8B, Qwen2.5-7B and
Qwen3-30B-A3B shapes (random bf16 weights at their published configs, `bench/random_weights.py`), each converted
with the default plan (one layer in six full, spread evenly since random weights hold no retrieval heads; `--plan`
changes it, e.g. `full_layers=4,window=64`), against the original at its best with the same weights
(every path of `nha_retrofit/bench/decoders.py`: eager on its dynamic cache, compiled on its static cache at every
context, every window full on NHA's static-cache CUDA-graph path); 3 rounds in alternating order, medians with their
range, every speed-up against the fastest baseline:

- batch 1 at 4K, 32K and the model's positions (128K; 40K for Qwen3-30B-A3B): prefill ms, decode ms per token,
  cache and peak memory;
- decode tokens per second at batch sizes 1, 4, 16, ... until one does not fit, at 32K (the largest batch by
  bisection), and the largest batch each cache allows by memory accounting (NHA's full layers in bf16 and in fp8);
- with --profile, torch.profiler's tables of one NHA prefill at 32K of Llama-3-8B.

Usage (GPU machine): python benchmarks/inference_report.py [--families llama3-8b,...] [--contexts ...] [--plan ...]
Writes benchmarks/results/inference_<family>_<gpu>.json and .md (`--plan`: inference_<family>_<plan>_<gpu>), and
docs/images/inference_<family>_*.png, each family as soon as it is measured; with OUT set (the device machine), the
same paths under $OUT. `--quick`: a tiny config on the CPU in seconds (the test suite runs it), written to --out-dir.
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
from nha_retrofit.bench.engine import machine_tag, run_benchmark
from nha_retrofit.bench.options import decode_room
from nha_retrofit.plan import PlanSpec, build_plan, cache_dims

REPO = Path(__file__).resolve().parent.parent
DECODE_STEPS = 16
BATCH_SIZES = [1, 4, 16, 64, 256, 1024, 4096]
BATCH_CONTEXTS = [32768]
ROUNDS = 3
PROFILE_CONTEXT = 32768
QUICK_CONFIG = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": False,
}


def family_contexts(config: dict) -> list[int]:
    """4K, 32K and the longest context the positions hold with the decode steps."""
    limit = config["max_position_embeddings"] - decode_room(DECODE_STEPS)
    return sorted({min(length, limit) for length in (4096, 32768)} | {limit})


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


def family_model(config: dict, device: str, dtype, quick: bool, plan_changes: dict | None = None):
    spec = PlanSpec(full_layers=1, select="even", window=8, slots=16) if quick else \
        PlanSpec(select="even", **(plan_changes or {}))
    plan = build_plan(config["num_hidden_layers"], spec, kv_heads=cache_dims(config)[0])
    return plan, random_nha_model(config, plan, device, dtype)


def run_family(name: str, config: dict, device: str, dtype, quick: bool, contexts=None, batch_sizes=None,
               compile_original: bool = True, plan_changes: dict | None = None) -> dict:
    """The `bench` report of one family."""
    plan, model = family_model(config, device, dtype, quick, plan_changes)
    limit = config["max_position_embeddings"] - decode_room(DECODE_STEPS)
    contexts = sorted({min(c, limit) for c in contexts}) if contexts else family_contexts(config)
    options = dict(contexts=[32, 64] if quick else contexts, decode_steps=2 if quick else DECODE_STEPS,
                   rounds=ROUNDS, batch_sizes=[1, 2, 4] if quick else batch_sizes or BATCH_SIZES,
                   batch_contexts=[64] if quick else [c for c in BATCH_CONTEXTS if c in contexts] or contexts[-1:],
                   compile_original=compile_original, progress=True)
    report = run_benchmark(model, **options)
    report = {"model": {"name": name, "random_weights": True, "layers": config["num_hidden_layers"],
                        "plan": plan.as_dict(), "plan_description": plan.describe(), "config": config}, **report}
    if hasattr(model.config, "num_experts"):
        report["model"]["experts_implementation"] = model.config._experts_implementation
    release(model)
    return report


def llama_profile(report: dict) -> dict:
    """Llama-3-8B's report with the 32K prefill profile."""
    _, model = family_model(NAMED_CONFIGS["llama3-8b"], "cuda", torch.bfloat16, False)
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
    parser.add_argument("--contexts",
                        help="comma-separated contexts instead of 4K, 32K and the positions (capped by them)")
    parser.add_argument("--batch-sizes", help=f"comma-separated batch sizes instead of {BATCH_SIZES}")
    parser.add_argument("--no-compile", action="store_true", help="leave out the original's compiled path")
    parser.add_argument("--profile", action="store_true", help="also profile one NHA prefill of Llama-3-8B at 32K")
    parser.add_argument("--plan", help="comma-separated integer PlanSpec fields instead of the default, e.g. "
                                       "full_layers=4,window=64 (the name of what is written says so)")
    args = parser.parse_args()
    plan_changes = {key: int(value) for key, value in (item.split("=") for item in args.plan.split(","))} \
        if args.plan else {}
    plan_tag = "".join(f"_{key.split('_')[0]}{value}" for key, value in plan_changes.items())
    root = args.out_dir or Path(os.environ.get("OUT") or REPO)
    results, images = (root, root) if args.quick or args.out_dir else (root / "benchmarks" / "results",
                                                                       root / "docs" / "images")
    if args.quick:
        families = {"tiny-llama": QUICK_CONFIG}
        device, dtype, machine = "cpu", torch.float32, "cpu"
    else:
        families = {name: NAMED_CONFIGS[name] for name in args.families.split(",")}
        device, dtype, machine = "cuda", torch.bfloat16, machine_tag(torch.cuda.get_device_name())
    ints = lambda text: [int(x) for x in text.split(",")] if text else None  # noqa: E731
    for name, config in families.items():  # each family written as soon as it is measured
        start = time.perf_counter()
        try:
            report = run_family(name, config, device, dtype, args.quick, ints(args.contexts), ints(args.batch_sizes),
                                not args.no_compile, plan_changes)
            stem = f"inference_{name}{plan_tag}_{machine}"
            write(report, stem, results, images)
            if name == "llama3-8b" and args.profile and not args.quick:
                report = llama_profile(report)
                write(report, stem, results, images)
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
