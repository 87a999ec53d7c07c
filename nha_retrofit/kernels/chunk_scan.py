"""Linear scans over the chunk axis of the slot states: x <- dec[c] * x + b[c], one [M, X] tile per chunk.

The forward needs the state before every chunk (`slot_states`: inclusive, in place over the chunk updates); the
slot backward needs the state gradient after every chunk (`reverse_scan`: exclusive, from the last chunk back).
A scan over n chunks is a chain of n dependent steps (~0.45 us each on the H200: 0.23-0.76 ms at 32K, n = 512,
however many programs run). `chained_chunk_scan` cuts the chain into segments of K chunks, scanned in parallel
from zero; only the segments' carries pass from one to the next (about K + n / K dependent steps), in one launch:
each segment's program waits for its predecessor's carry, then scans its chunks again from it (from L2), so the
states cross DRAM once each way. (Its first form, a segment scan launch and a fixup launch, moved them twice and
cost ~0.45 ms more per 32K training step: NOTES.md, session 14.) `naive_chunk_scan` is the plain PyTorch
definition it is tested against. Several state arrays that share their decays (the key and the value states) scan
in one launch: state row r takes the decays of row r % NBH.
"""

import torch
import triton
import triton.language as tl

from . import fast_launch
from .fast_launch import cdiv
from .workspace import counters


def naive_chunk_scan(b, dec, x0=None, reverse=False):
    """b [..., n, M, X], dec [..., n, M] -> [..., n, M, X]: forward (reverse=False) out[c] = x after step c
    (x = dec[c] x + b[c], from x0 or 0); reverse out[c] = x before step c of the walk c = n-1 .. 0 (from 0)."""
    x = torch.zeros_like(b[..., 0, :, :]) if x0 is None else x0.to(b.dtype)
    out = torch.empty_like(b)
    steps = range(b.shape[-3] - 1, -1, -1) if reverse else range(b.shape[-3])
    for c in steps:
        if reverse:
            out[..., c, :, :] = x
        x = dec[..., c, :, None] * x + b[..., c, :, :]
        if not reverse:
            out[..., c, :, :] = x
    return out


@triton.jit
def _tile(pid_t, M: tl.constexpr, DX: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """The [BM, BD] tile number pid_t of an [M, DX] state: slot offsets, column mask and element offsets."""
    NDB: tl.constexpr = (DX + BD - 1) // BD
    offs_m = (pid_t // NDB) * BM + tl.arange(0, BM)
    offs_d = (pid_t % NDB) * BD + tl.arange(0, BD)
    dmask = offs_d < DX
    return offs_m, dmask, offs_m[:, None] * DX + offs_d[None, :]


@triton.jit
def _chunk(i, N, REVERSE: tl.constexpr):
    """The chunk of scan step i."""
    if REVERSE:
        return N - 1 - i
    else:
        return i


@triton.jit
def _scan_segment(BIN, DEC, OUT, x, s, N, K, bh, dec_bh, ROWS, SHIFT, offs_m, dmask, tile,
                  M: tl.constexpr, DX: tl.constexpr, BM: tl.constexpr, REVERSE: tl.constexpr, STORE: tl.constexpr):
    """Steps s*K .. s*K+K-1 from x (chunk c of a state array at row c + SHIFT of ROWS per head): (x after them,
    the product of their decays); with STORE the scan's states into OUT."""
    prod = tl.full([BM], 1.0, dtype=tl.float32)
    for i in range(s * K, tl.minimum(s * K + K, N)):
        c = _chunk(i, N, REVERSE)
        row = (bh * ROWS + c + SHIFT) * M * DX
        if STORE and REVERSE:  # exclusive: the state after chunk c is what the later chunks sent back
            tl.store(OUT + row + tile, x, mask=dmask[None, :])
        dec = tl.load(DEC + (dec_bh * N + c) * M + offs_m)
        x = dec[:, None] * x + tl.load(BIN + row + tile, mask=dmask[None, :], other=0.0)
        prod = prod * dec
        if STORE and not REVERSE:
            tl.store(OUT + row + tile, x, mask=dmask[None, :])
    return x, prod


@triton.jit
def _chained_scan_kernel(BIN, DEC, OUT, X0, CARRY, FLAGS, N, NSEG, ROWS, SHIFT, NBH, NCHAIN,
                         M: tl.constexpr, DX: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, K: tl.constexpr,
                         REVERSE: tl.constexpr, HAS_X0: tl.constexpr):
    """The scan in one launch: one program per (segment s of K steps, chain = tile x batch x head). It scans its
    steps from zero (the segment's end state and decay product), waits for the carry out of segment s - 1
    (CARRY, published by setting its flag), publishes its own carry out, then scans its steps again from the carry
    and stores the states (the second pass re-reads its chunks from L2: the states go through DRAM once each way,
    where a scan launch and a fixup launch read and write them twice).

    Programs take tickets (FLAGS[0]) in the order they start and ticket t is (segment t // NCHAIN, chain
    t % NCHAIN), so a program only waits for one that started before it: no deadlock, however the hardware orders
    the programs. The flags (FLAGS[1 + chain * NSEG + s]) and the ticket counter start at zero and end at zero
    (each flag reset by its one reader, the counter by the last ticket's program), for the next launch."""
    ticket = tl.atomic_add(FLAGS, 1)
    if ticket == NSEG * NCHAIN - 1:  # every program has its ticket
        tl.atomic_xchg(FLAGS, 0)
    s = ticket // NCHAIN
    chain = ticket % NCHAIN
    NTILE: tl.constexpr = (M // BM) * ((DX + BD - 1) // BD)
    offs_m, dmask, tile = _tile(chain % NTILE, M, DX, BM, BD)
    bh = (chain // NTILE).to(tl.int64)
    local = tl.arange(0, BM)[:, None] * BD + tl.arange(0, BD)[None, :]  # a tile of CARRY
    zero = tl.zeros([BM, BD], dtype=tl.float32)
    end, prod = _scan_segment(BIN, DEC, OUT, zero, s, N, K, bh, bh % NBH, ROWS, SHIFT, offs_m, dmask, tile, M, DX,
                              BM, REVERSE, False)
    link = chain.to(tl.int64) * NSEG + s  # this segment's flag and carry out
    if s == 0:
        if HAS_X0:
            carry = tl.load(X0 + bh * M * DX + tile, mask=dmask[None, :], other=0.0).to(tl.float32)
        else:
            carry = zero
    else:
        while tl.atomic_add(FLAGS + link, 0, sem="acquire") == 0:  # FLAGS + 1 + (link - 1)
            pass
        tl.atomic_xchg(FLAGS + link, 0)
        tl.debug_barrier()  # every thread's loads after the acquire
        carry = tl.load(CARRY + (link - 1) * BM * BD + local, cache_modifier=".cg")
    if s + 1 < NSEG:
        tl.store(CARRY + link * BM * BD + local, prod[:, None] * carry + end)
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_xchg(FLAGS + 1 + link, 1, sem="release")
    _scan_segment(BIN, DEC, OUT, carry, s, N, K, bh, bh % NBH, ROWS, SHIFT, offs_m, dmask, tile, M, DX, BM, REVERSE,
                  True)


def chained_chunk_scan(bin_, dec, out, segment, tile, x0=None, reverse=False, fast=True):
    """The scan of `naive_chunk_scan` in one launch of chained segments of `segment` chunks, into `out` (may be
    `bin_`: in place).

    bin_ / out: [S * BH, rows, M, X] fp32 state arrays holding chunk c at row c + rows - n (the forward's states
    have the state before chunk 0 in row 0), S of them sharing dec: [BH, n, M]; x0: [S * BH, M, X] or None (zero);
    tile: the (slots, columns) of one program; fast: launched by `fast_launch`."""
    nbh, n, M = dec.shape
    BH, rows, X = out.shape[0], out.shape[1], out.shape[-1]
    BM, BD = tile
    nseg = cdiv(n, segment)
    nchain = (M // BM) * cdiv(X, BD) * BH
    flags = counters(out.device, 1 + nchain * nseg)
    carry = torch.empty(nchain, nseg, BM, BD, dtype=torch.float32, device=out.device)
    fast_launch.launch(_chained_scan_kernel, (nchain * nseg,), bin_, dec, out, out if x0 is None else x0, carry,
                       flags, n, nseg, rows, rows - n, nbh, nchain, M=M, DX=X, BM=BM, BD=BD, K=segment,
                       REVERSE=reverse, HAS_X0=x0 is not None, num_warps=4, fast=fast)
    return out
