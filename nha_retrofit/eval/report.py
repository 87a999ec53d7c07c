"""An evaluation's report: markdown tables, the output folder (JSON, markdown, PNGs, written atomically), and the
record of the latest evaluation kept in the checkpoint folder (`nha_eval.json`, which `push` turns into the model
card's `eval_results`)."""

from __future__ import annotations

import json
from pathlib import Path

from ..atomic import atomic_file, atomic_folder
from ..errors import NHARetrofitError
from .variants import VARIANT_TITLES

EVAL_RECORD = "nha_eval.json"
TASK_SECTIONS = ("heldout", "harness", "retrieval")  # keyed by text or task
ONE_MEASUREMENT = ("suite", "positions")
REPORT_JSON, REPORT_MARKDOWN, POSITIONS_PNG = "evaluation.json", "evaluation.md", "positions.png"


def _title(variant: str) -> str:
    return VARIANT_TITLES.get(variant, variant)


def _cell(values: dict, variant: str, form: str) -> str:
    return form.format(values[variant]) if variant in values else "-"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def heldout_table(section: dict, variants: list[str]) -> list[str]:
    rows = [[text, *(_cell(values, v, "{:.2f}") for v in variants)] for text, values in section.items()]
    return ["### Held-out perplexity", "", *_table(["text", *map(_title, variants)], rows)]


def harness_table(section: dict, variants: list[str]) -> list[str]:
    rows = [[task, metric, str(entry["examples"]), *(_cell(values, v, "{:.4f}") for v in variants)]
            for task, entry in section.items() for metric, values in entry["metrics"].items()]
    return ["### lm-evaluation-harness", "", *_table(["task", "metric", "examples", *map(_title, variants)], rows)]


def retrieval_tables(section: dict, variants: list[str]) -> list[str]:
    """Per task: accuracy per length (mean over depths) of every model, then each model's length x depth grid."""
    lines = []
    for task, result in section.items():
        shown = [v for v in variants if v in result["accuracy"]]
        depths = ", ".join(f"{d:g}%" for d in result["depths"])
        lines += [f"### {task}: accuracy (%), mean over needle depths {depths}; {result['samples']} samples per "
                  f"length and depth, haystack {result['haystack']}, seed {result['seed']}", ""]
        rows = [[str(length), *(f"{100 * sum(result['accuracy'][v][i]) / len(result['depths']):.1f}" for v in shown)]
                for i, length in enumerate(result["lengths"])]
        lines += _table(["tokens", *map(_title, shown)], rows)
        for variant in shown:
            grid = [[str(length), *(f"{100 * value:.0f}" for value in result["accuracy"][variant][i])]
                    for i, length in enumerate(result["lengths"])]
            lines += ["", f"{task}, {_title(variant)}: accuracy (%) by length and needle depth", "",
                      *_table(["tokens", *(f"{d:g}%" for d in result["depths"])], grid)]
        lines.append("")
    return lines[:-1]


def _percent(stat: dict) -> str:
    low, high = stat["interval"]
    return f"{100 * stat['accuracy']:.1f} [{100 * low:.0f}-{100 * high:.0f}]"


def _against_bar(ratio: float | None, met: bool, level: float) -> str:
    return ("-" if ratio is None else f"{ratio:.2f}") + (" met" if met else f" below {100 * level:.1f}")


def suite_tables(result: dict, variants: list[str]) -> list[str]:
    """Per group: every model's accuracy per task and length with its 95% interval; then, against the reference,
    each model's ratio per task and length and whether it reaches the bar."""
    lines, lengths, reference = [], result["lengths"], result["reference"]
    shown = [v for v in variants if v in result["variants"]]
    depths = ", ".join(f"{d:g}%" for d in result["depths"])
    if "kv_cache" in result:
        lines += [f"The NHA models read each answer from a static cache, its full layers' keys and values in "
                  f"{result['kv_cache']}.", ""]
    for group, entry in result["groups"].items():
        overall = ", ".join(f"{_title(v)} {_percent(entry['overall'][v])}" for v in shown)
        lines += [f"### Retrieval suite, {group} group ({', '.join(entry['haystacks'])}): accuracy (%) [95% "
                  f"interval]; {result['samples']} samples per length and needle depth ({depths}), seed "
                  f"{result['seed']}", "", f"Over all tasks and lengths: {overall}.", ""]
        rows = [[task, _title(v), *(_percent(stat) for stat in scores["summary"][v])]
                for task, scores in entry["tasks"].items() for v in shown]
        lines += _table(["task", "model", *map(str, lengths)], rows)
        if reference is not None:
            others = [v for v in shown if v != reference]
            met = ", ".join(f"{_title(v)} {entry['meets_bar'][v]['met']} of {entry['meets_bar'][v]['of']}"
                            for v in others)
            rows = [[task, _title(v), *(_against_bar(r, m, level) for r, m, level in
                                        zip(scores["ratio"][v], scores["meets_bar"][v], scores["bar"]))]
                    for task, scores in entry["tasks"].items() for v in others]
            lines += ["", f"{group} group: accuracy over {_title(reference)}'s, and whether it reaches the bar (90% "
                          f"of {_title(reference)}'s, or {_title(reference)}'s minus 5 points where under 20%); bar "
                          f"met: {met}", "", *_table(["task", "model", *map(str, lengths)], rows)]
        lines.append("")
    return lines[:-1]


def positions_table(result: dict, variants: list[str]) -> list[str]:
    shown = [v for v in variants if v in result["loss"]]
    rows = [[f"{start}-{end}", *(f"{result['loss'][v][i]:.3f}" for v in shown)]
            for i, (start, end) in enumerate(result["buckets"])]
    return [f"### Mean next-token loss by position ({result['sequences']} x {result['length']} tokens of "
            f"{', '.join(result['texts'])})", "", *_table(["positions", *map(_title, shown)], rows)]


def format_report(report: dict) -> str:
    """Every measured section of `report` as markdown, after one line saying what was measured where."""
    variants = report["variants"]
    where = f"{report['checkpoint']}: " if "checkpoint" in report else ""
    lines = [f"{where}{report['device']}, {report['dtype']}, windows {report['windows']}"]
    sections = [
        ("heldout", heldout_table), ("harness", harness_table), ("retrieval", retrieval_tables),
        ("suite", suite_tables), ("positions", positions_table),
    ]
    for key, table in sections:
        if report.get(key):
            lines += ["", *table(report[key], variants)]
    return "\n".join(lines) + "\n"


def figures(report: dict) -> dict:
    """{file name: function(path) drawing it} for the report's retrieval, suite and position results."""
    from .plots import positions_plot, retrieval_heatmap, suite_heatmap

    drawn = {}
    for task, result in (report.get("retrieval") or {}).items():
        for variant in report["variants"]:
            drawn[f"{task}_{variant}.png"] = lambda path, t=task, v=variant, r=result: retrieval_heatmap(path, t, v, r)
    suite = report.get("suite")
    for group in (suite or {}).get("groups", {}):
        for variant in suite["variants"]:
            drawn[f"suite_{group}_{variant}.png"] = lambda path, g=group, v=variant: suite_heatmap(path, g, v, suite)
    if report.get("positions"):
        drawn[POSITIONS_PNG] = lambda path: positions_plot(path, report["positions"])
    return drawn


def write_outputs(report: dict, output: Path | None = None, json_path: Path | None = None, overwrite: bool = False,
                  appendix: str = "") -> None:
    """`output`: a folder with the JSON, the markdown (`appendix` after the tables) and the PNGs; `json_path`: the
    JSON alone. Each appears whole or not at all."""
    text = json.dumps(report, indent=2) + "\n"
    if output is not None:
        with atomic_folder(Path(output), overwrite=overwrite) as folder:
            (folder / REPORT_JSON).write_text(text)
            (folder / REPORT_MARKDOWN).write_text(format_report(report) + (f"\n{appendix}\n" if appendix else ""))
            for name, draw in figures(report).items():
                draw(folder / name)
    if json_path is not None:
        with atomic_file(Path(json_path)) as tmp:
            tmp.write_text(text)


def record_in_checkpoint(folder: Path, report: dict) -> Path:
    """Merge `report` into the checkpoint's `nha_eval.json`: each text, task, the suite and the position measurement
    keeps its latest result, so evaluations of different tasks add up. The record holds no local path."""
    try:
        record = read_record(folder) or {}
    except NHARetrofitError:  # unreadable: replaced by this evaluation
        record = {}
    latest = {key: value for key, value in report.items() if key != "checkpoint"}
    latest["variants"] = list(dict.fromkeys([*report["variants"], *record.get("variants", [])]))
    for key in TASK_SECTIONS:
        latest[key] = {**(record.get(key) or {}), **(report.get(key) or {})}
    for key in ONE_MEASUREMENT:
        latest[key] = report.get(key) or record.get(key)
    path = Path(folder) / EVAL_RECORD
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(latest, indent=2) + "\n")
    return path


def read_record(folder) -> dict | None:
    """The checkpoint's latest evaluation (`nha_eval.json`), or None when it has none."""
    path = Path(folder) / EVAL_RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise NHARetrofitError(f"{path} is not valid JSON: run `nha-retrofit eval` again or delete it") from None
