"""Quality benchmark (not a test): held-out perplexity of SmolLM2-135M converted to NHA, before and after the
finetuning recipe, against the original; written to benchmarks/results/quality_<machine>.json.

    python benchmarks/quality.py                                  # the CPU demo recipe (about 15 min, 2 cores)
    python benchmarks/quality.py --variant no-transfer --variant ce   # ablations at the same budget
    python benchmarks/quality.py --recipe R.yaml --set stages.lm.tokens=20000000 --name gpu   # a GPU run
    ... --set train.stop_after_steps=500, then the same command with --resume: one run in two sittings

Each variant is the recipe plus `--set` overrides; the held-out texts (python-stdlib, shakespeare) are excluded
from training and scored by the finetune run itself (original = the same model with every window full).
"""

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "demo": [],  # transfer 20K tokens (gates), then CE + KL to the original, 66K tokens
    "no-transfer": ["stages.attention_transfer.tokens=0"],
    "distill-only": ["stages.lm.ce_weight=0.0", "stages.lm.distill_weight=1.0"],
    "ce": ["stages.lm.ce_weight=1.0", "stages.lm.distill_weight=0.0"],
    "lora": ["train.trainable=lora"],
}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2_demo.yaml"))
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="repeatable; default: demo")
    parser.add_argument("--set", action="append", default=[], help="extra recipe overrides for every variant")
    parser.add_argument("--name", default="cpu" if not torch.cuda.is_available() else "gpu")
    parser.add_argument("--output-root", default=str(ROOT / "outputs" / "quality"))
    parser.add_argument("--resume", action="store_true", help="continue each variant's run from its last checkpoint")
    args = parser.parse_args(argv)

    from nha_retrofit.finetune import finetune
    from nha_retrofit.ops.nha.dispatch import kernel_scope

    path = ROOT / "benchmarks" / "results" / f"quality_{args.name}.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    results.setdefault("runs", {})
    for variant in args.variant or ["demo"]:
        out = Path(args.output_root) / variant
        overrides = [*VARIANTS[variant], *args.set, f"train.output_dir={out}", f"export.folder={out / 'model'}"]
        reference = results["runs"].get("demo") if variant != "demo" else None
        if reference:  # original and converted-before perplexities do not depend on the variant: reuse them
            overrides.append("eval.before=false")
        start, cpu_start = time.monotonic(), _cpu_seconds()
        summary = finetune(args.recipe, overrides, resume=args.resume, overwrite=not args.resume)
        if "stopped_at_step" in summary:  # train.stop_after_steps: the rest runs with --resume
            print(f"{variant}: stopped at step {summary['stopped_at_step']}; continue with --resume")
            continue
        wall, cpu = time.monotonic() - start, _cpu_seconds() - cpu_start
        before, after = summary["before"], summary["after"]
        if reference:
            for text, row in reference["heldout"].items():
                before[f"{text}_original_ppl"], before[f"{text}_ppl"] = row["original"], row["before"]
        texts = sorted(k[: -len("_original_ppl")] for k in before if k.endswith("_original_ppl"))
        row = {
            "recipe": str(Path(args.recipe).relative_to(ROOT)) if Path(args.recipe).is_relative_to(ROOT) else args.recipe,
            "overrides": [*VARIANTS[variant], *args.set],
            "machine": summary["machine"],
            "nha_kernels": kernel_scope() if torch.cuda.is_available() else "0",  # where Triton ran (see kernel_scope)
            "tokens": summary["tokens"],
            "steps": summary["steps"],
            "train_wall_time_s": summary["wall_time_s"],
            "total_wall_time_s": round(wall, 1),  # of the last sitting when resumed
            "resumed": args.resume,
            "process_cpu_time_s": round(cpu, 1),  # wall time includes any other load on the machine
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "heldout": {
                t: {
                    "original": before[f"{t}_original_ppl"],
                    "before": before[f"{t}_ppl"],
                    "after": after[f"{t}_ppl"],
                    "ratio_before": before[f"{t}_ppl"] / before[f"{t}_original_ppl"],
                    "ratio_after": after[f"{t}_ppl"] / before[f"{t}_original_ppl"],
                }
                for t in texts
            },
            "eval_blocks": {"original_ppl": before.get("original_eval_ppl"), "before_ppl": before.get("eval_ppl"),
                            "after_ppl": after.get("eval_ppl"), "kl_before": before.get("eval_kl"),
                            "kl_after": after.get("eval_kl")},
        }
        results["runs"][variant] = row
        results.update(python=platform.python_version(), torch=torch.__version__)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps({variant: row["heldout"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
