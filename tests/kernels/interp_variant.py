"""One CONFIG variant's training-path kernels under the Triton CPU interpreter (TRITON_INTERPRET=1), side by
side with the defaults, against the float64 `nha_reference`: output and every gradient.

fp32 runs under the out-of-bounds checker (`interp_bounds.py`: guarded private buffers, every active address
checked) with NaN-poisoned outputs; bf16 runs with GPU-like numerics (`interp_numerics.py`: bf16 round to
nearest, TF32 / 3xTF32 products as the GPU forms them, addresses still checked). Criterion: fp32 every tensor
<= 1e-5 (the kernels reach ~1e-6; log_alpha 2e-5, see FP32_BOUND); bf16 every tensor <= 2x the defaults'
error on the same inputs + 1e-6 (the same level; the variants differ only in rounding points) and <= 5e-3 (the
GPU suite's tolerance).

Usage: TRITON_INTERPRET=1 PYTHONPATH=. python tests/kernels/interp_variant.py VARIANT T HQ H D M WINDOW BATCH
       [float32|bfloat16] [decay] [random|real_like] [left|right|none]   (none: no attention mask)
Prints one ERRORS line per run; exit status 1 when the variant is off.
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from interp_support import NAMES, kernels_grad, reference_grad, rel  # noqa: E402


def inputs_for(T, HQ, H, D, M, batch, dtype, decay, kind, seed=0):
    from nha_oracle import make_inputs
    from real_like import real_like_inputs

    if kind == "real_like":
        inputs = real_like_inputs(batch, T, HQ, H, D, M, seed=seed)
    else:
        inputs = make_inputs(batch, T, HQ, H, D, M, dtype=torch.float32, seed=seed, decay=decay)
    cast = {n: (torch.float32 if n == "log_alpha" else dtype) for n in NAMES}
    x = {n: inputs[n].to(cast[n]) for n in NAMES}
    d_o = torch.randn(batch, T, HQ, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return x, inputs["scale"], d_o


def kernels(variant, x, scale, d_o, window, mask):
    """Output and gradients of `nha_attention` under a variant (addresses checked, outputs NaN-poisoned; bf16
    with GPU-like numerics)."""
    from interp_bounds import bounds_checked
    from interp_numerics import gpu_numerics

    hooks = [bounds_checked()] + ([gpu_numerics()] if x["q"].dtype != torch.float32 else [])
    return kernels_grad(x, window, scale, mask, d_o, variant, hooks)


def errors_of(out, grads, ref, ref_grads, window):
    errs = {"o": rel(out, ref)}
    for n, g, rg in zip(NAMES, grads, ref_grads):
        if n == "slot_bias" and window == 0:
            continue  # w = 0: the exact gradient is 0
        if rg.norm() == 0:
            continue
        errs[n] = rel(g, rg)
    finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    return errs, finite


def check(variant, T, HQ, H, D, M, window, batch, dtype=torch.float32, decay=1.0, kind="random", side="left",
          seed=0):
    """(variant errors, defaults errors or None, finite): the defaults run only for bf16."""
    from nha_oracle import padding_mask

    x, scale, d_o = inputs_for(T, HQ, H, D, M, batch, dtype, decay, kind, seed)
    mask = None if side == "none" else padding_mask(batch, T, side)
    ref, ref_grads = reference_grad(x, window, scale, mask, d_o)
    out, grads = kernels(variant, x, scale, d_o, window, mask)
    errs, finite = errors_of(out, grads, ref, ref_grads, window)
    base = None
    if dtype != torch.float32:
        out0, grads0 = kernels(None, x, scale, d_o, window, mask)
        base, finite0 = errors_of(out0, grads0, ref, ref_grads, window)
    return errs, base, finite


# log_alpha's gradient is a suffix sum over the sequence of E - s UV, two terms that nearly cancel: E comes from the
# rows kernel, UV from keys_da, and when their query blocks differ (rows 32 tokens, keys_da 16: the defaults since
# session 7) their rounding no longer cancels: 1.0e-5 under mixed decay, against 5.0e-6 with both at 16 tokens and
# 2.5e-6 with both at 32 (the GPU suite's fp32 tolerance is 1e-4; NOTES.md session 7)
FP32_BOUND = {"log_alpha": 2e-5}


def verdict(errs, base, finite, dtype):
    if not finite:
        return ["non-finite"]
    if dtype == torch.float32:
        return [k for k, v in errs.items() if not v <= FP32_BOUND.get(k, 1e-5)]
    return [k for k, v in errs.items() if not (v <= 2 * base[k] + 1e-6 and v <= 5e-3)]


def main():
    variant = sys.argv[1]
    T, HQ, H, D, M, window, batch = (None if a == "None" else int(a) for a in sys.argv[2:9])
    dtype = getattr(torch, sys.argv[9]) if len(sys.argv) > 9 else torch.float32
    decay = float(sys.argv[10]) if len(sys.argv) > 10 else 1.0
    kind = sys.argv[11] if len(sys.argv) > 11 else "random"
    side = sys.argv[12] if len(sys.argv) > 12 else "left"
    errs, base, finite = check(variant, T, HQ, H, D, M, window, batch, dtype, decay, kind, side)
    what = (T, HQ, H, D, M, window, batch, str(dtype)[6:], decay, kind, side)
    print(f"ERRORS {variant} {what}: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    if base is not None:
        print(f"ERRORS defaults {what}: " + " ".join(f"{k}={v:.2e}" for k, v in base.items()))
    bad = verdict(errs, base, finite, dtype)
    if bad:
        print(f"FAIL: {bad}")
        raise SystemExit(1)
    print("OK (in bounds)")


if __name__ == "__main__":
    main()
