"""Triton kernels for the slot states before each chunk of the slot stream (the fused forward reads them).

Stream chunk c holds stream positions c * CS .. c * CS + CS - 1, i.e. tokens j = u - W (the window shifts the slot
stream). The key and the value states are two streams of one layout, formed in one set of launches: state row r of
the [2 x B x H] rows takes the gates of row r % (B x H).

Two ways, by length (`settings.state_segment`):
- short sequences (`slot_states`): every chunk's own update in parallel (`_chunk_update_kernel`), then a chained
  scan over the chunks (`chunk_scan.py`);
- long ones, by walks over segments of chunks (`_segment_update_kernel`: one program walks a segment's chunks, the
  chunks' updates stay in registers). A forward whose backward follows keeps every state: a first walk stores each
  segment's end, a chained scan of the ends gives each segment's start, a second walk stores the states
  (`walked_slot_states`). A forward without a backward keeps them segment-local (`local_slot_states`): the walk
  stores the states from zero at each segment's start and the fused kernel adds the carried segment start as it
  loads a state. Either way the states cross DRAM once, where the chunk update and a scan over every chunk move them
  three times.
"""

import torch
import triton
import triton.language as tl

from ...utils.launch import cdiv, launch, next_power_of_2
from ...utils.products import dot_xb, product_precision
from .chunk_scan import chained_chunk_scan
from .rows import real
from .settings import state_segment
from .slot_weights import chunk_cumsum

# the fp32 products of the state updates: three bf16 MMAs on hi/lo splits (ops/utils/products.py)
STATE_PRECISION = "bf16x3"


@triton.jit
def _update_columns(DX: tl.constexpr, BD: tl.constexpr):
    """An update program's stream (0: X, 1: X2: program axis 2 runs over X's column blocks, then X2's), state columns
    offs_d and their mask."""
    NDB: tl.constexpr = (DX + BD - 1) // BD
    offs_d = (tl.program_id(2) % NDB) * BD + tl.arange(0, BD)
    return tl.program_id(2) // NDB, offs_d, offs_d < DX


@triton.jit
def _chunk_inputs(X, X2, G, MASK, stream, b, h, offs_m, offs_d, dmask, c, more, sx_b, sg_b, T, W,
                  H: tl.constexpr, M: tl.constexpr, DX: tl.constexpr, CSZ: tl.constexpr):
    """What stream chunk c's own update reads: its gates g [CS, M] (as loaded), its inputs x [CS, BD] (columns offs_d
    of X, or X2 for stream 1) and which of its tokens are real, jr [CS]; none where `more` is false (an empty
    chunk)."""
    sx_t, sx_h, sg_t, sg_h = H * DX, DX, H * M, M  # contiguous layouts (as `rows.token_strides`)
    j = c * CSZ - W + tl.arange(0, CSZ)
    jv = (j >= 0) & (j < T - W) & more
    jr = real(MASK, b, T, j, jv)
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
    """A chunk's own update of the state from its `_chunk_inputs`, sum_j s_j exp(a_last - a_j) (x) x_j [M, BD] (only
    factors <= 1: safe for any gate), and its decay exp(a_last) [M]. An empty chunk: zero, and decay 1."""
    a = chunk_cumsum(g, CSZ)
    g = g.to(tl.float32)
    a_last = tl.sum(g, axis=0)
    wgt = tl.where(jr[:, None], (1.0 - tl.exp(g)) * tl.exp(a_last[None, :] - a), 0.0)
    return dot_xb(tl.trans(wgt), x.to(tl.float32), PREC), tl.exp(a_last)  # x: upcast inputs, exact in the split


@triton.jit
def _chunk_update_kernel(
    X, X2, G, MASK, U, DEC,
    sx_b, sg_b, T, W, NCH,
    H: tl.constexpr, M: tl.constexpr, DX: tl.constexpr, CSZ: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, ZERO_FIRST: tl.constexpr,
):
    """Per stream chunk c (in parallel): U[c+1] = its own update, DEC[c] = its decay, and with ZERO_FIRST the zero
    state before chunk 0 in U[0]. Program axis 2 runs over the column blocks of X, then of X2 (whose states follow
    X's in U)."""
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    stream, offs_d, dmask = _update_columns(DX, BD)
    g, x, jr = _chunk_inputs(X, X2, G, MASK, stream, pid_bh // H, pid_bh % H, tl.arange(0, M), offs_d, dmask, c,
                             True, sx_b, sg_b, T, W, H, M, DX, CSZ)
    upd, dec = _own_update(g, x, jr, CSZ, PREC)
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
    PREC: tl.constexpr, K: tl.constexpr, ZERO_FIRST: tl.constexpr,
):
    """Per segment of K stream chunks (program axis 0; axes 1 and 2 as `_chunk_update_kernel`'s), its chunks in
    order: LOCAL[c] = the state before chunk c from zero at the segment's start, DCUM[c] = the decay from the
    segment's start to chunk c; the state after its last chunk in ENDS[segment + 1] and its whole decay in
    DSEG[segment] (with ZERO_FIRST a zero ENDS[0]); each chunk's own decay in DEC[c] (for the reverse scan). Each of
    these may be None (not stored). With START (the states before each segment, [rows, NSEG + 1, M, DX]) the walk
    starts from the segment's state instead of zero, so LOCAL gets the whole states, and the last segment also stores
    the final one, LOCAL[NCH]. Each step loads the next chunk's inputs before forming its own update, so the loads'
    latency overlaps the products (the walk is one chain of steps per program)."""
    seg = tl.program_id(0)
    pid_bh = tl.program_id(1)
    stream, offs_d, dmask = _update_columns(DX, BD)
    row = (stream * tl.num_programs(1) + pid_bh).to(tl.int64)
    offs_m = tl.arange(0, M)
    tile = offs_m[:, None] * DX + offs_d[None, :]
    if START is not None:
        state = tl.load(START + (row * (NSEG + 1) + seg) * M * DX + tile, mask=dmask[None, :], other=0.0)
    else:
        state = tl.zeros([M, BD], dtype=tl.float32)
    dcum = tl.full([M], 1.0, dtype=tl.float32)
    b, h = pid_bh // H, pid_bh % H
    g, x, jr = _chunk_inputs(X, X2, G, MASK, stream, b, h, offs_m, offs_d, dmask, seg * K, True, sx_b, sg_b, T, W, H,
                             M, DX, CSZ)
    for i in range(K):
        c = seg * K + i
        inside = (c + 0 * offs_m) < NCH  # (a vector mask: the interpreter lacks scalar ones)
        if LOCAL is not None:
            tl.store(LOCAL + (row * (NCH + 1) + c) * M * DX + tile, state, mask=inside[:, None] & dmask[None, :])
        if DCUM is not None:
            if tl.program_id(2) == 0:
                tl.store(DCUM + (pid_bh.to(tl.int64) * NCH + c) * M + offs_m, dcum, mask=inside)
        g_next, x_next, jr_next = _chunk_inputs(X, X2, G, MASK, stream, b, h, offs_m, offs_d, dmask, c + 1, i + 1 < K,
                                                sx_b, sg_b, T, W, H, M, DX, CSZ)
        upd, dec = _own_update(g, x, jr, CSZ, PREC)
        g, x, jr = g_next, x_next, jr_next
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
                tl.store(ENDS + ends * M * DX + tile, tl.zeros([M, BD], dtype=tl.float32), mask=dmask[None, :])
    if DSEG is not None:
        if tl.program_id(2) == 0:
            tl.store(DSEG + (pid_bh.to(tl.int64) * NSEG + seg) * M + offs_m, dcum)
    if START is not None:  # past its last chunk: the final state
        final = (seg + 0 * offs_m) == NSEG - 1
        tl.store(LOCAL + (row * (NCH + 1) + NCH) * M * DX + tile, state, mask=final[:, None] & dmask[None, :])


def scan_slots(settings, M, DX, segment):
    """Slots of the [M, DX] state per program of the chained scans over `segment`-chunk segments: `scan_elements`
    over the segment's chunks and the columns (both rounded up to powers of two), at least one, at most M rounded
    up."""
    per_slot = next_power_of_2(segment) * next_power_of_2(DX)
    return min(max(settings.forward.scan_elements // per_slot, 1), next_power_of_2(M))


def chained_scan(settings, bin_, dec, out, x0=None, reverse=False):
    """`chunk_scan.chained_chunk_scan` at the settings' segment (the forward's state scans, the backward's reverse
    scan)."""
    M, X = out.shape[-2], out.shape[-1]
    segment = settings.forward.scan_segment
    return chained_chunk_scan(bin_, dec, out, segment, scan_slots(settings, M, X, segment), x0=x0, reverse=reverse)


def _update_columns_per_program(settings, M, DX):
    """State columns per program of the chunk update and the segment walks: `update_elements` over the M slots, at
    least 16 (the smallest product tile), at most DX rounded up."""
    return min(max(settings.forward.update_elements // next_power_of_2(M), 16), next_power_of_2(DX))


def _stream_inputs(p, initial_keys, initial_values):
    """The key and the value inputs (one layout: two streams of one launch) and their initial states stacked as the
    kernels take them, [2, B, H, M, D] fp32 (None: zero)."""
    initial = None
    if initial_keys is not None:
        initial = torch.stack([initial_keys, initial_values]).float().contiguous()
    return (p.k, p.v), initial


def _slot_states(p, xs, initial):
    """The states before each chunk and the final one, [2, B, H, nch + 1, M, D] fp32, and the chunk decays
    [B, H, nch, M]: every chunk's own update in parallel, then a chained scan over the chunks."""
    x = xs[0]
    B, T, H, DX = x.shape
    M, nch = p.M, p.nch
    out = torch.empty(2, B, H, nch + 1, M, DX, dtype=torch.float32, device=x.device)
    dec = torch.empty(B, H, nch, M, dtype=torch.float32, device=x.device)
    BD = _update_columns_per_program(p.settings, M, DX)
    launch(
        _chunk_update_kernel, (nch, B * H, 2 * cdiv(DX, BD)),
        x, xs[1], p.log_alpha, p.mask, out, dec, x.stride(0), p.log_alpha.stride(0), T, p.W, nch,
        H=H, M=M, DX=DX, CSZ=p.cs, BD=BD, PREC=product_precision(STATE_PRECISION, x.dtype),
        ZERO_FIRST=initial is None, num_warps=4,
    )
    if initial is not None:
        out[:, :, :, 0] = initial
    flat = out.view(2 * B * H, nch + 1, M, DX)
    chained_scan(p.settings, flat, dec.view(B * H, nch, M), flat,
                 x0=None if initial is None else initial.view(2 * B * H, M, DX))
    return out, dec


def _walk_segments(p, xs, segment, local=None, dcum=None, ends=None, dseg=None, dec=None, start=None):
    """One launch of `_segment_update_kernel` over the key and value streams, storing what is not None."""
    x = xs[0]
    B, T, H, DX = x.shape
    BD = _update_columns_per_program(p.settings, p.M, DX)
    launch(
        _segment_update_kernel, (cdiv(p.nch, segment), B * H, 2 * cdiv(DX, BD)),
        x, xs[1], p.log_alpha, p.mask, local, dcum, ends, dseg, dec, start, x.stride(0), p.log_alpha.stride(0),
        T, p.W, p.nch, cdiv(p.nch, segment), H=H, M=p.M, DX=DX, CSZ=p.cs, BD=BD,
        PREC=product_precision(STATE_PRECISION, x.dtype), K=segment, ZERO_FIRST=start is None, num_warps=4,
    )


def _segment_starts(p, xs, initial, segment, **stored):
    """The walk over segments (`_walk_segments`, storing `stored` too), then the chained scan of its segments' local
    ends into the states before each segment: [2, B, H, nseg + 1, M, D] (the last: the final state)."""
    x = xs[0]
    B, T, H, DX = x.shape
    M, nseg = p.M, cdiv(p.nch, segment)
    starts = torch.empty(2, B, H, nseg + 1, M, DX, dtype=torch.float32, device=x.device)
    dseg = torch.empty(B, H, nseg, M, dtype=torch.float32, device=x.device)
    _walk_segments(p, xs, segment, ends=starts, dseg=dseg, **stored)
    flat = starts.view(2 * B * H, nseg + 1, M, DX)
    if initial is not None:
        starts[:, :, :, 0] = initial
    chained_scan(p.settings, flat, dseg.view(B * H, nseg, M), flat,
                 x0=None if initial is None else initial.view(2 * B * H, M, DX))
    return starts


def kv_states(p, initial_keys=None, initial_values=None):
    """(Sk, Sv, dec): the key and value states before each chunk and the final one, [B, H, nch + 1, M, D] fp32 each,
    and the chunk decays [B, H, nch, M] (for the backward's reverse scan). Long sequences by two walks over segments
    (the first stores only each segment's end, the second the states from the scanned ends); short ones by
    `_slot_states`."""
    xs, initial = _stream_inputs(p, initial_keys, initial_values)
    segment = state_segment(p.nch, p.settings)
    if segment is None:
        states, dec = _slot_states(p, xs, initial)
    else:
        starts = _segment_starts(p, xs, initial, segment)
        x = xs[0]
        states = torch.empty(2, p.B, p.H, p.nch + 1, p.M, x.shape[-1], dtype=torch.float32, device=x.device)
        dec = torch.empty(p.B, p.H, p.nch, p.M, dtype=torch.float32, device=x.device)
        _walk_segments(p, xs, segment, local=states, dec=dec, start=starts)
    return states[0], states[1], dec


def local_kv_states(p, segment, initial_keys=None, initial_values=None):
    """The key and value states in the segment-local form: (Lk, Lv, Ck, Cv, dcum), the state before chunk c being
    L[c] + dcum[c] * C[c // segment] (C[nseg]: the final state). L [B, H, nch + 1, M, D] and C [B, H, nseg + 1, M, D]
    fp32, dcum [B, H, nch, M]."""
    xs, initial = _stream_inputs(p, initial_keys, initial_values)
    x = xs[0]
    local = torch.empty(2, p.B, p.H, p.nch + 1, p.M, x.shape[-1], dtype=torch.float32, device=x.device)
    dcum = torch.empty(p.B, p.H, p.nch, p.M, dtype=torch.float32, device=x.device)
    starts = _segment_starts(p, xs, initial, segment, local=local, dcum=dcum)
    return local[0], local[1], starts[0], starts[1], dcum
