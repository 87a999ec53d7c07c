"""The bench report's charts (matplotlib, an optional extra): latency against context, memory against context, and
decode tokens per second against batch size, every measured path on each."""

import importlib.util
from pathlib import Path

from ..atomic import atomic_file
from .report import context_label, paths

MISSING = "charts need matplotlib: pip install 'nha-retrofit[plots]'"
STYLE = {"nha": dict(color="tab:blue", marker="s", label="NHA"),
         "original, eager": dict(color="tab:gray", marker="o", label="original, eager"),
         "original, compiled": dict(color="tab:orange", marker="^", label="original, compiled"),
         "original, every window full": dict(color="tab:green", marker="v", label="original, every window full")}


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _series(rows, key):
    """(contexts, values) of the rows that fit, by context."""
    points = sorted((r["context"], r[key]) for r in rows if r["fits"] and r.get(key) is not None)
    return [p[0] for p in points], [p[1] for p in points]


def _context_axis(axis, contexts):
    axis.set_xscale("log", base=2)
    axis.set_xticks(contexts, [context_label(c) for c in contexts])
    axis.set_xlabel("context (tokens)")
    axis.grid(alpha=0.3)


def _save(figure, path: Path) -> Path:
    with atomic_file(path) as tmp:
        figure.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    return path


def write_plots(report: dict, folder: Path, stem: str) -> list[Path]:
    """`stem`_latency.png, `stem`_memory.png and, with batch runs, `stem`_throughput.png in `folder`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    title = (report.get("model") or {}).get("name") or "model"
    subtitle = f"{report['machine']['device']}, {report['dtype']}"
    contexts = sorted({r["context"] for r in report["latency"]})
    names = paths(report)
    by_model = {name: [r for r in report["latency"] if r["model"] == name] for name in names}
    written = []

    figure, axes = pyplot.subplots(1, 2, figsize=(11, 4))
    for axis, key, label in ((axes[0], "prefill_ms", "prefill (ms)"), (axes[1], "decode_ms_per_token",
                                                                        "decode (ms per token)")):
        for name in names:
            axis.plot(*_series(by_model[name], key), **STYLE[name])
        _context_axis(axis, contexts)
        axis.set_ylabel(label)
        axis.legend()
    axes[0].set_yscale("log")
    axes[1].set_ylim(bottom=0)
    figure.suptitle(f"{title}: latency at batch 1 ({subtitle})")
    written.append(_save(figure, Path(folder) / f"{stem}_latency.png"))
    pyplot.close(figure)

    peak = any(r.get("peak_bytes") is not None for r in report["latency"])
    figure, axis = pyplot.subplots(figsize=(6, 4))
    for name in names:
        xs, ys = _series(by_model[name], "peak_bytes" if peak else "cache_bytes")
        axis.plot(xs, [y / 2**30 for y in ys], **STYLE[name])
        if peak:
            xs, ys = _series(by_model[name], "cache_bytes")
            axis.plot(xs, [y / 2**30 for y in ys], linestyle="--", color=STYLE[name]["color"],
                      label=f"{STYLE[name]['label']}: cache")
    _context_axis(axis, contexts)
    axis.set_ylabel("peak memory, weights included (GiB)" if peak else "cache (GiB)")
    axis.legend()
    axis.set_title(f"{title}: memory at batch 1 ({subtitle})")
    written.append(_save(figure, Path(folder) / f"{stem}_memory.png"))
    pyplot.close(figure)

    batch_contexts = sorted({r["context"] for r in report["throughput"]})
    if batch_contexts:
        figure, axes = pyplot.subplots(1, len(batch_contexts), figsize=(5.5 * len(batch_contexts), 4), squeeze=False)
        for axis, length in zip(axes[0], batch_contexts):
            for name in names:
                points = sorted((r["batch"], r["tokens_per_s"]) for r in report["throughput"]
                                if r["model"] == name and r["context"] == length and r["fits"])
                if points:
                    axis.plot([p[0] for p in points], [p[1] for p in points], **STYLE[name])
            batches = sorted({r["batch"] for r in report["throughput"] if r["context"] == length})
            axis.set_xscale("log", base=2)
            axis.set_xticks(batches, [str(b) for b in batches])
            axis.set_yscale("log")
            axis.set_xlabel("batch (sequences)")
            axis.set_ylabel("decode tokens per second")
            axis.set_title(f"context {context_label(length)}")
            axis.grid(alpha=0.3)
            axis.legend()
        figure.suptitle(f"{title}: decode throughput ({subtitle})")
        figure.tight_layout()
        written.append(_save(figure, Path(folder) / f"{stem}_throughput.png"))
        pyplot.close(figure)
    return written
