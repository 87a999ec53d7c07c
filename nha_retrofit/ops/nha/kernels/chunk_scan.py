"""Linear scans over the chunk axis of the slot states: x <- dec[c] * x + b[c], one [M, X] tile per chunk.

The forward needs the state before every chunk (`slot_states`: inclusive, in place over the chunk updates); the
slot backward needs the state gradient after every chunk (`reverse_scan`: exclusive, from the last chunk back).
A scan over n chunks is a chain of n dependent steps (one program walking all of them took 0.23-0.76 ms at 32K on
the H200, n = 512, however many programs ran). `chained_chunk_scan` cuts the chain into segments of K
chunks, each loaded as one block and scanned from zero in registers; only the segments' carries pass from one to
the next, in one launch: each segment's program waits for its predecessor's carry and stores its states through
it, so the states cross DRAM once each way (a segment scan launch plus a fixup launch moved them twice: ~0.45 ms
more per 32K training step; walking each segment twice read its chunks twice: 0.41 against 0.29 ms per 32K
training scan). `naive_chunk_scan` is the
plain PyTorch definition it is tested against. Several state arrays that share their decays (the key and the value
states) scan in one launch: state row r takes the decays of row r % NBH.
"""

import torch
import triton
import triton.language as tl

from ...utils.launch import cdiv, counters, launch, next_power_of_2


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
def _affine(a1, b1, a2, b2):
    """Two scan steps x -> a x + b in order (first (a1, b1), then (a2, b2)) as one."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _chained_scan_kernel(BIN, DEC, OUT, X0, CARRY, FLAGS, N, NSEG, ROWS, SHIFT, NBH, NCHAIN,
                         M: tl.constexpr, DX: tl.constexpr, DXP: tl.constexpr, BM: tl.constexpr, K: tl.constexpr,
                         KB: tl.constexpr, REVERSE: tl.constexpr, HAS_X0: tl.constexpr):
    """The scan in one launch: one program per (segment s of K steps, chain = BM slots of a state x batch x head).
    It loads its steps' decays and inputs as one [KB, BM x DXP] block (KB = K and DXP = DX rounded up to powers of
    two; every load in flight at once), scans them from zero in registers (`tl.associative_scan` of the steps as
    affine maps over the block's chunks, which each thread holds for its columns: per step the decay product and
    the state), waits for the carry out of segment s - 1 (CARRY, published by setting its flag), publishes its own
    carry out, and stores its states, the carry taken through the scanned maps. Each input and state crosses DRAM
    once (a walk over the steps read them twice: once for the segment's carry, once to store its states).

    Step i of the walk outputs chunk i (forward: the state after it) or N - 1 - i (reverse: the state after it,
    i.e. before step i of the walk back: the inclusive scan over the chunks after it, so step i takes the input
    and decay of chunk N - i, and none for i = 0).

    Programs take tickets (FLAGS[0]) in the order they start and ticket t is (segment t // NCHAIN, chain
    t % NCHAIN), so a program only waits for one that started before it: no deadlock, however the hardware orders
    the programs. The flags (FLAGS[1 + chain * NSEG + s]) and the ticket counter start at zero and end at zero
    (each flag reset by its one reader, the counter by the last ticket's program), for the next launch."""
    ticket = tl.atomic_add(FLAGS, 1)
    if ticket == NSEG * NCHAIN - 1:  # every program has its ticket
        tl.atomic_xchg(FLAGS, 0)
    s = ticket // NCHAIN
    chain = ticket % NCHAIN
    NSL: tl.constexpr = (M + BM - 1) // BM
    BE: tl.constexpr = BM * DXP
    m0 = (chain % NSL) * BM
    bh = (chain // NSL).to(tl.int64)
    col = tl.arange(0, BE)  # (slot m0 + col // DXP, column col % DXP) of the state
    slot = m0 + col // DXP
    d = col % DXP
    emask = (slot < M) & (d < DX)
    e = slot * DX + d
    k = tl.arange(0, KB)
    i = s * K + k
    out_ok = (k < K) & (i < N)
    if REVERSE:
        c_out = N - 1 - i
        c_in = N - i
        in_ok = out_ok & (i > 0)
    else:
        c_out = i
        c_in = i
        in_ok = out_ok
    slots = m0 + tl.arange(0, BM)  # the decays per slot, broadcast over the slot's columns
    dec = tl.load(DEC + ((bh % NBH) * N + c_in)[:, None] * M + slots[None, :],
                  mask=in_ok[:, None] & (slots < M)[None, :], other=1.0)
    dec = tl.reshape(tl.broadcast_to(dec[:, :, None], [KB, BM, DXP]), [KB, BE])
    x_in = tl.load(BIN + ((bh * ROWS + c_in + SHIFT) * M * DX)[:, None] + e[None, :],
                   mask=in_ok[:, None] & emask[None, :], other=0.0)
    prods, ends = tl.associative_scan((dec, x_in), 0, _affine)
    last = k[:, None] == KB - 1  # (padding steps are identities) the whole segment's map
    prod = tl.sum(tl.where(last, prods, 0.0), 0)
    end = tl.sum(tl.where(last, ends, 0.0), 0)
    link = chain.to(tl.int64) * NSEG + s  # this segment's flag and carry out
    if s == 0:
        if HAS_X0:
            carry = tl.load(X0 + bh * M * DX + e, mask=emask, other=0.0).to(tl.float32)
        else:
            carry = tl.zeros([BE], dtype=tl.float32)
    else:
        while tl.atomic_add(FLAGS + link, 0, sem="acquire") == 0:  # FLAGS + 1 + (link - 1)
            pass
        tl.atomic_xchg(FLAGS + link, 0)
        tl.debug_barrier()  # every thread's loads after the acquire
        carry = tl.load(CARRY + (link - 1) * BE + col, cache_modifier=".cg")
    if s + 1 < NSEG:
        tl.store(CARRY + link * BE + col, prod * carry + end)
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_xchg(FLAGS + 1 + link, 1, sem="release")
    tl.store(OUT + ((bh * ROWS + c_out + SHIFT) * M * DX)[:, None] + e[None, :], prods * carry[None, :] + ends,
             mask=out_ok[:, None] & emask[None, :])


def scan_warps(slots, X):
    """Warps of a chained-scan program of `slots` slots: one per 128 of its block's columns (32 threads x 4), so the
    warps split the columns, each thread holds its columns for every chunk, and the scan over the chunks runs within
    each thread (more warps would split the chunks: the scan then crosses warps through shared memory)."""
    return max(1, min(8, slots * next_power_of_2(X) // 128))


def chained_chunk_scan(bin_, dec, out, segment, slots, x0=None, reverse=False):
    """The scan of `naive_chunk_scan` in one launch of chained segments of `segment` chunks, into `out` (may be
    `bin_`: in place).

    bin_ / out: [S * BH, rows, M, X] fp32 state arrays holding chunk c at row c + rows - n (the forward's states
    have the state before chunk 0 in row 0), S of them sharing dec: [BH, n, M]; x0: [S * BH, M, X] or None (zero);
    slots: state slots per program (a power of two)."""
    nbh, n, M = dec.shape
    BH, rows, X = out.shape[0], out.shape[1], out.shape[-1]
    nseg = cdiv(n, segment)
    nchain = cdiv(M, slots) * BH
    flags = counters(out.device, 1 + nchain * nseg)
    carry = torch.empty(nchain, nseg, slots * next_power_of_2(X), dtype=torch.float32, device=out.device)
    launch(_chained_scan_kernel, (nchain * nseg,), bin_, dec, out, out if x0 is None else x0, carry,
                       flags, n, nseg, rows, rows - n, nbh, nchain, M=M, DX=X, DXP=next_power_of_2(X), BM=slots,
                       K=segment, KB=next_power_of_2(segment), REVERSE=reverse, HAS_X0=x0 is not None,
                       num_warps=scan_warps(slots, X))
    return out
