"""The GPU benchmark scripts load on a machine without one: `--help` runs their imports of the operator's modules
(the kernels, their launch path and settings) and their argument parsers."""

import importlib.util
import runpy
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("script", ["ops.py", "kernel_profile.py", "decode_host.py", "e2e_kernel.py",
                                    "decode_fusion.py", "retrieval_heads.py", "stored_read.py"])
def test_help_runs_the_imports(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {script}")


def test_the_cache_read_forms_compared_agree_with_the_shipped_read(monkeypatch):
    """benchmarks/stored_read.py's SDPA and FlexAttention forms read what `attend_stored` reads (CPU, float32,
    padding flags)."""
    spec = importlib.util.spec_from_file_location("stored_read", BENCHMARKS / "stored_read.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "stored_read", script)  # FlexAttention traces its score_mod by module name
    spec.loader.exec_module(script)
    forms = script.FORMS
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 1, 6, 16, generator=gen)
    keys, values = (torch.randn(2, 3, 300, 16, generator=gen) for _ in range(2))
    real = torch.rand(2, 300, generator=gen) > 0.3
    reference = forms["grouped_matmuls"](query, keys, values, real, 0.25)
    assert len(forms) == 6 and reference.shape == (2, 1, 6, 16)
    for name, read in forms.items():
        assert (read(query, keys, values, real, 0.25) - reference).abs().max() < 1e-5, name
