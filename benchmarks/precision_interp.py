"""Output error of the forward without a backward against float64, per CONFIG variant, on the CPU: Triton's
interpreter with the GPU's bf16 / TF32 roundings (`tests/kernels/interp_numerics.py`), so a precision change can be
weighed before device time is spent. Needs Triton >= 3.9 (its interpreter); slow (about a minute per case).

    TRITON_INTERPRET=1 python benchmarks/precision_interp.py defaults,inference_values_bf16x3

Prints, per case, each variant's ||o - ref|| / ||ref||, the error of the float64 output rounded to bf16 (the floor of
any bf16 output) and how far the variants' outputs are from the first variant's.
"""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "kernels")]
import interp_support  # noqa: E402,F401  (the interpreter's scans, faster)
from interp_numerics import gpu_numerics  # noqa: E402
from nha_oracle import make_inputs, padding_mask  # noqa: E402
from real_like import real_like_inputs  # noqa: E402

from nha_retrofit.kernels import config  # noqa: E402
from nha_retrofit.ops.nha.chunk import nha_chunked_triton  # noqa: E402
from nha_retrofit.ops.nha.chunk_torch import nha_chunked  # noqa: E402

NAMES = ("q", "k", "v", "q_rope", "k_rope", "log_alpha")
CASES = [  # (T, HQ, H, D, M, window, batch, real_like)
    (300, 9, 3, 64, 64, 64, 2, False), (300, 9, 3, 64, 64, 64, 2, True), (200, 32, 8, 128, 64, 64, 1, False),
    (200, 32, 8, 128, 64, 64, 1, True), (300, 4, 4, 64, 64, 5, 2, False)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["defaults"]
    base = dict(config.CONFIG)
    for T, HQ, H, D, M, w, batch, real in CASES:
        torch.manual_seed(T + HQ + real)
        x = real_like_inputs(batch, T, HQ, H, D, M) if real else make_inputs(batch, T, HQ, H, D, M, dtype=torch.float32)
        args = [x[n].to(torch.bfloat16) for n in NAMES]
        mask = padding_mask(batch, T, "left")
        ref, _ = nha_chunked(*[a.double() for a in args], w, x["scale"], mask, x["slot_bias"].double(), chunk_size=64)
        outs = {}
        for name in names:  # segments of 3 chunks: the segment-local states of long sequences in a short one
            config.CONFIG.clear()
            config.CONFIG.update(base, state_segment=3, **config.variant_overrides(name))
            with torch.no_grad(), gpu_numerics():
                outs[name], _ = nha_chunked_triton(*args, w, x["scale"], mask, x["slot_bias"], output_final_state=True)
        first = outs[names[0]]
        errors = "  ".join(f"{n} {rel(o, ref):.4e} (from {names[0]}: {rel(o, first):.1e}, "
                           f"{(o != first).float().mean().item():.1%} of elements)" for n, o in outs.items())
        print(f"T={T} heads {HQ}/{H} D={D} M={M} w={w} real_like={real}: {errors}; float64 rounded to bf16 "
              f"{rel(ref.to(torch.bfloat16), ref):.4e}", flush=True)
    config.CONFIG.clear()
    config.CONFIG.update(base)


if __name__ == "__main__":
    main()
