"""Calls beyond the kernels' int32 offsets run in batch slices (`autograd.batch_slices`), under the Triton CPU
interpreter: with `OFFSET_LIMIT` lowered so that a batch of 3 runs as 3 slices, training (`nha_attention`: output
and every gradient) and prefill with a carried state (`nha_chunked_triton`: output and the whole final state) equal
the same calls in one piece.

Fresh random fp32 inputs, left padding, window 5, GQA 2:1; the carried state from a PyTorch prefill.

Usage: TRITON_INTERPRET=1 PYTHONPATH=. python tests/kernels/interp_batch_slices.py   (prints OK and exits 0)
"""

import dataclasses
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from interp_support import NAMES, rel  # noqa: E402
from nha_oracle import make_inputs, padding_mask  # noqa: E402


def main():
    from nha_retrofit.kernels import autograd
    from nha_retrofit.ops.nha.chunk_torch import nha_chunked

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    B, T, HQ, H, D, M, window = 3, 70, 4, 2, 64, 32, 5
    x = make_inputs(B, 2 * T, HQ, H, D, M, dtype=torch.float32, seed=seed)
    mask = padding_mask(B, 2 * T, "left", seed=seed)
    d_o = torch.randn(B, T, HQ, D, generator=torch.Generator().manual_seed(seed))
    _, state = nha_chunked(*[x[n][:, :T] for n in NAMES[:6]], window, x["scale"], mask[:, :T], x["slot_bias"],
                           output_final_state=True)
    tail = [x[n][:, T:] for n in NAMES[:6]]

    def run(limit):
        autograd.OFFSET_LIMIT = limit
        assert len(autograd.batch_slices(tail[0], tail[2], tail[5])) == (B if limit < 2**31 else 1)
        xs = [t.clone().requires_grad_(True) for t in tail] + [x["slot_bias"].clone().requires_grad_(True)]
        out = autograd.nha_attention(*xs[:6], window, x["scale"], mask[:, T:], xs[6])
        grads = torch.autograd.grad(out, xs, d_o)
        prefill, final = autograd.nha_chunked_triton(*tail, window, x["scale"], mask, x["slot_bias"],
                                                     initial_state=state, output_final_state=True)
        return [out, *grads, prefill, *final.tensors()]

    whole = run(2**31)
    sliced = run(T * HQ * D + 1)  # one sequence per slice
    names = ["o", *(f"d{n}" for n in NAMES), "prefill o", *(f.name for f in dataclasses.fields(autograd.NHAState))]
    worst = 0.0
    for name, got, want in zip(names, sliced, whole):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if got.dtype == torch.bool or not got.is_floating_point():
            assert torch.equal(got, want), name
            continue
        err = rel(got, want) if want.norm() > 0 else got.abs().max().item()
        worst = max(worst, err)
        assert err <= 1e-6, (name, err)  # the slot bias's gradient is summed in another order: not bit-equal
    print(f"3 slices against one call: worst rel error {worst:.1e}")
    print("OK")


if __name__ == "__main__":
    main()
