"""Which slot-state chunk a call takes, under the Triton CPU interpreter: a forward whose backward can run takes
CONFIG["train_chunk"], any other `inference_chunk` (64 at these 2 query heads per kv head), also under torch.no_grad()
with a slot bias that requires a gradient (a model's parameter in an evaluation loop; an autograd function's
needs_input_grad ignores the grad mode). The no-gradient forward equals the training one to fp32 rounding (the
chunking only regroups the same sums).

Usage: TRITON_INTERPRET=1 PYTHONPATH=. python tests/kernels/interp_chunk_routing.py   (prints OK and exits 0)
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from interp_support import NAMES, rel  # noqa: E402
from nha_oracle import make_inputs, padding_mask  # noqa: E402


def main():
    from nha_retrofit.kernels import autograd, chunk_fwd, config

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    B, T, HQ, H, D, M, window = 2, 70, 4, 2, 64, 32, 5
    x = make_inputs(B, T, HQ, H, D, M, dtype=torch.float32, seed=seed)
    mask = padding_mask(B, T, "left", seed=seed)
    inputs = [x[n] for n in NAMES[:6]]
    bias = x["slot_bias"].clone().requires_grad_(True)
    chunks = []
    forward = chunk_fwd.forward
    chunk_fwd.forward = lambda p, *args, **kwargs: (chunks.append(p.cs), forward(p, *args, **kwargs))[1]

    with torch.no_grad():
        evaluated = autograd.nha_attention(*inputs, window, x["scale"], mask, bias)
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    trained = autograd.nha_attention(*leaves, window, x["scale"], mask, bias)
    trained.sum().backward()
    constant = autograd.nha_attention(*inputs, window, x["scale"], mask, x["slot_bias"])  # nothing needs gradients

    train, inference = config.CONFIG["train_chunk"], chunk_fwd.inference_chunk(HQ // H)
    assert train != inference, "the defaults no longer tell the two routes apart"
    assert chunks == [inference, train, inference], chunks
    assert leaves[0].grad is not None and leaves[0].grad.abs().sum() > 0
    err = rel(evaluated, trained.detach())
    assert err <= 1e-6, err
    assert torch.equal(evaluated, constant)  # the same route: the same kernels at the same chunks
    print(f"chunks {chunks}, no-gradient against training forward {err:.1e}")
    print("OK")


if __name__ == "__main__":
    main()
