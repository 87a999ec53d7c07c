"""PNG figures of an evaluation: a retrieval accuracy heatmap per task and model, a retrieval suite heatmap per group
and model (tasks by lengths, against the reference), and the loss by position of every model on one plot.
matplotlib is an optional extra (`pip install 'nha-retrofit[eval]'`), drawn off-screen."""

from __future__ import annotations

from pathlib import Path

from ..errors import NHARetrofitError
from .harness import EVAL_EXTRA
from .variants import VARIANT_TITLES


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise NHARetrofitError(f"the PNG plots need matplotlib: {EVAL_EXTRA}") from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def title(variant: str) -> str:
    return VARIANT_TITLES.get(variant, variant)


def retrieval_heatmap(path: Path, task: str, variant: str, result: dict) -> None:
    """Accuracy of one model on one task: lengths down, depths across, each cell labelled in percent."""
    plt = _pyplot()
    grid = result["accuracy"][variant]
    lengths, depths = result["lengths"], result["depths"]
    figure, axes = plt.subplots(figsize=(1.2 + 0.9 * len(depths), 1.0 + 0.5 * len(lengths)))
    image = axes.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    axes.set_xticks(range(len(depths)), [f"{depth:g}%" for depth in depths])
    axes.set_yticks(range(len(lengths)), [str(length) for length in lengths])
    axes.set_xlabel("needle depth")
    axes.set_ylabel("tokens")
    for row, values in enumerate(grid):
        for column, value in enumerate(values):
            axes.text(column, row, f"{100 * value:.0f}", ha="center", va="center", fontsize=8)
    axes.set_title(f"{task}: {title(variant)} ({result['samples']} samples per cell)", fontsize=9)
    figure.colorbar(image, ax=axes, label="accuracy")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def suite_heatmap(path: Path, group: str, variant: str, result: dict) -> None:
    """One model on one group of the suite, tasks down, lengths across: its accuracy over the reference's (the
    reference itself, or with no reference: its accuracy), each cell labelled with both."""
    plt = _pyplot()
    tasks, lengths, reference = result["groups"][group]["tasks"], result["lengths"], result["reference"]
    ratios = reference is not None and variant != reference
    accuracy = [[stat["accuracy"] for stat in scores["summary"][variant]] for scores in tasks.values()]
    shown = [[1.0 if r is None else min(r, 1.0) for r in scores["ratio"][variant]] for scores in tasks.values()] \
        if ratios else accuracy
    figure, axes = plt.subplots(figsize=(1.6 + 1.0 * len(lengths), 1.0 + 0.45 * len(tasks)))
    image = axes.imshow(shown, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    axes.set_xticks(range(len(lengths)), [str(length) for length in lengths])
    axes.set_yticks(range(len(tasks)), list(tasks))
    axes.set_xlabel("tokens")
    for row, scores in enumerate(tasks.values()):
        for column in range(len(lengths)):
            label = f"{100 * accuracy[row][column]:.0f}%"
            if ratios:
                ratio = scores["ratio"][variant][column]
                label = f"{'-' if ratio is None else f'{ratio:.2f}'}\n{label}"
            axes.text(column, row, label, ha="center", va="center", fontsize=7)
    what = f"{title(variant)} / {title(reference)}" if ratios else f"{title(variant)}, accuracy"
    axes.set_title(f"retrieval suite, {group} group: {what}", fontsize=9)
    figure.colorbar(image, ax=axes, label=f"accuracy / {title(reference)}'s" if ratios else "accuracy")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def positions_plot(path: Path, result: dict) -> None:
    """Mean next-token loss per position range, one line per model, positions on a log scale."""
    plt = _pyplot()
    centres = [(start + end) / 2 for start, end in result["buckets"]]
    figure, axes = plt.subplots(figsize=(7, 4))
    for variant, losses in result["loss"].items():
        axes.plot(centres, losses, marker="o", label=title(variant))
    axes.set_xscale("log", base=2)
    axes.set_xlabel("position (centre of the range)")
    axes.set_ylabel("mean next-token loss")
    axes.set_title(f"loss by position ({result['sequences']} x {result['length']} tokens)", fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
