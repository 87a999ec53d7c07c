"""Shared scaffolding of the CPU interpreter tests (`interp_*.py` scripts and their `test_interp_*.py` runners).

Which Triton interpreters they run on: the hooks of `interp_bounds.py` and `interp_numerics.py` follow the
interpreter internals of Triton >= 3.9 (InterpreterBuilder methods, TensorHandle, GridExecutor). Triton 3.6 (the H200
machine's version) differs there, and its interpreter itself fails on recent numpy (2.4 here) before any hook runs
(`int()` of a one-element array in `range(NCH)`: "only 0-dimensional arrays can be converted to Python scalars"), so
on < 3.9 the interpreter tests skip with this reason instead of failing; on >= 3.9 nothing is skipped.

Under TRITON_INTERPRET=1, importing it also speeds up the interpreter's scans with a combine function
(`_scan_by_slices`). Also: the operator's differentiable inputs (NAMES), one forward + backward through the kernels
under a CONFIG variant and interpreter hooks (`kernels_grad`), the float64 reference of the same
(`reference_grad`), and the subprocess a test runs a script in (`run_interp_script`).
"""

import contextlib
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NAMES = ("q", "k", "v", "q_rope", "k_rope", "log_alpha", "slot_bias")  # in `nha_attention`'s order


def require_interpreter_triton():
    import pytest

    triton = pytest.importorskip("triton")
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}: the interpreter hooks follow Triton >= 3.9's interpreter "
                    "(3.6's builder signatures differ and its interpreter fails on recent numpy: int() of "
                    "one-element arrays); run the interpreter tests with Triton >= 3.9 (e.g. on the CPU machine)",
                    allow_module_level=True)


def run_interp_script(script, *args, expect):
    """Run tests/kernels/`script` with `args` in a subprocess under TRITON_INTERPRET=1 (it must be set before the
    kernels are defined), the repository root first on PYTHONPATH; asserts exit status 0 and `expect` in stdout."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    run = subprocess.run([sys.executable, os.path.join(HERE, script), *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert expect in run.stdout


def rel(a, b):
    """Relative error of a against b (Frobenius norms, in float64)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def use_variant(name):
    """Apply the variant `name` (config.variant_overrides) to config.CONFIG; returns the previous CONFIG
    (restore with .update)."""
    from nha_retrofit.kernels import config

    saved = dict(config.CONFIG)
    if name:
        config.CONFIG.update(config.variant_overrides(name))
    return saved


def kernels_grad(x, window, scale, mask, d_o, variant=None, hooks=()):
    """Output of `nha_attention` on the kernels and its gradients w.r.t. the NAMES inputs `x` (copies of them are
    differentiated): under CONFIG_VARIANTS[variant] (None: the defaults), outputs NaN-poisoned, inside the
    interpreter `hooks` (context managers: `bounds_checked()`, `gpu_numerics()`); CONFIG is restored after."""
    from nha_retrofit.kernels import chunk_fwd, config
    from nha_retrofit.ops.nha.chunk import nha_attention

    xs = {n: x[n].clone().requires_grad_(True) for n in NAMES}
    saved = use_variant(variant)
    chunk_fwd.POISON = True
    try:
        with contextlib.ExitStack() as stack:
            for hook in hooks:
                stack.enter_context(hook)
            out = nha_attention(*[xs[n] for n in NAMES[:6]], window, scale, mask, xs["slot_bias"])
            grads = torch.autograd.grad(out, [xs[n] for n in NAMES], d_o)
    finally:
        chunk_fwd.POISON = False
        config.CONFIG.clear()
        config.CONFIG.update(saved)
    return out, grads


def reference_grad(x, window, scale, mask, d_o):
    """The float64 `nha_reference` output and its gradients w.r.t. the NAMES inputs `x`."""
    from nha_retrofit.ops.nha.naive import nha_reference

    xr = {n: x[n].double().requires_grad_(True) for n in NAMES}
    ref = nha_reference(*[xr[n] for n in NAMES[:6]], window, scale, mask, xr["slot_bias"])
    return ref, torch.autograd.grad(ref, [xr[n] for n in NAMES], d_o.double())


def _scan_by_slices(self, input):
    """`tl.associative_scan` with a combine function under the interpreter: the same sequential scan along the axis,
    one combine call per step on whole slices. Triton's (`ScanOps.generic_scan`) calls it once per element from
    Python, which made the chained state scans' [16, 512] blocks take minutes per launch."""
    import numpy as np

    datas = [arg.handle.data for arg in input]
    outs = [np.empty_like(d) for d in datas]
    index = [slice(None)] * datas[0].ndim
    acc = None
    for i in range(datas[0].shape[self.axis]):
        index[self.axis] = slice(i, i + 1)
        step = [d[tuple(index)] for d in datas]
        if acc is not None:
            combined = self.combine_fn.fn(*(self.to_tensor(a, arg.dtype) for a, arg in zip(acc, input)),
                                          *(self.to_tensor(x, arg.dtype) for x, arg in zip(step, input)))
            step = [c.handle.data for c in (combined if isinstance(combined, tuple) else (combined,))]
        for out, x in zip(outs, step):
            out[tuple(index)] = x
        acc = step
    return [self.to_tensor(out, arg.dtype) for out, arg in zip(outs, input)]


if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime import interpreter as _interpreter

    _interpreter.ScanOps.generic_scan = _scan_by_slices
