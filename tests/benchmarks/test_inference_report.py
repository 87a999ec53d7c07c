"""benchmarks/inference_report.py --quick: the real-size inference report's every part on a tiny config on the
CPU, written as JSON and markdown."""

import json
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "inference_report.py"


def test_quick_mode_writes_the_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--quick", "--out-dir", str(tmp_path)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    report = json.loads((tmp_path / "inference_tiny-llama_cpu.json").read_text())
    assert {r["model"] for r in report["latency"]} == {"nha", "original, eager", "original, every window full"}
    assert report["throughput"] and report["rounds"] >= 3
    assert (tmp_path / "inference_tiny-llama_cpu.md").read_text().startswith("tiny-llama: NHA against the original")
    assert "== tiny-llama:" in capsys.readouterr().out
