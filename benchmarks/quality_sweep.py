"""Quality-against-cost sweep (not a test): variants of a finetuning recipe trained side by side on one GPU, each
then scored on the retrieval suite and on held-out perplexity, with its plan's cost at the Llama-3-8B shape.

    python benchmarks/quality_sweep.py --recipe recipes/smollm2_gpu.yaml --tokens 3000000 \
        --variant base= --variant ret4=model.convert.full_layer_ids=[7,18,20,21] \
        --variant syn=data.synthetic.share=0.5 --output benchmarks/results/quality_sweep_smollm2_h200.json

Each `--variant NAME=OVERRIDE;OVERRIDE...` is the recipe plus `--set` overrides (empty: the recipe itself), trained
with `--tokens` LM tokens in its own process (`--parallel` at a time: a 135M model leaves most of an H200 idle,
so several runs share it). Every finished variant is scored against the original (the converted checkpoint's
weights under full attention, the same for every variant) on the tuning group of the retrieval suite, and its
held-out perplexity (the recipe's `eval` texts and chunk length) is read from its finetuning summary. Cost columns:
the plan mapped onto Llama-3-8B's 32 layers (the same share of full layers, the same window and slots): cache
bytes per sequence at 8K and 32K tokens against the original's, and decode ms per token at 32K where a bench JSON
is given (`--decode-json`, from `nha-retrofit bench --random-weights llama3-8b`).
Rows are added to the output JSON as they finish, so an interrupted sweep keeps what it measured. The JSON is written
compact (a third of its indented size): the results file travels with the tracked files to the GPU machine, whose
calls carry at most 64 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_8B = {"layers": 32, "kv_heads": 8, "head_dim": 128}
SMOLLM2_135M = {"kv_heads": 3, "head_dim": 64}  # the swept model (its layer count is in each row's plan)


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition("=")
    if not name:
        raise SystemExit(f"--variant {text!r}: expected NAME=OVERRIDE;OVERRIDE... (overrides may be empty)")
    return name, [o.strip() for o in overrides.split(";") if o.strip()]


def train_one(recipe: str, name: str, overrides: list[str], tokens: int, root: Path, side_by_side: int) -> None:
    """Child process: one finetuning run; its summary (held-out perplexities, tokens, time, how many runs shared the
    GPU) as summary.json."""
    from nha_retrofit.finetune import finetune

    out = root / name
    start = time.monotonic()
    summary = finetune(recipe, [*overrides, f"stages.lm.tokens={tokens}", f"train.output_dir={out}",
                                f"export.folder={out / 'model'}"], overwrite=True)
    summary["sweep_wall_time_s"] = round(time.monotonic() - start, 1)
    summary["side_by_side"] = side_by_side
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


def train_all(args, variants: dict, root: Path) -> None:
    """Runs every variant's training, `--parallel` processes at a time; each one's log is root/NAME.log."""
    pending = list(variants.items())
    running = []
    while pending or running:
        while pending and len(running) < args.parallel:
            name, overrides = pending.pop(0)
            (root / name).mkdir(parents=True, exist_ok=True)
            log = open(root / f"{name}.log", "w")
            command = [sys.executable, __file__, "--train-one", name, "--recipe", args.recipe, "--tokens",
                       str(args.tokens), "--root", str(root), "--parallel", str(args.parallel),
                       f"--variant={name}={';'.join(overrides)}"]
            running.append((name, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(5)
        for entry in list(running):
            name, process, log = entry
            if process.poll() is not None:
                log.close()
                running.remove(entry)
                print(f"{name}: training exited {process.returncode}", flush=True)


def cache_costs(windows: list, slots: int, layers: int, kv_heads: int, head_dim: int, width: int = 2,
                full_kv_heads: list | None = None, swept_kv_heads: int = 1) -> dict:
    """Cache bytes per sequence at 8K and 32K of a plan with the same share of full layers, of full KV heads (the
    swept model's `full_kv_heads` pairs over its `swept_kv_heads` per layer), window and slots on a model of `layers`
    layers, and their ratio to the original's (every layer full)."""
    from nha_retrofit.plan import nha_state_bytes

    full = round(sum(w is None for w in windows) / len(windows) * layers)
    heads = round(len(full_kv_heads or []) / (len(windows) * swept_kv_heads) * layers * kv_heads)
    window = max((w for w in windows if w is not None), default=0)
    per_token = 2 * kv_heads * head_dim * width
    state = nha_state_bytes(kv_heads, head_dim, slots, window, width)
    head_state = nha_state_bytes(1, head_dim, slots, window, width) - nha_state_bytes(0, head_dim, slots, window, width)
    costs = {"full_layers": full, "full_kv_heads": heads, "window": window, "slots": slots}
    for context in (8192, 32768):
        nha = full * context * per_token + (layers - full) * state + heads * (context * per_token // kv_heads - head_state)
        costs[f"cache_bytes_{context}"] = nha
        costs[f"cache_ratio_{context}"] = round(nha / (layers * context * per_token), 4)
    return costs


def evaluate(args, variants: dict, root: Path, converted: Path) -> None:
    """Scores every exported variant on the retrieval suite against the original; adds one row each to the JSON."""
    import torch

    from nha_retrofit.eval.retrieval_suite import SUITE_TASKS, build_suite, score_suite, suite_report
    from nha_retrofit.eval.variants import Variants, load_tokenizer
    from nha_retrofit.modeling.load import load_for_inference

    output = Path(args.output)
    results = json.loads(output.read_text()) if output.is_file() else {}
    results.setdefault("rows", {})
    tokenizer = load_tokenizer(converted)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    tasks = args.tasks.split(",") if args.tasks else SUITE_TASKS
    suite = build_suite(tokenizer, lengths=lengths, samples=args.samples, depths=depths, group=args.group,
                        seed=args.seed, tasks=tasks)
    scoring = dict(batch_size=args.batch_size, kv_cache=args.kv_cache_dtype)
    # the original is scored once: it is the same, deterministic model for every variant
    original = score_suite(Variants(load_for_inference(converted), ["original"]), suite, **scoring)
    decode = json.loads(Path(args.decode_json).read_text()) if args.decode_json else {}
    for name, overrides in variants.items():
        folder = root / name / "model"
        summary_path = root / name / "summary.json"
        if not folder.is_dir() or not summary_path.is_file():
            print(f"{name}: no exported model; skipped", flush=True)
            continue
        summary = json.loads(summary_path.read_text())
        model = load_for_inference(folder)
        hits = {**original, **score_suite({"nha": model}, suite, **scoring)}
        scored = suite_report(hits, suite, ["original", "nha"], kv_cache=args.kv_cache_dtype)
        windows = list(model.config.nha_windows)
        plan = {"full_layer_ids": [i for i, w in enumerate(windows) if w is None],
                "full_kv_heads": model.config.nha_full_kv_head_pairs,
                "window": max((w for w in windows if w is not None), default=0),
                "slots": model.config.nha_num_slots, "layers": len(windows),
                "gate_bias_init": model.config.nha_gate_bias_init}
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        before, after = summary.get("before", {}), summary.get("after", {})
        texts = sorted(k[: -len("_original_ppl")] for k in before if k.endswith("_original_ppl"))
        row_name = name + (f"+kv_{args.kv_cache_dtype}" if args.kv_cache_dtype else "")
        results["rows"][row_name] = {
            "machine": summary.get("machine"),
            "run": f"at most {summary.get('side_by_side', args.parallel)} training(s) side by side on the GPU, "
                   f"{args.tokens / 1e6:.2f}M LM tokens each",
            "date": time.strftime("%Y-%m-%d"),
            "scorer": f"retrieval suite, group {args.group}, depths {args.depths} x {args.samples} samples per length"
                      + (f", tasks {args.tasks}" if args.tasks else "")
                      + (f"; the NHA model through a static cache in {args.kv_cache_dtype}" if args.kv_cache_dtype
                         else ""),
            "overrides": overrides,
            "trainable": summary.get("trainable"),
            "lm_tokens": args.tokens,
            "tokens": summary.get("tokens"),
            "train_wall_time_s": summary.get("wall_time_s"),
            "suite": scored,
            "perplexity_ratio": {t: after.get(f"{t}_ppl", float("nan")) / before[f"{t}_original_ppl"] for t in texts},
            "perplexity": {t: {"original": before[f"{t}_original_ppl"], "after": after.get(f"{t}_ppl")}
                           for t in texts},
            "plan": plan,
            **({"decode_ms_32k_llama3_8b": decode[name]} if name in decode else {}),
        }
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(results, separators=(",", ":")) + "\n")  # compact: it travels with the tree
        print(f"{row_name}: {json.dumps(results['rows'][row_name]['perplexity_ratio'])}", flush=True)


def accuracies(suite: dict, variant: str, group: str = "tuning") -> dict:
    """{task: [accuracy per length]} of one model in a row's `suite`: the retrieval suite's result (one group), or
    the shipped passkey/niah tasks' plain lists."""
    if "groups" in suite:
        return {task: [stat["accuracy"] for stat in entry["summary"][variant]]
                for task, entry in suite["groups"][group]["tasks"].items()}
    return suite[variant]


def row_summary(row: dict) -> dict:
    """One row of the quality-against-cost table: retrieval as the finetuned model's mean accuracy over tasks and
    lengths against the original's, the worst task and length ratio, held-out perplexity ratios, cache ratios."""
    plan = row["plan"]
    windows = [None if i in plan["full_layer_ids"] else plan["window"] for i in range(plan["layers"])]
    groups = list(row["suite"]["groups"]) if "groups" in row["suite"] else ["tuning"]
    retrieval = {}
    for group in groups:
        nha, original = accuracies(row["suite"], "nha", group), accuracies(row["suite"], "original", group)
        mean = lambda table: sum(sum(v) for v in table.values()) / sum(len(v) for v in table.values())  # noqa: E731
        retrieval[group] = mean(nha) / mean(original) if mean(original) > 0 else None  # nothing to compare with
    heads = dict(full_kv_heads=plan.get("full_kv_heads"), swept_kv_heads=SMOLLM2_135M["kv_heads"])
    return {
        "retrieval": retrieval,
        "perplexity_ratio": row["perplexity_ratio"],
        "own": cache_costs(windows, plan["slots"], plan["layers"], **SMOLLM2_135M, **heads),
        "llama3_8b": cache_costs(windows, plan["slots"], **LLAMA3_8B, **heads),
    }


def full_attention(plan: dict) -> str:
    """A row's full layers, and its full KV heads as layer:head."""
    heads = plan.get("full_kv_heads") or []
    return str(plan["full_layer_ids"]) + (" + " + " ".join(f"{layer}:{head}" for layer, head in heads) if heads else "")


def report(path: Path, image: Path | None) -> str:
    """The sweep's table as markdown (and its Pareto plot as a PNG when `image` is given)."""
    from nha_retrofit.bench.engine import machine_tag

    results = json.loads(path.read_text())
    lines = ["| setting | GPU | full layers (+ KV heads) | window | gate bias | trained | LM tokens | train s | "
             "retrieval vs original (tuning / held-out) | python-docs | python-stdlib | Hamlet | "
             "cache at 8K (SmolLM2 / 8B shape) | cache at 32K, 8B shape |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    points = []
    for name, row in results["rows"].items():
        summary = row_summary(row)
        ppl, gate_bias = summary["perplexity_ratio"], row["plan"]["gate_bias_init"]
        retrieval = " / ".join("-" if value is None else f"{value:.2f}" for value in summary["retrieval"].values())
        lines.append(
            f"| {name} | {machine_tag(row['machine'])} | {full_attention(row['plan'])} | {row['plan']['window']} | "
            f"{'-' if gate_bias is None else f'{gate_bias:g}'} | {row['trainable']} | {row['lm_tokens'] / 1e6:.2f}M | "
            f"{row['train_wall_time_s']:.0f} | {retrieval} | {ppl['python-docs']:.3f} | {ppl['python-stdlib']:.3f} | "
            f"{ppl['shakespeare']:.3f} | {summary['own']['cache_ratio_8192']:.3f} / "
            f"{summary['llama3_8b']['cache_ratio_8192']:.3f} | {summary['llama3_8b']['cache_ratio_32768']:.3f} |")
        if "kv_cache" not in row["suite"]:  # a trained row scored again through a cache: not a setting of its own
            points.append((name, summary))
    if image is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(1, 2, figsize=(13, 4.6))
        colors, markers = plt.get_cmap("tab20"), "osD^v<>p*"  # 20 colours x 9 markers: 180 distinct points
        for i, (name, summary) in enumerate(points):  # a legend, not labels: many settings share one cost
            style = {"color": colors(i % 20), "marker": markers[i % len(markers)], "label": name}
            if name == "default":  # the shipped setting stands out
                style.update(s=90, edgecolors="black", linewidths=1.2)
            retrieval = summary["retrieval"].get("tuning")
            if retrieval is not None:
                axes[0].scatter(summary["own"]["cache_ratio_8192"], retrieval, **style)
            axes[1].scatter(summary["own"]["cache_ratio_8192"], summary["perplexity_ratio"]["shakespeare"], **style)
        axes[0].set_ylabel("retrieval, finetuned / original (tuning tasks)")
        axes[1].set_ylabel("Hamlet perplexity, finetuned / original")
        axes[0].axhline(0.9, linestyle=":", color="grey")
        axes[1].axhline(1.05, linestyle=":", color="grey")
        for axis in axes:
            axis.set_xlabel("cache at 8K tokens / original's (SmolLM2-135M)")
            axis.axvline(0.25, linestyle=":", color="grey")
        gpus = " or ".join(sorted({machine_tag(row["machine"]).upper() for row in results["rows"].values()}))
        figure.suptitle(f"SmolLM2-135M quality against cache cost (each setting on one {gpus})")
        handles, labels = axes[1].get_legend_handles_labels()
        figure.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
        figure.tight_layout(rect=(0, 0, 0.87, 1))
        figure.savefig(image, dpi=110)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2_gpu.yaml"))
    parser.add_argument("--variant", action="append", default=[], help="NAME=OVERRIDE;OVERRIDE... (repeatable)")
    parser.add_argument("--tokens", type=int, default=3_000_000, help="LM-stage tokens of every variant")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--root", default=str(ROOT / "outputs" / "sweep"))
    parser.add_argument("--converted", help="the converted, untrained checkpoint whose original is the reference")
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--depths", default="0,25,50,75,100")
    parser.add_argument("--group", default="tuning", help="the retrieval suite's group scored")
    parser.add_argument("--tasks", help="comma-separated suite tasks (default: all): a row of some tasks alone "
                                        "measures a cell more closely; keep it out of the sweep's --output, whose "
                                        "table compares rows over every task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--kv-cache-dtype", help="score the NHA model through a static cache whose full layers "
                                                 "store keys and values in this dtype (auto, float8_e4m3); the row "
                                                 "is named NAME+kv_DTYPE")
    parser.add_argument("--decode-json", help="{variant: decode ms per token at 32K} measured at the 8B shape")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "quality_sweep.json"))
    parser.add_argument("--train-one", help=argparse.SUPPRESS)
    parser.add_argument("--skip-training", action="store_true", help="score the variants already trained")
    parser.add_argument("--report", metavar="IMAGE", nargs="?", const="",
                        help="print the table of --output, write it beside as .md (and its Pareto plot to IMAGE) "
                             "instead of running")
    args = parser.parse_args(argv)
    if args.report is not None:  # the table also goes beside the JSON, as NAME.md
        table = report(Path(args.output), Path(args.report) if args.report else None)
        Path(args.output).with_suffix(".md").write_text(table + "\n")
        print(table)
        return 0
    variants = dict(parse_variant(v) for v in args.variant)
    root = Path(args.root)
    if args.train_one:
        train_one(args.recipe, args.train_one, variants[args.train_one], args.tokens, root, args.parallel)
        return 0
    if not variants:
        parser.error("give at least one --variant")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    root.mkdir(parents=True, exist_ok=True)
    if not args.skip_training:
        train_all(args, variants, root)
    if args.converted:
        evaluate(args, variants, root, Path(args.converted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
