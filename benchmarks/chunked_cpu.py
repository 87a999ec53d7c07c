"""Forward+backward time of the plain-PyTorch chunked operator (the exact fallback) on the CPU, median of 3:
SmolLM2's attention shape (9 query / 3 kv heads, D=64, M=64), window 64, T=2048, batch 2.

    python benchmarks/chunked_cpu.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from nha_oracle import make_inputs  # noqa: E402

from nha_retrofit.ops import nha_chunked  # noqa: E402

NAMES = ("q", "k", "v", "q_rope", "k_rope", "log_alpha", "slot_bias")

inputs = make_inputs(2, 2048, 9, 3, 64, 64, dtype=torch.float32, seed=0)
xs = [inputs[n].clone().requires_grad_() for n in NAMES]


def step():
    out, _ = nha_chunked(*xs[:6], window=64, scale=inputs["scale"], slot_bias=xs[6])
    out.sum().backward()


step()
times = []
for _ in range(3):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
print(f"nha_chunked fwd+bwd, T=2048, batch 2, 9/3 heads, D=64, M=64, w=64: {sorted(times)[1]:.3f} s "
      f"({torch.get_num_threads()} threads)")
