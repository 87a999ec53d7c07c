"""Triton forward of the NHA operator: a slot-state scan and one fused window + slot-read kernel.

Notation (DESIGN.md section 2); CS tokens per slot-state chunk (`inference_chunk`, or CONFIG["train_chunk"] for a
forward whose backward will run: `Prepared.cs`). Stream index u = query
position t. Query u reads the slots after absorbing tokens j = 0 .. u - W (W = window), plus the window keys
u - W + 1 .. u, under one softmax. Writing
j = u' - W, the slot part is an inclusive gated-slot read over a "shifted" stream u' (token u' - W), so the
chunk states sit at stream positions c * CS, i.e. after absorbing tokens j < c * CS - W.

1. `kv_states`: `_chunk_update_kernel` (every chunk in parallel: its own update, only exp(a_last - a_j) <= 1
   factors, safe for any gate) then a scan over chunks (`chunk_scan.py`'s chained scan, or the one-pass
   `_state_scan_kernel`): the fp32 slot states before each stream chunk of CS tokens, and the final state; the
   key and the value states in one set of launches with CONFIG["merge_kv_states"].
2. `_fwd_kernel`: per (query block of `fwd_block(G)` tokens, batch, kv head), all G query heads of the kv head as rows
   (row r = token r // G, head r % G), so K/V tiles are loaded once per kv head (GQA without expansion).
   It runs flash-style online softmax over the sliding window (keys max(0, t-W+1) .. t), then computes the
   M slot logits (carried chunk state + intra-chunk tokens), merges both under one softmax, reads the slot
   values, and stores o and the joint log-sum-exp L (natural log; +inf for rows with nothing visible, so a
   backward pass gets exp(s - L) = 0 there).

Intra-chunk decays are factored around the start of the query block (`_block_split`): tokens of the chunk
before the block take exp(a_u - a_ref) exp(a_ref - a_j), both <= 1, and so do the block's own tokens unless the
block decays a slot by more than CONFIG["block_factor_limit"] nats; then they get direct weights
exp(a_u - a_j) s_j (a loop of rank-1 updates, one per block token), so no decay overflows. The slot part takes
q, k and the state in 64-column passes, the row decays from a cumsum over the rows, and the value read in two
column halves of the accumulator, so fewer [rows x 128] fp32 tiles are live at once (register spills,
`regreport.py`).
"""

import copy
import math
import os

import torch
import triton
import triton.language as tl

from . import launch as fast_launch
from .chunk_scan import chained_chunk_scan
from .settings import CONFIG, state_segment
from .launch import cdiv, next_power_of_2
from .products import dot_f32, dot_hilo, dot_xa, dot_xb, product_precision

POISON = False  # tests set this: output buffers start as NaN, so an element no kernel writes fails the check


def launch(name, kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs), by `fast_launch` unless CONFIG["fast_launch"] is off, then `launched(name)`."""
    fast_launch.launch(kernel, grid, *args, fast=CONFIG["fast_launch"], **kwargs)
    launched(name)


def launched(name):
    """After a kernel launch: with CONFIG["debug_sync"] (or NHA_KERNEL_SYNC=1) synchronize and name the kernel
    in any CUDA error, so an asynchronous fault (illegal memory access) is pinned to the kernel that made it
    instead of surfacing at a later launch. A no-op otherwise (and on the CPU interpreter)."""
    if not (CONFIG.get("debug_sync") or os.environ.get("NHA_KERNEL_SYNC") == "1") or not torch.cuda.is_available():
        return
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - re-raised with the kernel's name
        raise RuntimeError(f"CUDA error in or before NHA kernel {name}: {exc}") from exc


def alloc(*shape, dtype, device):
    """torch.empty, or when POISON is set NaN-filled (integers: their dtype's least value, which no kernel stores)."""
    if POISON:
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


_CONSTANTS = {}  # (value, dtype, device) -> the fill buffers handed out so far, the largest last


def constant(shape, value, dtype, device):
    """A read-only tensor of `shape` filled with `value`: a view of one cached buffer per (value, dtype, device), so
    a step without a mask or a slot bias launches no fill kernels (each costs ~20 us of host time on the H200's
    host). A buffer outgrown is kept, since a captured CUDA graph may still read it; during capture the fill is
    fresh (the cache must not hand out memory of the graph's private pool)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.full(shape, value, dtype=dtype, device=device)
    n = math.prod(shape)
    buffers = _CONSTANTS.setdefault((value, dtype, device), [])
    if not buffers or buffers[-1].numel() < n:
        buffers.append(torch.full((max(n, 2 * buffers[-1].numel() if buffers else 4096),), value, dtype=dtype,
                                  device=device))
    return buffers[-1][:n].view(shape)


@triton.jit
def _token_strides(HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr):
    """Token and head strides of the contiguous [B, T, heads, dim] operands (`Prepared` makes every input so, the
    wrappers allocate every output so): q (token only), k, v, o (token only); the gates' [B, T, H, M] are H * M
    and M. Constants, not launch arguments: each argument costs host time in Triton's launcher. The batch strides
    depend on T and stay arguments (`batch_strides`): derived in the kernels they would be values held in registers,
    where arguments sit in the constant bank (a version that derived them spilled more; NOTES.md, session 12)."""
    return HQ * D, H * D, D, H * DV, DV, HQ * DV


def batch_strides(p, do):
    """The batch strides the kernels take: q (and q_rope), k (k_rope), v, the gates, o / dO."""
    return p.q.stride(0), p.k.stride(0), p.v.stride(0), p.log_alpha.stride(0), do.stride(0)


@triton.jit
def _real(MASK, b, T, j, valid):
    """valid & whether tokens j of sequence b are real under the attention mask MASK [B, T] (int32). MASK None (no
    mask: every token real) is a constexpr, so that specialization loads nothing."""
    if MASK is None:  # (one return after the branches: Triton compiles the code after a returning branch too)
        real = valid
    else:
        real = valid & (tl.load(MASK + b * T + j, mask=valid, other=0) > 0)
    return real


@triton.jit
def _update_columns(DX: tl.constexpr, BD: tl.constexpr):
    """An update program's stream (0: X, 1: X2: program axis 2 runs over X's column blocks, then X2's), batch, kv
    head, state columns offs_d and their mask (axis 1: batch x kv head)."""
    NDB: tl.constexpr = (DX + BD - 1) // BD
    offs_d = (tl.program_id(2) % NDB) * BD + tl.arange(0, BD)
    return tl.program_id(2) // NDB, offs_d, offs_d < DX


@triton.jit
def _chunk_inputs(X, X2, G, MASK, stream, b, h, offs_m, offs_d, dmask, c, more, sx_b, sg_b, T, W,
                  H: tl.constexpr, M: tl.constexpr, DX: tl.constexpr, CSZ: tl.constexpr):
    """What stream chunk c's own update reads: its gates g [CS, BM] (slots offs_m, as loaded), its inputs x [CS, BD]
    (columns offs_d of X, or X2 for stream 1) and which of its tokens are real, jr [CS]; none where `more` is false
    (zeros: an empty chunk)."""
    sx_t, sx_h, sg_t, sg_h = H * DX, DX, H * M, M  # contiguous layouts (as `_token_strides`)
    j = c * CSZ - W + tl.arange(0, CSZ)
    jv = (j >= 0) & (j < T - W) & more
    jr = _real(MASK, b, T, j, jv)
    g = tl.load(G + b * sg_b + j[:, None].to(tl.int64) * sg_t + h * sg_h + offs_m[None, :],
                mask=jr[:, None], other=0.0)
    x_off = b * sx_b + j[:, None].to(tl.int64) * sx_t + h * sx_h + offs_d[None, :]
    if stream == 0:
        x = tl.load(X + x_off, mask=jr[:, None] & dmask[None, :], other=0.0)
    else:
        x = tl.load(X2 + x_off, mask=jr[:, None] & dmask[None, :], other=0.0)
    return g, x, jr


@triton.jit
def _own_update(g, x, jr, CSZ: tl.constexpr, PREC: tl.constexpr):
    """A chunk's own update of the state from its `_chunk_inputs`, sum_j s_j exp(a_last - a_j) (x) x_j [BM, BD], and
    its decay exp(a_last) [BM] (each slot's are its own). An empty chunk: zero, and decay 1."""
    a = _chunk_cumsum(g, CSZ)
    g = g.to(tl.float32)
    a_last = tl.sum(g, axis=0)
    wgt = tl.where(jr[:, None], (1.0 - tl.exp(g)) * tl.exp(a_last[None, :] - a), 0.0)
    return dot_xb(tl.trans(wgt), x.to(tl.float32), PREC), tl.exp(a_last)  # x: upcast inputs, exact in the split


@triton.jit
def _chunk_own_update(X, X2, G, MASK, stream, b, h, offs_m, offs_d, dmask, c, sx_b, sg_b, T, W,
                      H: tl.constexpr, M: tl.constexpr, DX: tl.constexpr, CSZ: tl.constexpr, PREC: tl.constexpr):
    """Stream chunk c's `_own_update` (a chunk past the stream is empty)."""
    g, x, jr = _chunk_inputs(X, X2, G, MASK, stream, b, h, offs_m, offs_d, dmask, c, True, sx_b, sg_b, T, W, H, M,
                             DX, CSZ)
    return _own_update(g, x, jr, CSZ, PREC)


@triton.jit
def _chunk_update_kernel(
    X, X2, G, MASK, U, DEC,
    sx_b, sg_b, T, W, NCH,
    H: tl.constexpr, M: tl.constexpr, DX: tl.constexpr, CSZ: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, ZERO_FIRST: tl.constexpr,
):
    """Per stream chunk c (in parallel): U[c+1] = sum_j s_j exp(a_last - a_j) (x) x_j, DEC[c] = exp(a_last), and
    with ZERO_FIRST the zero state before chunk 0 in U[0].
    Program axis 2 runs over the column blocks of X, then (if it is twice as long) of X2, an input of the same
    layout whose states follow X's in U (the key and the value states in one launch)."""
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    stream, offs_d, dmask = _update_columns(DX, BD)
    upd, dec = _chunk_own_update(X, X2, G, MASK, stream, pid_bh // H, pid_bh % H, tl.arange(0, M), offs_d, dmask, c,
                                 sx_b, sg_b, T, W, H, M, DX, CSZ, PREC)
    base = (stream * tl.num_programs(1) + pid_bh).to(tl.int64) * (NCH + 1) + c + 1
    tile = tl.arange(0, M)[:, None] * DX + offs_d[None, :]
    tl.store(U + base * M * DX + tile, upd, mask=dmask[None, :])
    if ZERO_FIRST:
        if c == 0:
            tl.store(U + (base - 1) * M * DX + tile, tl.zeros([M, BD], dtype=tl.float32), mask=dmask[None, :])
    if tl.program_id(2) == 0:
        tl.store(DEC + (pid_bh.to(tl.int64) * NCH + c) * M + tl.arange(0, M), dec)


@triton.jit
def _segment_update_kernel(
    X, X2, G, MASK, LOCAL, DCUM, ENDS, DSEG, DEC, START,
    sx_b, sg_b, T, W, NCH, NSEG,
    H: tl.constexpr, M: tl.constexpr, DX: tl.constexpr, CSZ: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, ZERO_FIRST: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Per segment of K stream chunks (program axis 0; axes 1 and 2 as `_chunk_update_kernel`'s), its chunks in
    order: LOCAL[c] = the segment-local state before chunk c (from zero at the segment's start: every chunk's own
    update, decayed, summed in registers), DCUM[c] = the decay from the segment's start to chunk c; the local state
    after its last chunk in ENDS[segment + 1] and its whole decay in DSEG[segment] (with ZERO_FIRST a zero ENDS[0]);
    unless DEC is None each chunk's own decay in DEC[c], as `_chunk_update_kernel` (for the reverse scan).
    The state before chunk c is then LOCAL[c] + DCUM[c] * (the state before its segment), which a scan over the
    segments' ENDS gives (`local_slot_states`): the states cross DRAM once, where the chunk update and the chained
    scan move them three times. Each of LOCAL, DCUM, ENDS, DSEG may be None (not stored). With START (the states
    before each segment, [rows, NSEG + 1, M, DX]) the walk starts from the segment's state instead of zero, so LOCAL
    gets the whole states, and the last segment also stores the final one, LOCAL[NCH] (`walked_slot_states`).
    PREFETCH: each step loads the next chunk's inputs before forming its own update, so the loads' latency overlaps
    the products (the walk is one chain of steps per program)."""
    NSB: tl.constexpr = M // BM  # program axis 0: segment x block of BM slots (each slot's updates are its own)
    seg = tl.program_id(0) // NSB
    pid_bh = tl.program_id(1)
    stream, offs_d, dmask = _update_columns(DX, BD)
    row = (stream * tl.num_programs(1) + pid_bh).to(tl.int64)
    offs_m = (tl.program_id(0) % NSB) * BM + tl.arange(0, BM)
    tile = offs_m[:, None] * DX + offs_d[None, :]
    if START is not None:
        state = tl.load(START + (row * (NSEG + 1) + seg) * M * DX + tile, mask=dmask[None, :], other=0.0)
    else:
        state = tl.zeros([BM, BD], dtype=tl.float32)
    dcum = tl.full([BM], 1.0, dtype=tl.float32)
    b, h = pid_bh // H, pid_bh % H
    if PREFETCH:  # the first chunk's inputs; each step then loads the next chunk's before its own products
        g, x, jr = _chunk_inputs(X, X2, G, MASK, stream, b, h, offs_m, offs_d, dmask, seg * K, True, sx_b, sg_b, T,
                                 W, H, M, DX, CSZ)
    for i in range(K):
        c = seg * K + i
        inside = (c + 0 * offs_m) < NCH  # (a vector mask: the interpreter lacks scalar ones)
        if LOCAL is not None:
            tl.store(LOCAL + (row * (NCH + 1) + c) * M * DX + tile, state, mask=inside[:, None] & dmask[None, :])
        if DCUM is not None:
            if tl.program_id(2) == 0:
                tl.store(DCUM + (pid_bh.to(tl.int64) * NCH + c) * M + offs_m, dcum, mask=inside)
        if PREFETCH:
            g_next, x_next, jr_next = _chunk_inputs(X, X2, G, MASK, stream, b, h, offs_m, offs_d, dmask, c + 1,
                                                    i + 1 < K, sx_b, sg_b, T, W, H, M, DX, CSZ)
            upd, dec = _own_update(g, x, jr, CSZ, PREC)
            g, x, jr = g_next, x_next, jr_next
        else:
            upd, dec = _chunk_own_update(X, X2, G, MASK, stream, b, h, offs_m, offs_d, dmask, c, sx_b, sg_b, T, W, H,
                                         M, DX, CSZ, PREC)
        if DEC is not None:
            if tl.program_id(2) == 0:
                tl.store(DEC + (pid_bh.to(tl.int64) * NCH + c) * M + offs_m, dec, mask=inside)
        state = dec[:, None] * state + upd
        dcum = dcum * dec
    if ENDS is not None:
        ends = row * (NSEG + 1) + seg
        tl.store(ENDS + (ends + 1) * M * DX + tile, state, mask=dmask[None, :])
        if ZERO_FIRST:
            if seg == 0:
                tl.store(ENDS + ends * M * DX + tile, tl.zeros([BM, BD], dtype=tl.float32), mask=dmask[None, :])
    if DSEG is not None:
        if tl.program_id(2) == 0:
            tl.store(DSEG + (pid_bh.to(tl.int64) * NSEG + seg) * M + offs_m, dcum)
    if START is not None:  # past its last chunk: the final state
        final = (seg + 0 * offs_m) == NSEG - 1
        tl.store(LOCAL + (row * (NCH + 1) + NCH) * M * DX + tile, state, mask=final[:, None] & dmask[None, :])


@triton.jit
def _state_scan_kernel(S, DEC, S0, NCH, NBH, M: tl.constexpr, DX: tl.constexpr, BM: tl.constexpr,
                       BD: tl.constexpr, HAS_S0: tl.constexpr):
    """In place over S [rows, NCH + 1, M, DX] holding the chunk updates at 1..NCH: S[c+1] = DEC[c] * S[c] + U[c+1]
    (row r with the decays DEC[r % NBH]: the key and the value states in one launch)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    NDB: tl.constexpr = (DX + BD - 1) // BD
    offs_m = (pid_t // NDB) * BM + tl.arange(0, BM)
    offs_d = (pid_t % NDB) * BD + tl.arange(0, BD)
    dmask = offs_d < DX
    tile = offs_m[:, None] * DX + offs_d[None, :]
    base = pid_bh.to(tl.int64) * (NCH + 1)
    if HAS_S0:
        state = tl.load(S0 + pid_bh.to(tl.int64) * M * DX + tile, mask=dmask[None, :], other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BM, BD], dtype=tl.float32)
    tl.store(S + base * M * DX + tile, state, mask=dmask[None, :])
    for c in range(NCH):
        upd = tl.load(S + (base + c + 1) * M * DX + tile, mask=dmask[None, :], other=0.0)
        dec = tl.load(DEC + ((pid_bh % NBH).to(tl.int64) * NCH + c) * M + offs_m)
        state = dec[:, None] * state + upd
        tl.store(S + (base + c + 1) * M * DX + tile, state, mask=dmask[None, :])


@triton.jit
def _query_rows(T, H: tl.constexpr, GQ: tl.constexpr, CQB: tl.constexpr, BR: tl.constexpr):
    """The rows of a query-block program (axis 0: the block of CQB tokens from t0, axis 1: batch x kv head):
    BR rows, token-major (row r: token t = t0 + r // GQ, query head hq = h * GQ + r % GQ), tv the real ones.
    Returns (pid_bh, b, h, t0, r, tok, t, tv, hq), tok = r // GQ the token inside the block."""
    pid_q = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    t0 = pid_q * CQB
    r = tl.arange(0, BR)
    tok = r // GQ
    t = t0 + tok
    tv = (r < CQB * GQ) & (t < T)
    hq = h * GQ + r % GQ
    return pid_bh, b, h, t0, r, tok, t, tv, hq


@triton.jit
def _row_stats(LSE, DELTA, b, t, hq, tv, T, HQ: tl.constexpr):
    """Index lrow of the rows in [B, T, HQ] statistics, and their log-sum-exp and delta (backward kernels; zeros
    for DELTA None)."""
    lrow = (b * T + t).to(tl.int64) * HQ + hq
    lse = tl.load(LSE + lrow, mask=tv, other=float("inf"))
    if DELTA is None:
        delta = tl.zeros_like(lse)
    else:
        delta = tl.load(DELTA + lrow, mask=tv, other=0.0)
    return lrow, lse, delta


@triton.jit
def _prefix_sums(g, incl):
    """incl [R, K] (0/1) . g [K, MT] with the gates g as loaded (the inputs' dtype): the gate sums each row selects
    (the prefix sums of a chunk or of a query block) as one matrix product, exact products summed in fp32.
    tl.cumsum's shuffle tree took ~10% of the fused forward's warp samples (NOTES.md session 18). Callers take it
    only for tiles of 64 slots or more: with 32 the H200 got the key kernels' gradients wrong at 64-token chunks
    (Triton 3.6; right under the interpreter, NOTES.md session 18), as small slot tiles did in session 5."""
    if g.dtype == tl.float32:
        return tl.dot(incl.to(tl.float32), g, input_precision="ieee")
    return tl.dot(incl.to(g.dtype), g)


@triton.jit
def _chunk_cumsum(g, CSZ: tl.constexpr):
    """The chunk's inclusive prefix sums of its gates g [CS, MT] (as loaded), fp32: `_prefix_sums` for tiles of at
    least 64 slots, else tl.cumsum."""
    if g.shape[1] < 64:
        a = tl.cumsum(g.to(tl.float32), axis=0)
    else:
        offs = tl.arange(0, CSZ)
        a = _prefix_sums(g, offs[None, :] <= offs[:, None])
    return a


@triton.jit
def _row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, t0, tok, first_head, T, W, CQB: tl.constexpr, M: tl.constexpr,
               MT: tl.constexpr, BY_SCAN: tl.constexpr):
    """Per row (token t0 + tok of the query block from t0, one of its heads): the summed log gates of the stream
    positions from the block's start to the row's token inclusive. [rows, MT]: M slots, zero in the padding
    columns of a wider slot tile MT >= M.
    By default one product of the block's gates [CQB, MT] with the rows' token masks (tiles of 64 slots or more,
    `_prefix_sums`); BY_SCAN or narrower tiles: tl.cumsum over the rows, each token's gates loaded into its
    `first_head` row (BY_SCAN: the key kernels, where the product's tiles spill, 0.29 ms more per 32K step on the
    H200, NOTES.md session 18)."""
    SCAN: tl.constexpr = BY_SCAN | (MT < 64)
    offs_m = tl.arange(0, MT)
    if SCAN:
        j = t0 + tok - W
        jv = first_head & (j >= 0) & (j < T - W)
    else:
        BK: tl.constexpr = 16 if CQB < 16 else CQB  # a matrix product's inner size is at least 16
        i = tl.arange(0, BK)
        j = t0 + i - W
        jv = (i < CQB) & (j >= 0) & (j < T - W)
    jr = _real(MASK, b, T, j, jv)
    g = tl.load(G + b * sg_b + j[:, None].to(tl.int64) * sg_t + h * sg_h + offs_m[None, :],
                mask=jr[:, None] & (offs_m < M)[None, :], other=0.0)
    if SCAN:
        a_in = tl.cumsum(g.to(tl.float32), axis=0)
    else:
        a_in = _prefix_sums(g, i[None, :] <= tok[:, None])
    return a_in


@triton.jit
def _block_split(g, off, CQB: tl.constexpr, CSZ: tl.constexpr, LIMIT: tl.constexpr):
    """How the chunk's tokens enter the query block at chunk offset off (g: the chunk's masked gates [CS, M]).
    Returns a_ref (the summed gates before the block, [M]); `factored` [CS]: the tokens whose slot weights take
    the factored form exp(a_u - a_ref) * exp(a_ref - a_j) (one matrix product); `direct`: whether the block's
    own tokens need direct weights exp(a_u - a_j) (a loop of CQB rank-1 updates).
    Tokens before the block are always factored (both factors <= 1). The block's own tokens are factored too
    when the block decays by at most LIMIT nats in every slot, so exp(a_ref - a_j) <= exp(LIMIT) stays far
    from fp32 overflow; a block that resets a slot harder takes the direct loop (exact under any decay)."""
    offs_u = tl.arange(0, CSZ)
    before = offs_u < off
    inside = (offs_u >= off) & (offs_u < off + CQB)
    a_ref = tl.sum(tl.where(before[:, None], g, 0.0), 0)
    decay = tl.max(tl.sum(tl.where(inside[:, None], -g, 0.0), 0), 0)
    return a_ref, tl.where(decay <= LIMIT, before | inside, before), decay > LIMIT


@triton.jit
def _cumsum_row(a, u, CSZ: tl.constexpr):
    """Row u of the chunk's gate cumsum a [CS, M] (zeros for u = -1: nothing before the chunk's first token)."""
    return tl.sum(tl.where(tl.arange(0, CSZ)[:, None] == u, a, 0.0), 0)


@triton.jit
def _block_split_cumsum(a, off, CQB: tl.constexpr, CSZ: tl.constexpr, LIMIT: tl.constexpr):
    """`_block_split` from the gates' cumsum a [CS, M] instead of the gates (a kernel that keeps only a live)."""
    a_ref = _cumsum_row(a, off - 1, CSZ)
    _, factored, direct = _carried_block_split(a, a_ref, off, CQB, CSZ, LIMIT)
    return a_ref, factored, direct


@triton.jit
def _carried_block_split(a, a_ref, off, CQB: tl.constexpr, CSZ: tl.constexpr, LIMIT: tl.constexpr):
    """`_block_split` of the block at chunk offset off from the gates' cumsum a, given a_ref, the chunk's gates
    before it (in a loop over the chunk's blocks the previous block's end, carried; zeros for the first): one row of
    a per block, not two sums of the gates (each a reduction across the warps over the chunk's tokens; a sum over
    the block's own tokens added to a_ref compiled to more instructions). Returns (a_last, factored, direct), a_last
    this block's end: the next block's a_ref."""
    a_last = _cumsum_row(a, off + CQB - 1, CSZ)
    factored, direct = _block_split_bounds(a_ref, a_last, off, CQB, CSZ, LIMIT)
    return a_last, factored, direct


@triton.jit
def _block_split_bounds(a_ref, a_last, off, CQB: tl.constexpr, CSZ: tl.constexpr, LIMIT: tl.constexpr):
    """`_block_split`'s (factored, direct) from the chunk's summed gates before the block, a_ref, and through its
    last token, a_last ([M] each)."""
    offs_u = tl.arange(0, CSZ)
    before = offs_u < off
    inside = (offs_u >= off) & (offs_u < off + CQB)
    decay = tl.max(a_ref - a_last, 0)
    return tl.where(decay <= LIMIT, before | inside, before), decay > LIMIT


@triton.jit
def _block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, j, T, W, cum, a_in, seen, M: tl.constexpr,
                       MT: tl.constexpr):
    """Token j of the query block: its decays to the rows that see it, exp(a_u - a_j) = exp(a_in - cum)
    [rows, MT] (cum: the block's summed log gates up to j, updated), and its write weight s_j [MT] (M slots,
    zero gates in the padding of a slot tile MT >= M)."""
    offs_m = tl.arange(0, MT)
    ok = (j >= 0) & (j < T - W)
    if MASK is not None:
        ok = ok & (tl.load(MASK + b * T + tl.minimum(tl.maximum(j, 0), T - 1)) > 0)
    jc = tl.where(ok, j, 0).to(tl.int64)  # a valid address either way (no scalar masks: the interpreter lacks them)
    g = tl.where(ok, tl.load(G + b * sg_b + jc * sg_t + h * sg_h + offs_m, mask=offs_m < M, other=0.0).to(tl.float32),
                 0.0)
    cum = cum + g
    return tl.where(seen[:, None], tl.exp(a_in - cum[None, :]), 0.0), 1.0 - tl.exp(g), cum


@triton.jit
def _prefetch_l2(ptrs):
    """Ask for the 128-byte lines at ptrs to be brought into L2 (PTX prefetch.global.L2): no register is held and
    nothing waits, so a later load of them waits on L2 instead of DRAM. The fused forward runs one program per
    multiprocessor (255 registers), whose loads otherwise expose DRAM latency one after another (NOTES.md, session
    28)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(X, row_off, DX: tl.constexpr):
    """_prefetch_l2 of the rows of DX elements of X at the element offsets row_off (DX x X's element size a power
    of two of at least 128 bytes: `prefetchable`)."""
    PER_LINE: tl.constexpr = 1024 // X.dtype.element_ty.primitive_bitwidth
    _prefetch_l2(X + (row_off[:, None] + tl.arange(0, DX // PER_LINE)[None, :] * PER_LINE))


@triton.jit
def _state_tile(S, st, CARRY, ct, dcum, offs_m, cols, M: tl.constexpr, DX: tl.constexpr):
    """Columns `cols` of the slot state before a chunk, [MT, len(cols)] (rows offs_m, zero past slot M): row st of S,
    or in the segment-local form (CARRY not None: `local_slot_states`) S's local state there plus the carry into
    the chunk's segment, row ct of CARRY, times the decay since the segment's start, dcum [MT]."""
    slots = (offs_m < M)[:, None]
    tile = tl.load(S + st * M * DX + offs_m[:, None] * DX + cols[None, :], mask=slots, other=0.0)
    if CARRY is not None:
        tile += dcum[:, None] * tl.load(CARRY + ct * M * DX + offs_m[:, None] * DX + cols[None, :], mask=slots,
                                        other=0.0)
    return tile


@triton.jit
def _chunk_products(X, xrow, Y, yrow, S, st, CARRY, ct, dcum, tv, jr, offs_c, DX: tl.constexpr, BD: tl.constexpr,
                    M: tl.constexpr, MT: tl.constexpr, BR: tl.constexpr, CSZ: tl.constexpr, PREC: tl.constexpr,
                    SPREC: tl.constexpr):
    """The block rows of X (q or dO) against the chunk's tokens of Y (k or v) and against the state before the chunk
    (`_state_tile` of S, CARRY), over column passes: ([rows, CS], [rows, MT]) fp32, zero past slot M."""
    offs_m = tl.arange(0, MT)
    xy = tl.zeros([BR, CSZ], dtype=tl.float32)
    xs = tl.zeros([BR, MT], dtype=tl.float32)
    for d0 in range(0, DX, BD):
        xd = tl.load(X + xrow[:, None] + d0 + offs_c[None, :], mask=tv[:, None], other=0.0)
        yd = tl.load(Y + yrow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        sd = _state_tile(S, st, CARRY, ct, dcum, offs_m, d0 + offs_c, M, DX)
        xy += tl.dot(xd, tl.trans(yd), input_precision=PREC)
        xs += dot_xa(xd.to(tl.float32), tl.trans(sd), SPREC)
    return xy, xs


@triton.jit
def _read_values(acc, pc, wm, SV, st, CARRY, ct, dcum, VP, jr, cols, M: tl.constexpr, MT: tl.constexpr,
                 DV: tl.constexpr, PREC: tl.constexpr, VPREC: tl.constexpr, SPLIT: tl.constexpr):
    """acc[:, cols] + pc . Sv[:, cols] (the value state before the chunk, `_state_tile`) + wm . v[:, cols] (the
    chunk's tokens)."""
    acc += dot_f32(pc, _state_tile(SV, st, CARRY, ct, dcum, tl.arange(0, MT), cols, M, DV), VPREC)
    vj = tl.load(VP + cols[None, :], mask=jr[:, None], other=0.0)
    return acc + _weights_values(wm, vj, PREC, SPLIT)


@triton.jit
def _weights_values(w, v, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """w . v for fp32 weights w and the input values v: w rounded to v's dtype, or with SPLIT split into hi + lo
    (`dot_hilo`), so a training forward's fp32 output is the exact sum P . V that the backward's delta needs."""
    if SPLIT:
        return dot_hilo(w, v)
    else:
        return tl.dot(w.to(v.dtype), v, input_precision=PREC)


@triton.jit
def _window_rows(QR, KR, V, MASK, b, h, t, tv, row_off, t0, T, W, scale, m_i, l_i, acc,
                 sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, D: tl.constexpr, DV: tl.constexpr, CQB: tl.constexpr,
                 BN: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """The sliding-window keys max(0, t-W+1) .. t of the block's rows, merged into the online softmax state
    (m_i, l_i, acc) flash-style."""
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    qr = tl.load(QR + row_off[:, None] + offs_d[None, :], mask=tv[:, None], other=0.0)
    lo = tl.maximum(t0 - W + 1, 0)
    hi = tl.minimum(t0 + CQB, T)
    offs_n = tl.arange(0, BN)
    for n0 in range(lo, hi, BN):
        j = n0 + offs_n
        jin = j < hi
        kr = tl.load(KR + b * sk_b + j[:, None].to(tl.int64) * sk_t + h * sk_h + offs_d[None, :],
                     mask=jin[:, None], other=0.0)
        s = tl.dot(qr, tl.trans(kr), input_precision=PREC) * scale
        valid = (j[None, :] <= t[:, None]) & (j[None, :] > t[:, None] - W) & _real(MASK, b, T, j, jin)[None, :]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.load(V + b * sv_b + j[:, None].to(tl.int64) * sv_t + h * sv_h + offs_dv[None, :],
                     mask=jin[:, None], other=0.0)
        acc = acc * alpha[:, None] + _weights_values(p, vv, PREC, SPLIT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _column_halves(x, BR: tl.constexpr, BDS: tl.constexpr):
    """The two [BR, BDS] column halves of a [BR, 2 BDS] tile (tl.join of them, permuted back, rebuilds it)."""
    return tl.split(tl.permute(tl.reshape(x, [BR, 2, BDS]), [0, 2, 1]))


@triton.jit
def _residual_shift(o):
    """Bits an int8 rounding residual of `o` (bf16/fp16 as stored) drops from the fp32 bit patterns' difference:
    half of o's spacing is 2^15 (bf16) or 2^12 (fp16) fp32 units in the last place, so the shifted difference fits
    int8 (the tie's +128 clamped) to 2^-15 of o (bf16)."""
    return 8 if o.dtype == tl.bfloat16 else 5


@triton.jit
def _store_rounded(O, ORES, o_off, cols, out, tv):
    """o[:, cols] = out rounded to o's dtype, and with ORES the rounding residual (o + residual ~ out): in ORES's
    dtype, or in int8 as the difference of out's and o's fp32 bit patterns shifted by `_residual_shift`
    (CONFIG["int8_residual"]; `_with_residual` adds it back)."""
    rounded = out.to(O.dtype.element_ty)
    tl.store(O + o_off[:, None] + cols[None, :], rounded, mask=tv[:, None])
    if ORES is not None:
        if ORES.dtype.element_ty == tl.int8:  # the fp32 bit patterns' difference (same sign: monotonic), shifted
            units = out.to(tl.int32, bitcast=True) - rounded.to(tl.float32).to(tl.int32, bitcast=True)
            residual = tl.minimum(tl.maximum(units >> _residual_shift(rounded), -127), 127)
        else:
            residual = out - rounded.to(tl.float32)
        tl.store(ORES + o_off[:, None] + cols[None, :], residual.to(ORES.dtype.element_ty), mask=tv[:, None])


@triton.jit
def _with_residual(o, residual):
    """The fp32 output from `o` as stored and its rounding residual as `_store_rounded` stored it."""
    if residual.dtype == tl.int8:
        out = o.to(tl.float32).to(tl.int32, bitcast=True) + (residual.to(tl.int32) << _residual_shift(o))
        return out.to(tl.float32, bitcast=True)
    return o.to(tl.float32) + residual.to(tl.float32)


@triton.jit
def _fwd_kernel(
    Q, K, V, QR, KR, G, MASK, FIRST, FILLED0, BIAS, SK, SV, CK, CV, DCUM, O, ORES, LSE, LOGITS,
    sq_b, sk_b, sv_b, sg_b, so_b,
    T, W, NCH, NSEG, scale,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    MT: tl.constexpr, CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SLOTS: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr,
    VPREC: tl.constexpr, KPREC: tl.constexpr, BDS: tl.constexpr, LIMIT: tl.constexpr, SLOTS_FIRST: tl.constexpr,
    STORE_LOGITS: tl.constexpr, KSEG: tl.constexpr, PREFETCH: tl.constexpr, WHOLE_CHUNK_SPLIT: tl.constexpr,
    FACTORED_DECAY: tl.constexpr, DECAYS_LATE: tl.constexpr,
):
    """o and the joint log-sum-exp of a block of query rows (module docstring; LSE None for a forward without a
    backward: storing it cost 0.06 ms per 32K forward on the H200, NOTES.md session 30); with STORE_LOGITS also the
    scaled slot logits before the bias, LOGITS [B, T, HQ, M] fp32, which the slot backward's rows kernel then loads
    instead of forming them again. With ORES (a training forward in bf16/fp16) the weights' products with the input
    values are split (`_weights_values`) and ORES gets o's rounding residual (`_store_rounded`): o with it is the
    fp32 output, from which the backward takes delta = rowsum(dO * O). With CK (CV, DCUM, NSEG, KSEG) the states SK,
    SV are segment-local (`local_slot_states`): CK and CV hold the states before each segment of KSEG chunks."""
    SPLIT: tl.constexpr = ORES is not None
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = _token_strides(HQ, H, D, DV)
    sg_t, sg_h = H * M, M
    # the rows of `_query_rows`, inline: the helper's order of the index arithmetic changes this kernel's SASS
    # at GQ = 3 (checked by ptxas / cuobjdump)
    pid_q = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    t0 = pid_q * CQB
    r = tl.arange(0, BR)
    tok = r // GQ
    gh = r % GQ
    t = t0 + tok
    tv = (r < CQB * GQ) & (t < T)
    hq = h * GQ + gh
    offs_dv = tl.arange(0, DV)
    active = _real(MASK, b, T, t, tv)
    row_off = b * sq_b + t.to(tl.int64) * sq_t + hq * D  # q, q_rope share strides

    m_i = tl.full([BR], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BR], dtype=tl.float32)
    acc = tl.zeros([BR, DV], dtype=tl.float32)

    if HAS_WINDOW:
        if not SLOTS_FIRST:
            m_i, l_i, acc = _window_rows(QR, KR, V, MASK, b, h, t, tv, row_off, t0, T, W, scale, m_i, l_i, acc,
                                         sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, D, DV, CQB, BN, PREC, SPLIT)
    if HAS_SLOTS:
        c = t0 // CSZ
        cs0 = c * CSZ
        off = t0 - cs0
        offs_u = tl.arange(0, CSZ)
        u = cs0 + offs_u
        j = u - W
        ul = off + tok  # row's stream position inside the chunk
        jv = (j >= 0) & (j < T - W) & (offs_u < off + CQB)
        jr = _real(MASK, b, T, j, jv)
        offs_m = tl.arange(0, MT)  # MT >= M: the padding slots have zero gates and states and -inf logits
        slots = offs_m < M
        g = tl.load(G + b * sg_b + j[:, None].to(tl.int64) * sg_t + h * sg_h + offs_m[None, :],
                    mask=jr[:, None] & slots[None, :], other=0.0)
        a = _chunk_cumsum(g, CSZ)  # [CS, MT], from the chunk start, inclusive
        g = g.to(tl.float32)
        causal = offs_u[None, :] <= ul[:, None]  # [BR, CS]
        st = pid_bh.to(tl.int64) * (NCH + 1) + c
        ct = pid_bh.to(tl.int64) * (NSEG + 1) + c // KSEG
        if PREFETCH > 1:  # the value state, read after the softmax, and the key state's later column passes
            state_rows = tl.minimum(offs_m, M - 1)
            _prefetch_rows(SV, st * M * DV + state_rows * DV, DV)
            _prefetch_rows(SK, st * M * D + state_rows * D, D)
        if PREFETCH > 0 and HAS_WINDOW and SLOTS_FIRST:  # the window's keys and values, read after the slot part
            jw = tl.minimum(tl.maximum(t0 - W + 1, 0) + tl.arange(0, 128), T - 1).to(tl.int64)
            _prefetch_rows(KR, b * sk_b + jw * sk_t + h * sk_h, D)
            _prefetch_rows(V, b * sv_b + jw * sv_t + h * sv_h, DV)
        dcum = tl.zeros([MT], dtype=tl.float32)
        if CK is not None:
            dcum = tl.load(DCUM + (pid_bh.to(tl.int64) * NCH + c) * M + offs_m, mask=slots, other=0.0)
        krow = b * sk_b + j.to(tl.int64) * sk_t + h * sk_h
        # row decays by a cumsum over the rows, D in column passes of BDS (fewer live registers); factored
        # weights for the tokens before the block and, unless it decays too hard, inside it (`_block_split`);
        # else the block's own tokens get direct weights below: nothing can overflow
        if WHOLE_CHUNK_SPLIT and CQB == CSZ:  # the block is the chunk: nothing before it, its end is the cumsum's last
            # row (one reduction over the chunk's tokens instead of two)
            a_ref = tl.zeros([MT], dtype=tl.float32)
            _, factored, direct = _carried_block_split(a, a_ref, 0, CQB, CSZ, LIMIT)
        else:
            a_ref, factored, direct = _block_split(g, off, CQB, CSZ, LIMIT)
        if DECAYS_LATE:  # the products first: the decays' tiles are not live through them
            qk, x_car = _chunk_products(Q, row_off, K, krow, SK, st, CK, ct, dcum, tv, jr, tl.arange(0, BDS), D, BDS,
                                        M, MT, BR, CSZ, PREC, KPREC)
        kw = tl.where(jr[:, None] & factored[:, None], (1.0 - tl.exp(g)) * tl.exp(a_ref[None, :] - a), 0.0)
        a_in = _row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, t0, tok, tv & (gh == 0), T, W, CQB, M, MT, False)
        e_in = tl.exp(a_in)  # <= 1 for rows of this block
        if FACTORED_DECAY:  # one exponential per slot instead of one per row and slot (both factors <= 1: a
            # product that underflows is below ~1e-38 either way)
            e_car = e_in * tl.exp(a_ref)[None, :]
        else:
            e_car = tl.exp(a_in + a_ref[None, :])  # <= 1 (inline: through a helper it compiled differently)
        # the same products as the slot backward's rows kernel, so its recomputed logits match this L
        if not DECAYS_LATE:
            qk, x_car = _chunk_products(Q, row_off, K, krow, SK, st, CK, ct, dcum, tv, jr, tl.arange(0, BDS), D, BDS,
                                        M, MT, BR, CSZ, PREC, KPREC)
        qk = tl.where(causal, qk, 0.0)
        if KPREC == "bf16":  # the chunk tokens' key weights rounded to bf16, as the key state (qk split)
            x_in = dot_xb(qk, kw, SPREC) * e_in
        else:
            x_in = dot_f32(qk, kw, SPREC) * e_in
        if direct:
            cum = tl.zeros([MT], dtype=tl.float32)
            for jj in range(CQB):
                e_j, s_j, cum = _block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum,
                                                   a_in, tok >= jj, M, MT)
                x_in += tl.sum(tl.where(offs_u[None, :] == off + jj, qk, 0.0), 1)[:, None] * e_j * s_j[None, :]
        logits = (x_in + x_car * e_car) * scale
        if STORE_LOGITS:
            l_off = ((b * T + t).to(tl.int64) * HQ + hq)[:, None] * M + offs_m[None, :]
            tl.store(LOGITS + l_off, logits, mask=tv[:, None] & slots[None, :])
        bias = tl.load(BIAS + hq, mask=tv, other=0.0).to(tl.float32)
        logits += bias[:, None]
        first = tl.load(FIRST + b)
        filled0 = tl.load(FILLED0 + b)
        readable = active & ((filled0 > 0) | (t - W >= first))
        logits = tl.where(readable[:, None] & slots[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(logits - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
        pc = p * e_car
        wm = tl.where(causal, dot_f32(p * e_in, tl.trans(kw), VPREC), 0.0)
        if direct:
            cum = tl.zeros([MT], dtype=tl.float32)
            for jj in range(CQB):
                e_j, s_j, cum = _block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum,
                                                   a_in, tok >= jj, M, MT)
                wm = tl.where(offs_u[None, :] == off + jj, tl.sum(p * e_j * s_j[None, :], 1)[:, None], wm)
        vp = V + b * sv_b + j[:, None].to(tl.int64) * sv_t + h * sv_h
        if DV == 2 * BDS:  # the value read in two column halves of acc
            halves = _column_halves(acc, BR, BDS)
            cols = tl.arange(0, BDS)
            acc0 = _read_values(halves[0], pc, wm, SV, st, CV, ct, dcum, vp, jr, cols, M, MT, DV, PREC, VPREC, SPLIT)
            acc1 = _read_values(halves[1], pc, wm, SV, st, CV, ct, dcum, vp, jr, BDS + cols, M, MT, DV, PREC, VPREC,
                                SPLIT)
            acc = tl.reshape(tl.permute(tl.join(acc0, acc1), [0, 2, 1]), [BR, DV])
        else:
            acc = _read_values(acc, pc, wm, SV, st, CV, ct, dcum, vp, jr, offs_dv, M, MT, DV, PREC, VPREC, SPLIT)

    if HAS_WINDOW:
        if SLOTS_FIRST:  # the window after the slot part: its tiles are not live while the slot part runs
            m_i, l_i, acc = _window_rows(QR, KR, V, MASK, b, h, t, tv, row_off, t0, T, W, scale, m_i, l_i, acc,
                                         sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, D, DV, CQB, BN, PREC, SPLIT)

    ok = active & (l_i > 0)
    l_safe = tl.where(ok, l_i, 1.0)
    out = tl.where(ok[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(ok, m_i + tl.log(l_safe), float("inf"))
    if LSE is not None:  # before o: 0.01-0.03 ms less per 32K training step (NOTES.md session 30)
        tl.store(LSE + (b * T + t).to(tl.int64) * HQ + hq, lse, mask=tv)
    o_off = b * so_b + t.to(tl.int64) * so_t + hq * DV
    if SPLIT and DV == 2 * BDS:  # o and its residual by column halves (fewer live registers)
        halves = _column_halves(out, BR, BDS)
        cols = tl.arange(0, BDS)
        _store_rounded(O, ORES, o_off, cols, halves[0], tv)
        _store_rounded(O, ORES, o_off, BDS + cols, halves[1], tv)
    else:
        _store_rounded(O, ORES, o_off, offs_dv, out, tv)


def dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def slot_precision(dtype):
    """SPREC (products.py) of the forward's fp32 slot products for `dtype` inputs: CONFIG["slot_precision"]."""
    return product_precision(CONFIG["slot_precision"], dtype)


def value_precision(dtype, training=True):
    """SPREC of the slot part's P.V products: CONFIG["value_precision"], else as slot_precision; for a forward whose
    backward cannot run CONFIG["inference_value_precision"] first (its output alone needs them)."""
    name = None if training else CONFIG["inference_value_precision"]
    return product_precision(name or CONFIG["value_precision"] or CONFIG["slot_precision"], dtype)


def key_precision(dtype, training=True):
    """KPREC of the fused kernel: the SPREC of the slot logits' product with the key state before the chunk (q . Sk^T),
    as slot_precision, except for a forward whose backward cannot run, CONFIG["inference_key_precision"] first; with
    "bf16" the chunk tokens' key weights are rounded to bf16 too (qk . kw, qk split). A backward needs these logits
    near fp32-exact: with the key state so rounded the log_alpha gradient (a cancellation) erred 100x more (NOTES.md
    session 30)."""
    name = None if training else CONFIG["inference_key_precision"]
    return product_precision(name or CONFIG["slot_precision"], dtype)


def keeps_exact_output(dtype):
    """Whether a training forward on `dtype` inputs can keep its output to fp32 accuracy for the backward's delta
    (CONFIG["delta_from_output"]): not with single-pass TF32 P.V products, which round v to 10 mantissa bits (the
    slot_bias gradient, a cancellation, then missed 5e-3 in 8 of 20 runs at T=63, w=1; NOTES.md session 22)."""
    return CONFIG["delta_from_output"] and value_precision(dtype) != "tf32"


class Prepared:
    """Contiguous inputs and the per-sequence scalars every kernel needs."""

    def __init__(self, q, k, v, q_rope, k_rope, log_alpha, window, attention_mask, slot_bias, training=False):
        self.B, self.T, self.HQ, self.D = q.shape
        self.H, self.M, self.DV = k.shape[2], log_alpha.shape[-1], v.shape[-1]
        self.G = self.HQ // self.H
        self.q, self.k, self.v = q.contiguous(), k.contiguous(), v.contiguous()
        self.q_rope, self.k_rope = q_rope.contiguous(), k_rope.contiguous()
        self.log_alpha = log_alpha.contiguous()
        self.W = self.T if window is None else int(window)
        dev = q.device
        if attention_mask is None:  # every token real: the first real one is 0 (no launches: cached fills)
            self.mask = None if CONFIG["maskless"] else constant((self.B, self.T), 1, torch.int32, dev)
            self.first = constant((self.B,), 0, torch.int32, dev)
        else:
            self.mask = attention_mask[:, -self.T:].to(torch.int32).contiguous()
            has_real = self.mask.bool().any(1)
            first = self.mask.to(torch.int8).argmax(1).to(torch.int32)
            self.first = torch.where(has_real, first, torch.full_like(first, 2**30)).contiguous()
        # in its own dtype (the kernels read it as fp32): a model's bf16 parameter costs no cast here nor its backward
        self.bias = constant((self.HQ,), 0.0, torch.float32, dev) if slot_bias is None else slot_bias.contiguous()
        self.prec = dot_precision(q.dtype)
        self.training = training  # whether a backward can run
        # read once: the backward uses the forward's chunking
        self.cs = (CONFIG["train_chunk"] or inference_chunk(self.G)) if training else inference_chunk(self.G)
        self.nch = cdiv(self.T, self.cs)

    TENSORS = ("q", "k", "v", "q_rope", "k_rope", "log_alpha", "mask", "first", "bias")

    def tensors(self):
        """The tensors it holds, in TENSORS order (for `ctx.save_for_backward`)."""
        return tuple(getattr(self, name) for name in self.TENSORS)

    def with_tensors(self, tensors):
        """A copy holding `tensors` (TENSORS order; None to keep none, e.g. on an autograd ctx)."""
        other = copy.copy(self)
        for name, tensor in zip(self.TENSORS, tensors, strict=True):
            setattr(other, name, tensor)
        return other


def scan_tile(M, DX, rows):
    """[slots x columns] tile of one program of the one-pass scans over chunks (more programs = more loads in
    flight): CONFIG["scan_tile"], else `rows` x 64."""
    bm, bd = CONFIG["scan_tile"] or (rows, 64)
    return min(M, bm), min(bd, next_power_of_2(DX))


def chained_scan(bin_, dec, out, x0=None, reverse=False):
    """`chained_chunk_scan` at CONFIG's segment and `scan_slice` (the forward's state scan, the backward's reverse
    scan)."""
    M, X = out.shape[-2], out.shape[-1]
    segment = CONFIG["scan_segment"]
    return chained_chunk_scan(bin_, dec, out, segment, scan_slice(M, X, segment), x0=x0, reverse=reverse,
                              fast=CONFIG["fast_launch"])


def scan_slice(M, DX, segment):
    """Slots of the [M, DX] state per program of the chained scans of `segment`-chunk segments: CONFIG["scan_block"]
    elements over the segment's chunks and the columns (both rounded up to powers of two), at least one, at most M
    rounded up."""
    per_slot = next_power_of_2(segment) * next_power_of_2(DX)
    return min(max(CONFIG["scan_block"] // per_slot, 1), next_power_of_2(M))


def update_columns(M, DX):
    """State columns per program of the chunk update: CONFIG["update_block"] elements over the M slots (rounded up to
    a power of two), at least 16 (the smallest product tile), at most DX rounded up."""
    return min(max(CONFIG["update_block"] // next_power_of_2(M), 16), next_power_of_2(DX))


def slot_states(xs, log_alpha, mask, W, nch, initial=None, return_decay=False, *, chunk):
    """Slot states before each stream chunk of `chunk` tokens (nch = T / chunk rounded up), and the final ones, of
    the S inputs `xs` ([B, T, H, DX] each, one layout: S = 2 runs the key and the value states in one set of
    launches): [S, B, H, nch + 1, M, DX] fp32, from `initial` [S, B, H, M, DX] (or zero), and with `return_decay`
    the chunk decays [B, H, nch, M].

    Two steps: every chunk's own update in parallel, then a short elementwise scan over chunks."""
    x = xs[0]
    B, T, H, DX = x.shape
    S, M = len(xs), log_alpha.shape[-1]
    assert all(y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous() for y in xs)  # (the kernel's strides)
    out = alloc(S, B, H, nch + 1, M, DX, dtype=torch.float32, device=x.device)
    dec = torch.empty(B, H, nch, M, dtype=torch.float32, device=x.device)
    BD = update_columns(M, DX)
    launch(
        "chunk_update", _chunk_update_kernel, (nch, B * H, S * cdiv(DX, BD)),
        x, xs[-1], log_alpha, mask, out, dec, x.stride(0), log_alpha.stride(0),
        T, W, nch, H=H, M=M, DX=DX, CSZ=chunk, BD=BD, PREC=slot_precision(x.dtype),
        ZERO_FIRST=initial is None,
        num_warps=4,
    )
    s0 = initial.contiguous().float() if initial is not None else out
    if CONFIG["scan_segment"]:  # chained segments (chunk_scan.py)
        if initial is not None:
            out[:, :, :, 0] = s0
        flat = out.view(S * B * H, nch + 1, M, DX)
        chained_scan(flat, dec.view(B * H, nch, M), flat, x0=None if initial is None else s0.view(S * B * H, M, DX))
        launched("chained state_scan")
    else:
        BM, BDS = scan_tile(M, DX, 16)
        launch(
            "state_scan", _state_scan_kernel, ((M // BM) * cdiv(DX, BDS), S * B * H),
            out, dec, s0, nch, B * H, M=M, DX=DX, BM=BM, BD=BDS, HAS_S0=initial is not None, num_warps=4,
            num_stages=3,
        )
    return (out, dec) if return_decay else out


def _walk_segments(xs, log_alpha, mask, W, nch, segment, chunk, local=None, dcum=None, ends=None, dseg=None,
                   dec=None, start=None):
    """One launch of `_segment_update_kernel` over the S inputs `xs` (one layout), storing what is not None."""
    x = xs[0]
    B, T, H, DX = x.shape
    M = log_alpha.shape[-1]
    assert all(y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous() for y in xs)  # (the kernel's strides)
    BD = update_columns(M, DX)
    BM = min(M, CONFIG["segment_update_slots"] or M)
    assert M % BM == 0, "the segment update's slot blocks must divide the slots"
    launch(
        "segment_update", _segment_update_kernel, (cdiv(nch, segment) * (M // BM), B * H, len(xs) * cdiv(DX, BD)),
        x, xs[-1], log_alpha, mask, local, dcum, ends, dseg, dec, start, x.stride(0), log_alpha.stride(0),
        T, W, nch, cdiv(nch, segment), H=H, M=M, DX=DX, CSZ=chunk, BD=BD, PREC=slot_precision(x.dtype), K=segment,
        BM=BM, ZERO_FIRST=start is None, PREFETCH=CONFIG["segment_prefetch"], num_warps=4,
    )


def _segment_ends(xs, log_alpha, mask, W, nch, initial, chunk, segment, **stored):
    """The walk over segments (`_walk_segments`, storing `stored` too), then the chained scan of its segments' local
    ends into the states before each segment: carries [S, B, H, nseg + 1, M, DX] (the last: the final state)."""
    x = xs[0]
    B, T, H, DX = x.shape
    S, M = len(xs), log_alpha.shape[-1]
    nseg = cdiv(nch, segment)
    carries = alloc(S, B, H, nseg + 1, M, DX, dtype=torch.float32, device=x.device)
    dseg = torch.empty(B, H, nseg, M, dtype=torch.float32, device=x.device)
    _walk_segments(xs, log_alpha, mask, W, nch, segment, chunk, ends=carries, dseg=dseg, **stored)
    flat = carries.view(S * B * H, nseg + 1, M, DX)
    if initial is not None:
        carries[:, :, :, 0] = initial
    chained_scan(flat, dseg.view(B * H, nseg, M), flat,
                 x0=None if initial is None else initial.contiguous().float().view(S * B * H, M, DX))
    launched("chained carry scan")
    return carries


def local_slot_states(xs, log_alpha, mask, W, nch, initial=None, *, chunk, segment):
    """The slot states of `slot_states` in the segment-local form (`_segment_update_kernel`): (local [S, B, H, nch + 1,
    M, DX], carries [S, B, H, nseg + 1, M, DX], dcum [B, H, nch, M]), nseg = nch / segment rounded up: the state
    before chunk c is local[c] + dcum[c] * carries[c // segment], and carries[nseg] is the final state. The carries
    are a chained scan over the segments (`chunk_scan.py`), 1 / segment of the states' bytes."""
    x = xs[0]
    B, T, H, DX = x.shape
    S, M = len(xs), log_alpha.shape[-1]
    local = alloc(S, B, H, nch + 1, M, DX, dtype=torch.float32, device=x.device)
    dcum = alloc(B, H, nch, M, dtype=torch.float32, device=x.device)
    carries = _segment_ends(xs, log_alpha, mask, W, nch, initial, chunk, segment, local=local, dcum=dcum)
    return local, carries, dcum


def walked_slot_states(xs, log_alpha, mask, W, nch, initial=None, *, chunk, segment):
    """(states, dec) of `slot_states` (the states whole) by two walks over segments of `segment` chunks: the first
    stores only each segment's local end (a chained scan of them gives the state before each segment), the second
    starts each segment from that state and stores the whole states. The chunks' updates stay in registers: the
    states cross DRAM once, where `slot_states`' chunk update and chained scan move them three times."""
    x = xs[0]
    B, T, H, DX = x.shape
    S, M = len(xs), log_alpha.shape[-1]
    starts = _segment_ends(xs, log_alpha, mask, W, nch, initial, chunk, segment)
    out = alloc(S, B, H, nch + 1, M, DX, dtype=torch.float32, device=x.device)
    dec = alloc(B, H, nch, M, dtype=torch.float32, device=x.device)
    _walk_segments(xs, log_alpha, mask, W, nch, segment, chunk, local=out, dec=dec, start=starts)
    return out, dec


def _state_inputs(p, initial_keys, initial_values):
    """[(inputs, initial)]: (k, v) in one set of launches when they share a layout (CONFIG["merge_kv_states"]), else
    k and v apart; each with its initial state stacked as the scans take it (None: zero)."""
    carried = initial_keys is not None
    if CONFIG["merge_kv_states"] and p.k.shape == p.v.shape and p.k.dtype == p.v.dtype and p.k.stride() == p.v.stride():
        return [((p.k, p.v), torch.stack([initial_keys, initial_values]) if carried else None)]
    return [((p.k,), initial_keys[None] if carried else None), ((p.v,), initial_values[None] if carried else None)]


def kv_states(p, initial_keys=None, initial_values=None):
    """(Sk, Sv, dec): the key and value slot states of `slot_states` ([B, H, nch + 1, M, D] and [..., DV]) and the
    chunk decays; by `walked_slot_states` where CONFIG["walked_states"] and `state_segment` gives a segment."""
    segment = state_segment(p.nch) if CONFIG["walked_states"] else None
    if segment:
        parts = [walked_slot_states(xs, p.log_alpha, p.mask, p.W, p.nch, initial, chunk=p.cs, segment=segment)
                 for xs, initial in _state_inputs(p, initial_keys, initial_values)]
    else:
        parts = [slot_states(xs, p.log_alpha, p.mask, p.W, p.nch, initial, return_decay=True, chunk=p.cs)
                 for xs, initial in _state_inputs(p, initial_keys, initial_values)]
    states = [state for part, _ in parts for state in part]  # (k, v) of one part or one of each
    return states[0], states[1], parts[0][1]


def local_kv_states(p, segment, initial_keys=None, initial_values=None):
    """(Lk, Lv, Ck, Cv, dcum): the key and value slot states in the segment-local form of `local_slot_states`."""
    parts = [local_slot_states(xs, p.log_alpha, p.mask, p.W, p.nch, initial, chunk=p.cs, segment=segment)
             for xs, initial in _state_inputs(p, initial_keys, initial_values)]
    local = [state for part in parts for state in part[0]]
    carries = [state for part in parts for state in part[1]]
    return local[0], local[1], carries[0], carries[1], parts[0][2]


def inference_chunk(G):
    """Tokens per slot-state chunk of a forward without gradients at G query heads per kv head: CONFIG["chunk"], else
    64 where the fused kernel's query block fills it (G <= 2 at 128 rows), else 32, one query block per chunk or
    fewer: in a 64-token chunk the first 32-token block's [rows, CS] intra-chunk products are half causally masked. At
    G = 4 on the H200 32-token chunks made the forward 1.905 -> 1.815 ms at 32K (0.50 -> 0.48 at 8K, 3.76 -> 3.58
    at 64K; NOTES.md session 22; in session 13, before the chained scans, 2.46 against 2.27); G >= 8 is untimed."""
    if CONFIG["chunk"]:
        return CONFIG["chunk"]
    return 64 if fwd_block(G, 64) >= 64 else 32


def fwd_block(G, cs):
    """Query tokens per program of the fused kernel: CONFIG["fwd_block"], else the largest power of two <= the
    chunk `cs` whose G rows per token fit CONFIG["fwd_rows"] (each program loads the chunk's [M, D] slot states
    and keys once, so larger blocks load them less often)."""
    if CONFIG["fwd_block"]:
        return CONFIG["fwd_block"]
    cq = cs
    while cq > 1 and cq * G > CONFIG["fwd_rows"]:
        cq //= 2
    return cq


def prefetchable(p: Prepared):
    """Whether the kernels can issue L2 prefetches (`_prefetch_rows`) for these inputs: not under Triton's
    interpreter (it has no inline PTX), and only where a key and a value row are powers of two of whole 128-byte
    lines."""
    return os.environ.get("TRITON_INTERPRET") != "1" and all(d >= 64 and not d & (d - 1) for d in (p.D, p.DV))


def fwd_prefetch(p: Prepared, segment):
    """The fused forward's PREFETCH where `prefetchable`: CONFIG["train_fwd_prefetch"] for a training forward,
    CONFIG["fwd_prefetch"] for one with segment-local states (the others, below 8K tokens, lost 0.004 ms per 4K
    forward with it on the H200: NOTES.md session 28); else 0."""
    if not prefetchable(p):
        return 0
    if p.training:
        return CONFIG["train_fwd_prefetch"]
    return CONFIG["fwd_prefetch"] if segment else 0


def fwd_warps(rows, dim):
    """Warps of the fused kernel for a [rows x dim] tile of rows."""
    return 4 if rows * dim < 32 * 128 else CONFIG["num_warps_64"] if rows <= 64 else CONFIG["num_warps_128"]


def forward(p: Prepared, scale, has_slots, initial_keys=None, initial_values=None, filled0=None, keep_logits=False,
            exact_output=False):
    """Returns o [B, T, HQ, DV], lse [B, T, HQ] fp32 (natural log; None where no backward can run), with slots what
    the slot backward can reuse: (Sk, Sv, dec, logits), the slot states, the chunk decays and (with `keep_logits` and
    CONFIG["save_logits"], else None) the scaled slot logits before the bias [B, T, HQ, M] fp32; and o's rounding
    residual: with `exact_output` and bf16/fp16 inputs, o with it (`_with_residual`) is the fp32 output formed from
    unrounded weights (else None). Without `keep_logits` the states take the segment-local form where `state_segment`
    gives a segment (`local_slot_states`), and then (Ck, Cv, None, None) come back: the states before each segment.
    Either way [:, :, -1] of the first two is the final state."""
    B, T, HQ, D, H, M, DV, G = p.B, p.T, p.HQ, p.D, p.H, p.M, p.DV, p.G
    dev = p.q.device
    o = alloc(B, T, HQ, DV, dtype=p.q.dtype, device=dev)
    lse = alloc(B, T, HQ, dtype=torch.float32, device=dev) if p.training else None
    has_window = p.W > 0
    if filled0 is None:
        filled0 = constant((B,), 0, torch.int32, dev)
    segment = state_segment(p.nch) if has_slots and not keep_logits else None
    ck = cv = dcum = None
    if segment:
        sk, sv, ck, cv, dcum = local_kv_states(p, segment, initial_keys, initial_values)
    elif has_slots:
        sk, sv, dec = kv_states(p, initial_keys, initial_values)
    else:
        sk = sv = torch.empty(1, dtype=torch.float32, device=dev)
    store_logits = has_slots and keep_logits and CONFIG["save_logits"]
    logits = alloc(B, T, HQ, M, dtype=torch.float32, device=dev) if store_logits else None
    residual = None
    if exact_output and o.dtype != torch.float32:
        residual = alloc(B, T, HQ, DV, dtype=torch.int8 if CONFIG["int8_residual"] else o.dtype, device=dev)
    cq = fwd_block(G, p.cs)
    assert p.cs % cq == 0, "the fused forward's query blocks must divide the chunk"
    BR = max(16, next_power_of_2(cq * G))
    BN = 64 if BR <= 64 else 32
    grid = (cdiv(T, cq), B * H)
    warps = fwd_warps(BR, max(D, DV))
    launch(
        "fused forward", _fwd_kernel, grid,
        p.q, p.k, p.v, p.q_rope, p.k_rope, p.log_alpha, p.mask, p.first, filled0.to(torch.int32).contiguous(),
        p.bias, sk, sv, ck, cv, dcum, o, residual, lse, logits, *batch_strides(p, o),
        T, p.W, p.nch, cdiv(p.nch, segment or 1), float(scale),
        HQ=HQ, H=H, GQ=G, D=D, DV=DV, M=M, MT=max(M, CONFIG["fwd_min_slot_tile"]), CQB=cq, CSZ=p.cs, BR=BR, BN=BN,
        HAS_WINDOW=has_window, HAS_SLOTS=has_slots, PREC=p.prec, SPREC=slot_precision(p.q.dtype),
        VPREC=value_precision(p.q.dtype, p.training), KPREC=key_precision(p.q.dtype, p.training), BDS=min(64, D),
        LIMIT=CONFIG["block_factor_limit"],
        SLOTS_FIRST=CONFIG["fwd_slots_first"], STORE_LOGITS=store_logits, KSEG=segment or 1,
        PREFETCH=fwd_prefetch(p, segment), WHOLE_CHUNK_SPLIT=CONFIG["fwd_whole_chunk_split"],
        FACTORED_DECAY=CONFIG["factored_carry_decay"], DECAYS_LATE=CONFIG["fwd_decays_late"],
        num_warps=warps, num_stages=CONFIG["num_stages"],
    )
    if not has_slots:
        return o, lse, None, residual
    return o, lse, (ck, cv, None, None) if segment else (sk, sv, dec, logits), residual
