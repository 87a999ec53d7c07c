"""benchmarks/retrieval_quality.py --quick on two tiny checkpoints (one with a finetuning record): the four models'
tables, PNGs and targets, the retrieval suite's results of both checkpoints merged, each model's numbers those of
its own checkpoint."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "retrieval_quality.py"
MODELS = ["original", "converted", "finetuned", "window_only"]


@pytest.fixture(scope="module")
def benchmark():
    spec = importlib.util.spec_from_file_location("retrieval_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_run_writes_the_four_models_side_by_side(benchmark, tiny_checkpoint, tiny_finetuned_checkpoint,
                                                       local_tasks, tmp_path):
    out = tmp_path / "out"
    assert benchmark.main(["--converted", str(tiny_checkpoint), "--finetuned", str(tiny_finetuned_checkpoint),
                           "--quick", "--device", "cpu", "--texts", "python-stdlib", "--harness-tasks", "tiny_choice",
                           "--include-path", str(local_tasks), "--output", str(out)]) == 0
    report = json.loads((out / "evaluation.json").read_text())
    assert report["variants"] == MODELS and report["training_context"] == 128
    assert list(report["heldout"]["python-stdlib"]) == MODELS and list(report["positions"]["loss"]) == MODELS
    passkey = report["retrieval"]["passkey"]
    assert passkey["lengths"] == [512] and passkey["depths"] == [0, 100] and list(passkey["accuracy"]) == MODELS
    assert report["heldout"]["python-stdlib"]["converted"] != report["heldout"]["python-stdlib"]["finetuned"]
    assert list(report["harness"]["tiny_choice"]["metrics"]["acc"]) == MODELS
    assert len(report["targets"]) == 3 and all("above_window_only" in row for row in report["targets"])
    suite = report["suite"]
    assert suite["variants"] == MODELS and suite["reference"] == "original" and list(suite["groups"]) == ["heldout"]
    for scores in suite["groups"]["heldout"]["tasks"].values():
        assert list(scores["summary"]) == MODELS and list(scores["ratio"]) == MODELS[1:]
        original, finetuned = (scores["summary"][model][0]["accuracy"] for model in ("original", "finetuned"))
        assert scores["ratio"]["finetuned"] == [finetuned / original if original else None]
        assert scores["meets_bar"]["finetuned"] == [finetuned >= scores["bar"][0]]
    names = {p.name for p in out.iterdir()}
    assert {"evaluation.json", "evaluation.md", "positions.png", "passkey_finetuned.png",
            "niah_multikey_original.png", "suite_heldout_finetuned.png"} <= names
    assert len(names) == 3 + 3 * len(MODELS) + len(MODELS)
    markdown = (out / "evaluation.md").read_text()
    assert "| tokens | original | converted | finetuned | window only |" in markdown and "### Targets" in markdown


def test_targets_compare_the_finetuned_model_with_the_original_and_the_window_only_baseline(benchmark):
    retrieval = {"passkey": {"lengths": [1024, 16384], "depths": [0, 100], "accuracy": {
        "original": [[1.0, 1.0], [0.5, 0.5]], "converted": [[0.0, 0.0], [0.0, 0.0]],
        "finetuned": [[1.0, 0.8], [0.5, 0.0]], "window_only": [[0.0, 1.0], [0.5, 0.5]]}}}
    first, second = benchmark.targets(retrieval, window=64)
    assert first["finetuned_accuracy"] == pytest.approx(0.9) and first["at_least_90pct_of_original"]
    assert first["above_window_only"] and "at_least_90pct_of_original" not in second  # 16K is past 8K
    assert not second["above_window_only"]
    assert "| passkey | 16384 | 50.0 | 25.0 | 50.0 | - | no |" in benchmark.targets_table([first, second])
