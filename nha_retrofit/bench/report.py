"""The bench report as markdown tables, from the measurements of `engine.run_benchmark`."""

DOES_NOT_FIT = "does not fit"


def human_bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def context_label(tokens: int) -> str:
    """4096 -> 4K, 131072 -> 128K; other lengths as they are."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def paths(report: dict) -> list[str]:
    """NHA first, then the baselines, as measured."""
    return list(report["paths"])


def timed(row: dict, key: str, digits: int) -> str:
    """A median with its range over the rounds: 7.31 (7.29-7.40)."""
    if row.get(key) is None:
        return "-"
    low, high = row.get(f"{key}_range") or (row[key], row[key])
    return f"{row[key]:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def latency_table(report: dict) -> list[str]:
    peak = any(r.get("peak_bytes") is not None for r in report["latency"])
    lines = ["| context | path | prefill ms | decode ms per token | cache" + (" | peak memory" if peak else "") + " |",
             "|---|---|---|---|---|" + ("---|" if peak else "")]
    order = {path: index for index, path in enumerate(paths(report))}
    for row in sorted(report["latency"], key=lambda r: (r["context"], order.get(r["model"], len(order)))):
        if not row["fits"]:
            cells = [f"failed ({row['error']})" if row.get("error") else DOES_NOT_FIT, "", ""] + [""] * peak
        else:
            cells = [timed(row, "prefill_ms", 1), timed(row, "decode_ms_per_token", 2), human_bytes(row["cache_bytes"])]
            if peak:
                cells.append(human_bytes(row["peak_bytes"]) if row.get("peak_bytes") is not None else "-")
        lines.append(f"| {context_label(row['context'])} | {row['model']} | " + " | ".join(cells) + " |")
    return lines


def speedup_table(report: dict) -> list[str]:
    lines = ["| context | decode: fastest baseline | NHA speed-up | bound from the bytes read per step | "
             "prefill: fastest baseline | NHA speed-up |", "|---|---|---|---|---|---|"]
    for row in report["speedups"]:
        cells = []
        for key, digits in (("decode_ms_per_token", 2), ("prefill_ms", 1)):
            found = row.get(key)
            cells += ([f"{found['baseline']} ({found['baseline_ms']:.{digits}f} ms)", f"{found['speedup']:.2f}x"]
                      if found else ["-", "-"])
            if key == "decode_ms_per_token":
                cells.append(f"{found['bytes_bound']:.2f}x" if found and found.get("bytes_bound") else "-")
        lines.append(f"| {context_label(row['context'])} | " + " | ".join(cells) + " |")
    return lines


def throughput_table(report: dict) -> list[str]:
    names = [path for path in paths(report) if any(r["model"] == path for r in report["throughput"])]
    rows = {(r["context"], r["batch"], r["model"]): r for r in report["throughput"]}
    lines = ["| context | batch | " + " | ".join(f"decode tokens/s, {name}" for name in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for length, batch in sorted({(c, b) for c, b, _ in rows}):
        cells = []
        for name in names:
            row = rows.get((length, batch, name))
            cells.append("-" if row is None else f"{row['tokens_per_s']:,.0f}" if row["fits"] else DOES_NOT_FIT)
        lines.append(f"| {context_label(length)} | {batch} | " + " | ".join(cells) + " |")
    return lines


def largest_batch_lines(report: dict) -> list[str]:
    lines = ["| context | path | largest batch |", "|---|---|---|"]
    for row in sorted(report["largest_batch"], key=lambda r: r["context"]):
        if row["first_failing"] is None:
            cell = f">= {row['largest_batch']} (all sizes tried fit)"
        else:
            cell = f"{row['largest_batch']} ({row['first_failing']} does not fit)"
        lines.append(f"| {context_label(row['context'])} | {row['model']} | {cell} |")
    return lines


def memory_lines(report: dict) -> list[str]:
    estimated = any(r["largest_batch"] is not None for r in report["memory_accounting"])
    lines = ["| context | cache | keys and values in | bytes per sequence"
             + (" | largest batch, by memory accounting" if estimated else "") + " |",
             "|---|---|---|---|" + ("---|" if estimated else "")]
    for row in report["memory_accounting"]:
        cells = [row["model"], row["kv_cache_dtype"], human_bytes(row["bytes_per_sequence"])]
        if estimated:
            cells.append(str(row["largest_batch"]) if row["largest_batch"] is not None else "-")
        lines.append(f"| {context_label(row['context'])} | " + " | ".join(cells) + " |")
    return lines


# Measured on the CPU VM (2 cores, fp32, SmolLM2-135M with 4 full layers, window 64, 64 slots; docs/benchmarks.md)
CPU_NOTE = (
    "On the CPU, NHA runs in plain PyTorch (its Triton kernels need CUDA) and is slower than the original's fused "
    "attention: 1.2-1.8x its prefill time and 1.13x its decode time from 256 to 2K tokens on a 2-core CPU. What it "
    "saves on the CPU is memory: each NHA layer's cache stays the same size at any context. Its speed pays off on "
    "CUDA."
)


def format_report(report: dict) -> str:
    """The report as markdown: a header naming the model, machine and decode paths, then one table per measurement."""
    model = report.get("model", {})
    name = model.get("name") or model.get("checkpoint", "model")
    machine = report["machine"]
    lines = [f"{name}: NHA against the original at its best, with the same weights"
             + (" (random weights)" if model.get("random_weights") else ""), "",
             f"{machine['device']}, {report['dtype']}, torch {machine['torch']}, transformers {machine['transformers']}"
             + (f", Triton {machine['triton']}" if machine.get("triton") else "")]
    if model.get("plan_description"):
        lines.append(f"plan: {model['plan_description']}")
    lines += [f"decode, {path}: {description}" for path, description in report["paths"].items()]
    lines += [f"batch 1: medians (min-max) of {report['rounds']} rounds after an untimed one, {report['round_order']}; "
              f"{report['decode_steps']} timed decode steps each; speed-ups against the fastest baseline", ""]
    lines += [f"warning: {warning}" for warning in report["warnings"]] + ([""] if report["warnings"] else [])
    lines += ["Batch 1:", ""] + latency_table(report) + [""] + speedup_table(report)
    if report["throughput"]:
        lines += ["", "Decode throughput, every sequence holding the context (the cache of one prefill, copied):", ""]
        lines += throughput_table(report) + [""] + largest_batch_lines(report)
        lines += [""] + [f"At {context_label(r['context'])}, NHA's best {r['nha_tokens_per_s']:,.0f} tokens/s against "
                         f"{r['baseline_tokens_per_s']:,.0f} for {r['baseline']}: {r['speedup']:.2f}x."
                         for r in report["batch_speedups"]]
    if report["memory_accounting"]:
        lines += ["", "Static caches per sequence (context plus the decode steps):", ""] + memory_lines(report)
    if report["longest_context"]:
        lines += ["", "| longest context, batch 1 | tokens | limited by |", "|---|---|---|"]
        lines += [f"| {r['model']} | {r['longest_context']} | "
                  + (f"memory ({r['first_failing']} does not fit)" if r["first_failing"] else
                     "the model's positions (it fits)") + " |" for r in report["longest_context"]]
    if machine["device"] == "cpu":
        lines += ["", CPU_NOTE]
    return "\n".join(lines)
