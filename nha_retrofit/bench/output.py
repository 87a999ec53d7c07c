"""The files of a bench report: JSON with every record, the markdown tables (`report.py`) and the PNG charts
(`plots.py`, where matplotlib is installed)."""

import json
from pathlib import Path

from ..atomic import atomic_file
from . import plots
from .report import format_report


def write_report(report: dict, folder: Path, stem: str = "bench", charts_folder: Path | None = None) -> list[Path]:
    """`stem`.json and `stem`.md into `folder` and, where matplotlib is installed, the charts (`plots.py`) into
    `charts_folder` (default: `folder`), each file atomically: the paths written."""
    folder = Path(folder)
    written = []
    for suffix, text in ((".json", json.dumps(report, indent=2) + "\n"), (".md", format_report(report) + "\n")):
        with atomic_file(folder / f"{stem}{suffix}") as tmp:
            tmp.write_text(text)
        written.append(folder / f"{stem}{suffix}")
    if plots.available():
        written += plots.write_plots(report, Path(charts_folder or folder), stem)
    return written
