"""Long-context quality benchmark (not a test): four models side by side, on the evaluations of `nha-retrofit eval`:
passkey and needle-in-a-haystack accuracy per length and needle depth, the retrieval suite (both groups, each model
against the original), loss by position, held-out perplexity, and lm-evaluation-harness tasks whose data is at hand. Writes evaluation.json, evaluation.md and the PNGs to --output.

The four models come from two checkpoints, each loaded once:
- `original`: the converted checkpoint's weights (the pretrained model's) under full attention;
- `converted`: the converted checkpoint as planned, before training;
- `finetuned`: the finetuned checkpoint as planned;
- `window_only`: the finetuned checkpoint with its slot reads off (its sliding windows alone).

    python benchmarks/retrieval_quality.py --converted outputs/smollm2-nha --finetuned outputs/smollm2-gpu/model
    ... --lengths 1024,2048,4096,8192,16384 --allow-beyond-positions --batch-size 8    # 1K-16K on a GPU
    ... --quick                                                                        # a CPU smoke test

Lengths default to powers of two from 1K to 4x the finetuning's sequence length, within the model's positions.
The targets are checked and reported: after training, retrieval accuracy at every length up to 8K is at least 90% of
the original's; beyond the window it is above the window-only baseline.
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
QUICK = dict(lengths=[512], depths=[0, 100], samples=1, suite_samples=1, group="heldout", position_length=512,
             sequences=1, max_tokens=512, chunk_len=256, limit=4)
SECTIONS = ("heldout", "harness", "retrieval", "suite", "positions")
TARGET_LENGTH = 8192  # accuracy at least 90% of the original's up to here
TARGET_SHARE = 0.9


def renamed(report: dict, names: dict) -> dict:
    """The measured sections of `report` with their variants renamed (variant -> model), other keys dropped."""
    def rename(values):
        return {names[variant]: value for variant, value in values.items()}

    out = {}
    if report.get("heldout"):
        out["heldout"] = {text: rename(values) for text, values in report["heldout"].items()}
    if report.get("harness"):
        out["harness"] = {task: {**entry, "metrics": {m: rename(v) for m, v in entry["metrics"].items()}}
                          for task, entry in report["harness"].items()}
    if report.get("retrieval"):
        out["retrieval"] = {task: {**result, "accuracy": rename(result["accuracy"])}
                            for task, result in report["retrieval"].items()}
    if report.get("suite"):
        out["suite"] = {**report["suite"], "variants": [names[v] for v in report["suite"]["variants"]],
                        "reference": None, "groups": {
                            group: {"haystacks": entry["haystacks"], "overall": rename(entry["overall"]),
                                    "tasks": {task: {"cells": rename(scores["cells"]),
                                                     "summary": rename(scores["summary"])}
                                              for task, scores in entry["tasks"].items()}}
                            for group, entry in report["suite"]["groups"].items()}}
    if report.get("positions"):
        out["positions"] = {**report["positions"], "loss": rename(report["positions"]["loss"])}
    return out


def merged_suite(first: dict, second: dict) -> dict:
    """Two renamed suite results of the same samples as one, each model against the original."""
    from nha_retrofit.eval.retrieval_suite import against_reference

    groups = {
        group: {"haystacks": entry["haystacks"], "overall": {**entry["overall"], **second["groups"][group]["overall"]},
                "tasks": {task: {key: {**scores[key], **second["groups"][group]["tasks"][task][key]}
                                 for key in ("cells", "summary")} for task, scores in entry["tasks"].items()}}
        for group, entry in first["groups"].items()
    }
    return against_reference({**first, "variants": first["variants"] + second["variants"], "groups": groups},
                             "original")


def merged(first: dict, second: dict) -> dict:
    """The sections of two renamed reports, model by model."""
    out = {}
    for section in SECTIONS:
        if section == "positions" and first.get(section):
            out[section] = {**first[section], "loss": {**first[section]["loss"], **second[section]["loss"]}}
        elif section == "suite" and first.get(section):
            out[section] = merged_suite(first[section], second[section])
        elif first.get(section):
            out[section] = {}
            for key, entry in first[section].items():
                other = second[section][key]
                if section == "heldout":
                    out[section][key] = {**entry, **other}
                elif section == "harness":
                    out[section][key] = {**entry, "metrics": {m: {**v, **other["metrics"][m]}
                                                              for m, v in entry["metrics"].items()}}
                else:
                    out[section][key] = {**entry, "accuracy": {**entry["accuracy"], **other["accuracy"]}}
    return out


def targets(retrieval: dict, window: int) -> list[dict]:
    """Per task and length: the finetuned model's mean accuracy against the original's (up to 8K) and against the
    window-only baseline (beyond the window), and whether each target is met."""
    rows = []
    for task, result in retrieval.items():
        for i, length in enumerate(result["lengths"]):
            mean = {model: sum(grid[i]) / len(grid[i]) for model, grid in result["accuracy"].items()}
            row = {"task": task, "length": length, **{f"{m}_accuracy": a for m, a in mean.items()}}
            if length <= TARGET_LENGTH:
                row["at_least_90pct_of_original"] = mean["finetuned"] >= TARGET_SHARE * mean["original"]
            if length > window:
                row["above_window_only"] = mean["finetuned"] > mean["window_only"]
            rows.append(row)
    return rows


def targets_table(rows: list[dict]) -> str:
    lines = ["### Targets: finetuned against the original (up to 8K) and the window-only baseline", "",
             "| task | tokens | original | finetuned | window only | >= 90% of original | above window only |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        flags = [{True: "yes", False: "no", None: "-"}[row.get(key)]
                 for key in ("at_least_90pct_of_original", "above_window_only")]
        lines.append(f"| {row['task']} | {row['length']} | {100 * row['original_accuracy']:.1f} | "
                     f"{100 * row['finetuned_accuracy']:.1f} | {100 * row['window_only_accuracy']:.1f} | "
                     f"{' | '.join(flags)} |")
    return "\n".join(lines)


def main(argv=None):
    from nha_retrofit.eval.evaluate import HeldoutSpec, evaluate_checkpoint
    from nha_retrofit.eval.positions import PositionSpec
    from nha_retrofit.eval.report import format_report, write_outputs
    from nha_retrofit.eval.retrieval import DEFAULT_DEPTHS, RetrievalSpec, check_lengths, default_lengths
    from nha_retrofit.eval.retrieval_suite import SUITE_SAMPLES, SuiteSpec
    from nha_retrofit.eval.variants import read_checkpoint_facts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converted", required=True, type=Path, help="the checkpoint written by `convert`")
    parser.add_argument("--finetuned", required=True, type=Path, help="the checkpoint exported by `finetune`")
    parser.add_argument("--name", default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, help="default: benchmarks/results/retrieval_quality_<name>")
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes: " + ", ".join(
        f"{key}={value}" for key, value in QUICK.items()))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--depths", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_DEPTHS))
    parser.add_argument("--samples", type=int, default=10, help="passkey and niah: per length and depth")
    parser.add_argument("--suite-samples", type=int, default=SUITE_SAMPLES, help="the suite: per length and depth")
    parser.add_argument("--group", default="all", help="the suite's group: tuning, heldout or all")
    parser.add_argument("--haystack", help="the suite's haystack: a text file (default: each group's own texts)")
    parser.add_argument("--allow-beyond-positions", action="store_true")
    parser.add_argument("--position-length", type=int, help="default: the longest retrieval length")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--texts", default="python-stdlib,python-docs,shakespeare")
    parser.add_argument("--max-tokens", type=int, default=16384, help="held-out perplexity: tokens of each text")
    parser.add_argument("--chunk-len", type=int, default=2048)
    parser.add_argument("--harness-tasks", default="", help="lm-eval tasks whose data is in the local cache")
    parser.add_argument("--include-path", type=Path, help="a folder of lm-eval task YAML files")
    parser.add_argument("--limit", type=int)
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)

    positions, context = read_checkpoint_facts(args.finetuned)
    lengths = check_lengths(args.lengths or default_lengths(context, positions, args.allow_beyond_positions),
                            positions, args.allow_beyond_positions)
    texts = [t for t in args.texts.split(",") if t]
    tasks = ["heldout", "passkey", "niah", "suite", "positions", *[t for t in args.harness_tasks.split(",") if t]]
    common = dict(
        device=args.device, dtype=args.dtype, batch_size=args.batch_size, limit=args.limit,
        include_path=args.include_path, allow_beyond_positions=args.allow_beyond_positions, plots=True,
        progress=True,
    )

    specs = dict(heldout=HeldoutSpec(texts, args.max_tokens, args.chunk_len),
                 retrieval=RetrievalSpec(lengths, args.depths, args.samples),
                 suite=SuiteSpec(lengths, args.depths, args.suite_samples, args.group, args.haystack),
                 positions=PositionSpec(args.position_length or max(lengths), args.sequences, texts))
    before = evaluate_checkpoint(args.converted, tasks, variants=["original", "nha"], **specs, **common)
    after = evaluate_checkpoint(args.finetuned, tasks, variants=["nha", "window_only"], **specs, **common)
    report = {
        "checkpoint": f"{args.converted} (original, converted) and {args.finetuned} (finetuned, window only)",
        **{key: after[key] for key in ("device", "dtype", "torch", "transformers", "python", "windows",
                                       "max_position_embeddings", "training_context")},
        "variants": ["original", "converted", "finetuned", "window_only"],
        **merged(renamed(before, {"original": "original", "nha": "converted"}),
                 renamed(after, {"nha": "finetuned", "window_only": "window_only"})),
    }
    window = max(w for w in report["windows"] if w is not None)
    report["targets"] = targets(report["retrieval"], window)
    output = args.output or ROOT / "benchmarks" / "results" / f"retrieval_quality_{args.name}"
    write_outputs(report, output, overwrite=True, appendix=targets_table(report["targets"]))
    print(format_report(report) + "\n" + targets_table(report["targets"]))
    print(f"\nwritten to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
