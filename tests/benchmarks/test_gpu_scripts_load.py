"""The GPU benchmark scripts load on a machine without one: `--help` runs their imports of the operator's modules
(the kernels, their launch path and settings) and their argument parsers."""

import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("script", ["ops.py", "kernel_profile.py", "decode_host.py", "e2e_kernel.py",
                                    "decode_fusion.py", "retrieval_heads.py", "stored_read.py"])
def test_help_runs_the_imports(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {script}")
