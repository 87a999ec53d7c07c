"""Shared pieces of the Triton kernel tests: inputs on the test device, the float64 reference, relative errors, and
the checks every kernel run gets (buffers poisoned with NaN, so an element no kernel writes fails; under the CPU
interpreter also bounds-checked, and bf16 with the GPU's roundings: `triton_interpreter.py`).

The kernel tests run on CUDA where there is one, else under Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel is defined) at smaller sizes.
"""

import contextlib
import dataclasses

import torch

from nha_oracle import make_inputs
from real_like import real_like_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
NAMES = ("q", "k", "v", "q_rope", "k_rope", "log_alpha", "slot_bias")  # in the operator's argument order
TOL = {torch.bfloat16: 5e-3, torch.float16: 2e-3, torch.float32: 1e-4}
# fp32 under the interpreter reaches ~1e-6; log_alpha's gradient is a suffix sum of two nearly cancelling terms
# formed by different kernels (E by the rows kernel, UV by the key kernels), so its rounding does not cancel
INTERPRETED_FP32_TOL = {"log_alpha": 2e-5}


def rel(a, b):
    """Relative error of a against b (Frobenius norms, in float64)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def case_id(T, HQ, H, D, M, window, dtype, batch, *rest):
    extra = "".join(f"_{x}" for x in rest)
    return f"T{T}_g{HQ}-{H}_D{D}_M{M}_w{window}_{str(dtype)[6:]}_b{batch}{extra}"


def operator_inputs(T, HQ, H, D, M, dtype, batch, decay=1.0, real_like=False, seed=0):
    """Random operator inputs on the test device (fixed seed; never zeros) as fp32 masters, `dtype` the precision the
    kernels get; log_alpha stays fp32 as the model passes it. Also dO and the scale."""
    if real_like:  # statistics of a converted model's operator inputs (real_like.py)
        inputs = real_like_inputs(batch, T, HQ, H, D, M, seed=seed)
    else:
        inputs = make_inputs(batch, T, HQ, H, D, M, dtype=torch.float32, decay=decay, seed=seed)
    out = {n: inputs[n].float().to(DEVICE) for n in NAMES}
    out["scale"] = inputs["scale"]
    out["dO"] = torch.randn(batch, T, HQ, D, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype)
    out["dtype"] = dtype
    return out


def cast(inputs, name):
    """An input in the precision the kernels take (log_alpha fp32, the rest in the case's dtype)."""
    return inputs[name] if name == "log_alpha" else inputs[name].to(inputs["dtype"])


def reference(inputs, window, mask):
    """The float64 output and gradients for the upstream gradient dO, from the inputs as the kernels get them: the
    dense `nha_reference` for short sequences, the chunked PyTorch form (itself pinned to it) beyond."""
    from nha_retrofit.ops import nha_chunked, nha_reference

    x = {n: cast(inputs, n).double().requires_grad_(True) for n in NAMES}
    T = x["q"].shape[1]
    args = [x[n] for n in NAMES[:6]]
    if T <= 256:
        out = nha_reference(*args, window, inputs["scale"], mask, x["slot_bias"])
    else:
        out, _ = nha_chunked(*args, window, inputs["scale"], mask, x["slot_bias"], chunk_size=64)
    grads = torch.autograd.grad(out, [x[n] for n in NAMES], inputs["dO"].double(), allow_unused=True)
    return out.detach(), [torch.zeros_like(x[n]) if g is None else g for n, g in zip(NAMES, grads)]


@contextlib.contextmanager
def poisoned_buffers():
    """torch.empty and torch.empty_like fill what they return with NaN (integers: their least value, which no kernel
    stores): an output element that no kernel writes then fails the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan") if t.dtype.is_floating_point else torch.iinfo(t.dtype).min)

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


@contextlib.contextmanager
def kernel_checks(dtype):
    """What every kernel run of the tests is checked with: poisoned buffers; under the interpreter also bounds
    checks, and for bf16/fp16 the GPU's roundings."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(poisoned_buffers())
        if INTERPRETED:
            from triton_interpreter import bounds_checked, gpu_numerics

            stack.enter_context(bounds_checked())
            if dtype != torch.float32:
                stack.enter_context(gpu_numerics())
        yield


def kernel_grads(inputs, window, mask):
    """The Triton operator's output and its gradients w.r.t. every input (NAMES), under `kernel_checks`."""
    from nha_retrofit.ops.nha.chunk import nha_attention_triton

    x = {n: cast(inputs, n).detach().requires_grad_(True) for n in NAMES}
    with kernel_checks(inputs["dtype"]):
        out = nha_attention_triton(*[x[n] for n in NAMES[:6]], window, inputs["scale"], mask, x["slot_bias"])
        grads = torch.autograd.grad(out, [x[n] for n in NAMES], inputs["dO"])
    return out, grads


def training_errors(inputs, window, mask):
    """Relative errors of the kernels' output and gradients against float64 (the gradients with an exact value of 0
    are checked to be negligible instead), after checking everything is finite and padding outputs 0."""
    out, grads = kernel_grads(inputs, window, mask)
    ref, ref_grads = reference(inputs, window, mask)
    assert torch.isfinite(out).all()
    if mask is not None:
        assert (out[mask == 0] == 0).all(), "padding queries must output exactly 0"
    errors = {"o": rel(out, ref)}
    for name, g, rg in zip(NAMES, grads, ref_grads):
        assert torch.isfinite(g).all(), f"non-finite gradient for {name}"
        if name == "slot_bias" and window == 0:
            continue  # w = 0: a per-head offset cancels in the softmax, the exact gradient is 0
        if rg.norm() == 0:  # no path (no slots)
            assert g.double().norm() <= 1e-3 * max(grads[0].double().norm().item(), 1.0), name
            continue
        errors[name] = rel(g, rg)
    return errors


def assert_within_tolerance(errors, dtype, what=""):
    tol = {n: TOL[dtype] for n in errors}
    if INTERPRETED and dtype == torch.float32:
        tol = {n: INTERPRETED_FP32_TOL.get(n, 1e-5) for n in errors}
    summary = " ".join(f"{k}={v:.2e}" for k, v in errors.items())
    print(f"\nERRORS {what}: {summary}")
    bad = [k for k, v in errors.items() if not v <= tol[k]]
    assert not bad, f"{bad} over tolerance: {summary}"


def short_segments(settings):
    """`settings` with segments of a few chunks, so short test sequences take the segment walks and the chained
    scans' carries across segments (the shipped settings take them from 8K tokens on)."""
    forward = dataclasses.replace(settings.forward, segment_longest=4, segment_shortest=2, segments_least=2,
                                  scan_segment=2)
    return dataclasses.replace(settings, forward=forward)


@contextlib.contextmanager
def kernel_settings(settings):
    """The kernels launched with `settings` instead of their device's."""
    from nha_retrofit.ops.nha import fused_recurrent
    from nha_retrofit.ops.nha.kernels import chunk_inputs

    saved = chunk_inputs.settings_for, fused_recurrent.settings_for
    chunk_inputs.settings_for = fused_recurrent.settings_for = lambda device: settings
    try:
        yield
    finally:
        chunk_inputs.settings_for, fused_recurrent.settings_for = saved
