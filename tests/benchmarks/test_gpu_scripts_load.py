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
    """benchmarks/stored_read.py's SDPA, FlexAttention and split-KV forms read what `attend_stored` reads (CPU,
    float32, padding flags)."""
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
    assert len(forms) == 7 and reference.shape == (2, 1, 6, 16)
    for name, read in forms.items():
        assert (read(query, keys, values, real, 0.25) - reference).abs().max() < 1e-5, name


def test_the_separate_projections_arm_steps_as_the_shipped_step(monkeypatch):
    """benchmarks/decode_fusion.py's `separate` arm (the fused step with one matmul per projection) gives the shipped
    fused step's logits (uncompiled, float32, NHA layers, full layers and full KV heads) through its own functions."""
    from nha_retrofit.modeling.decoding import nha_static_cache, one_token_step, prefill
    from nha_retrofit.modeling.fused_step import fused_decoder_layers
    from tiny_models import tiny_nha_pair

    spec = importlib.util.spec_from_file_location("decode_fusion", BENCHMARKS / "decode_fusion.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    _, nha = tiny_nha_pair([3, None, 0, 5], full_kv_heads=[[1], [], [0], [0]])
    layers = nha.model.layers
    ids = torch.randint(3, 128, (2, 23), generator=torch.Generator().manual_seed(13))

    def step_logits(arm):
        cache = nha_static_cache(nha, ids.shape[0], ids.shape[1], cuda_graph=False)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"), arm:
            prefill(nha, ids[:, :-1], cache)
            positions = torch.full((ids.shape[0], 1), ids.shape[1] - 1)
            with fused_decoder_layers(layers):
                return one_token_step(nha, ids[:, -1:], positions, cache).logits[:, -1]

    expected = step_logits(script.arm("fused"))
    calls = []
    for name in ("_rotary_qkv", "_add_rms_norm_separate_mlp"):
        function = getattr(script, name)
        monkeypatch.setattr(script, name, lambda *args, function=function: calls.append(function) or function(*args))
    separate = step_logits(script.arm("separate"))
    assert (separate - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert len(calls) == 2 * len(layers)  # the one-token step went through the separate functions
