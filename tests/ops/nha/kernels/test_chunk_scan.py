"""The chained scans over chunks (`ops/nha/kernels/chunk_scan.py`) against their plain-PyTorch definition, on CUDA
or under the CPU interpreter (bounds-checked, buffers poisoned)."""

import pytest
import torch

from operator_cases import DEVICE, kernel_checks, rel

pytest.importorskip("triton")

from nha_retrofit.ops.nha.kernels.chunk_scan import chained_chunk_scan, naive_chunk_scan  # noqa: E402
from nha_retrofit.ops.utils.launch import counters  # noqa: E402


@pytest.mark.parametrize("chunks", [1, 4] + [pytest.param(n, marks=pytest.mark.slow) for n in (7, 33)])
@pytest.mark.parametrize("segment", [1, 2, 5, 64])
def test_chained_scans_match_the_sequential_scan(chunks, segment):
    """Forward from a given state (in place over the inputs, as the forward's states are stored), forward from zero
    into another array, and reverse (the state gradients after each chunk), for segments of 1 to more than all the
    chunks; each leaves the tickets and flags it used at zero for the next launch."""
    gen = torch.Generator().manual_seed(chunks * 100 + segment)
    BH, M, X = 3, 16, 40
    dec = (torch.rand(BH, chunks, M, generator=gen) * 0.9 + 0.05).to(DEVICE)
    b = torch.randn(BH, chunks, M, X, generator=gen).to(DEVICE)
    x0 = torch.randn(BH, M, X, generator=gen).to(DEVICE)
    with kernel_checks(torch.float32):
        state = torch.cat([torch.full((BH, 1, M, X), float("nan"), device=DEVICE), b], 1)  # chunk c at row c + 1
        chained_chunk_scan(state, dec, state, segment, 4, x0=x0)
        start = torch.empty_like(b)
        chained_chunk_scan(b, dec, start, segment, 4)
        back = torch.empty_like(b)
        chained_chunk_scan(b, dec, back, segment, 4, reverse=True)
    assert not counters(b.device, 1).any(), "the scans left tickets or flags set"
    for name, got, want in [("forward", state[:, 1:], naive_chunk_scan(b, dec, x0)),
                            ("forward from zero", start, naive_chunk_scan(b, dec)),
                            ("reverse", back, naive_chunk_scan(b, dec, reverse=True))]:
        assert torch.isfinite(got).all() and rel(got, want) <= 1e-5, (name, rel(got, want))
