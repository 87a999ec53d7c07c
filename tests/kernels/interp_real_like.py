"""The training-path kernels under the Triton CPU interpreter on real-like inputs (`real_like.py`), in bf16 with
GPU-like numerics (`interp_numerics.py`: bf16 round-to-nearest, TF32 / 3xTF32 products), against the float64
`nha_reference`: output and every gradient within the GPU suite's bf16 tolerance.

Usage: [NHA_VARIANT=name] TRITON_INTERPRET=1 PYTHONPATH=. python tests/kernels/interp_real_like.py T HQ H D M window
       batch [dtype]    (NHA_VARIANT: a config.CONFIG_VARIANTS name; default the defaults)
Prints one ERRORS line; exit status 1 when a tensor is off.
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

TOL = {torch.bfloat16: 5e-3, torch.float32: 1e-5}


def check(T, HQ, H, D, M, window, batch, dtype, seed=0, variant=None):
    """`variant`: a config.CONFIG_VARIANTS name (default: $NHA_VARIANT, else the defaults)."""
    from interp_numerics import gpu_numerics
    from interp_support import NAMES, kernels_grad, reference_grad, rel
    from nha_oracle import padding_mask
    from real_like import real_like_inputs

    inputs = real_like_inputs(batch, T, HQ, H, D, M, seed=seed)
    mask = padding_mask(batch, T, "left")
    gen = torch.Generator().manual_seed(seed + 1)
    d_o = torch.randn(batch, T, HQ, D, generator=gen).to(dtype)
    # the model's dtypes: q/k/v/rope and slot_bias in the model dtype, log_alpha fp32 (gate_log_alpha)
    x = {n: inputs[n].to(torch.float32 if n == "log_alpha" else dtype) for n in NAMES}
    out, grads = kernels_grad(x, window, inputs["scale"], mask, d_o, variant or os.environ.get("NHA_VARIANT"),
                              hooks=[gpu_numerics()])
    ref, ref_grads = reference_grad(x, window, inputs["scale"], mask, d_o)
    errors = {"o": rel(out, ref)}
    errors.update({n: rel(g, rg) for n, g, rg in zip(NAMES, grads, ref_grads)})
    finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    return errors, finite


def main():
    T, HQ, H, D, M, window, batch = map(int, sys.argv[1:8])
    dtype = getattr(torch, sys.argv[8]) if len(sys.argv) > 8 else torch.bfloat16
    errors, finite = check(T, HQ, H, D, M, window, batch, dtype)
    tol = TOL[dtype]
    summary = " ".join(f"{k}={v:.2e}" for k, v in errors.items())
    variant = os.environ.get("NHA_VARIANT") or "defaults"
    print(f"ERRORS real-like interpreter {variant} {(T, HQ, H, D, M, window, batch, str(dtype))}: {summary}")
    bad = [k for k, v in errors.items() if not v <= tol]
    if bad or not finite:
        print(f"FAIL (tolerance {tol}): {bad}, finite={finite}")
        raise SystemExit(1)
    print("OK")


if __name__ == "__main__":
    main()
