"""The bench report as markdown tables, from the measurements of `eval.speed.run_benchmark`."""

MODELS = ("original", "nha")
DOES_NOT_FIT = "does not fit"


def human_bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def context_label(tokens: int) -> str:
    """4096 -> 4K, 131072 -> 128K; other lengths as they are."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def _pair(rows, key, fmt):
    return " / ".join(DOES_NOT_FIT if not row["fits"] else fmt(row[key]) if row.get(key) is not None else "-"
                      for row in rows)


def latency_table(report: dict) -> list[str]:
    rows = {(r["context"], r["model"]): r for r in report["latency"]}
    columns = [("prefill ms", "prefill_ms", "{:.1f}".format), ("decode ms per token", "decode_ms_per_token",
               "{:.2f}".format), ("cache", "cache_bytes", human_bytes)]
    if any(r.get("peak_bytes") is not None for r in report["latency"]):
        columns.append(("peak memory", "peak_bytes", human_bytes))
    eager = any(r.get("eager_decode_ms_per_token") is not None for r in report["latency"])
    lines = ["| context | " + " | ".join(f"{title}, original / NHA" for title, _, _ in columns)
             + (" | original's decode ms per token, eager on its dynamic cache" if eager else "") + " |",
             "|---|" + "---|" * (len(columns) + eager)]
    for length in sorted({context for context, _ in rows}):
        pair = [rows[length, name] for name in MODELS]
        cells = [_pair(pair, key, fmt) for _, key, fmt in columns]
        if eager:
            cells.append(_pair(pair[:1], "eager_decode_ms_per_token", "{:.2f}".format))
        lines.append(f"| {context_label(length)} | " + " | ".join(cells) + " |")
    return lines


def throughput_table(report: dict) -> list[str]:
    rows = {(r["context"], r["batch"], r["model"]): r for r in report["throughput"]}
    lines = ["| context | batch | decode tokens/s, original | NHA |", "|---|---|---|---|"]
    for length, batch in sorted({(c, b) for c, b, _ in rows}):
        cells = []
        for name in MODELS:
            row = rows.get((length, batch, name))
            cells.append("-" if row is None else f"{row['tokens_per_s']:,.0f}" if row["fits"] else DOES_NOT_FIT)
        lines.append(f"| {context_label(length)} | {batch} | " + " | ".join(cells) + " |")
    return lines


def largest_batch_lines(report: dict) -> list[str]:
    largest = {(r["context"], r["model"]): r for r in report["largest_batch"]}
    lines = ["| context | largest batch, original | NHA |", "|---|---|---|"]
    for length in sorted({context for context, _ in largest}):
        cells = []
        for name in MODELS:
            row = largest.get((length, name))
            if row is None:
                cells.append(DOES_NOT_FIT)
            elif row["first_failing"] is None:
                cells.append(f">= {row['largest_batch']} (all sizes tried fit)")
            else:
                cells.append(f"{row['largest_batch']} ({row['first_failing']} does not fit)")
        lines.append(f"| {context_label(length)} | " + " | ".join(cells) + " |")
    return lines


def format_report(report: dict) -> str:
    """The report as markdown: a header naming the model, machine and decode paths, then one table per measurement."""
    model = report.get("model", {})
    name = model.get("name") or model.get("checkpoint", "model")
    machine = report["machine"]
    lines = [f"{name}: NHA against the original with the same weights"
             + (" (random weights)" if model.get("random_weights") else ""), "",
             f"{machine['device']}, {report['dtype']}, torch {machine['torch']}, transformers {machine['transformers']}"
             + (f", Triton {machine['triton']}" if machine.get("triton") else "")]
    if model.get("plan_description"):
        lines.append(f"plan: {model['plan_description']}")
    lines += [f"decode, NHA: {report['decode']['nha']}", f"decode, original: {report['decode']['original']}",
              f"batch 1: medians of {report['rounds']} alternating rounds after an untimed one, "
              f"{report['decode_steps']} timed decode steps each", "", "Batch 1:", ""]
    lines += latency_table(report)
    for row in report.get("original_compiled", []):
        if row.get("decode_ms_per_token") is not None:
            result = f"{row['decode_ms_per_token']:.2f} ms per token"
        else:
            result = DOES_NOT_FIT if row.get("fits") is False else f"failed ({row.get('error')})"
        lines += ["", f"The original through torch.compile(mode='reduce-overhead') at {context_label(row['context'])}, "
                  f"batch 1: {result}."]
    if report["throughput"]:
        lines += ["", "Decode throughput, every sequence holding the context (the cache of one prefill, copied):", ""]
        lines += throughput_table(report) + [""] + largest_batch_lines(report)
    if report["longest_context"]:
        lines += ["", "| longest context, batch 1 | tokens | limited by |", "|---|---|---|"]
        lines += [f"| {r['model']} | {r['longest_context']} | "
                  + (f"memory ({r['first_failing']} does not fit)" if r["first_failing"] else
                     "the model's positions (it fits)") + " |" for r in report["longest_context"]]
    return "\n".join(lines)
