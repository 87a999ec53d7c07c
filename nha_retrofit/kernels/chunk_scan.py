"""Linear scans over the chunk axis of the slot states: x <- dec[c] * x + b[c], one [M, X] tile per chunk.

The forward needs the state before every chunk (`slot_states`: inclusive, in place over the chunk updates); the
slot backward needs the state gradient after every chunk (`reverse_scan`: exclusive, from the last chunk back).
A scan over n chunks is a chain of n dependent steps (~0.45 us each on the H200: 0.23-0.76 ms at 32K, n = 512,
however many programs run). With `segment` = K the chain is cut into segments of K chunks: each segment scans
from zero in parallel (`_segment_scan_kernel`), then each segment adds the carry from the segments before it,
decayed to each of its chunks (`_segment_fixup_kernel`): about K + n / K dependent steps instead of n, for
twice the memory traffic. `naive_chunk_scan` is the plain PyTorch definition both forms are tested against.
Several state arrays that share their decays (the key and the value states) scan in one launch: program axis 1
runs over all their rows, row r taking the decays of row r % NBH.
"""

import torch
import triton
import triton.language as tl


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
def _tile(M: tl.constexpr, DX: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """The [BM, BD] tile of program axis 0: slot offsets, column mask and element offsets in an [M, DX] state."""
    NDB: tl.constexpr = (DX + BD - 1) // BD
    pid_t = tl.program_id(0)
    offs_m = (pid_t // NDB) * BM + tl.arange(0, BM)
    offs_d = (pid_t % NDB) * BD + tl.arange(0, BD)
    dmask = offs_d < DX
    return offs_m, dmask, offs_m[:, None] * DX + offs_d[None, :], pid_t % NDB == 0


@triton.jit
def _chunk(i, N, REVERSE: tl.constexpr):
    """The chunk of scan step i."""
    if REVERSE:
        return N - 1 - i
    else:
        return i


@triton.jit
def _segment_scan_kernel(BIN, DEC, OUT, END, DPROD, N, NSEG, ROWS, SHIFT, NBH,
                         M: tl.constexpr, DX: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, K: tl.constexpr,
                         REVERSE: tl.constexpr):
    """Per (tile, batch x head, segment s): the scan of steps s*K .. s*K+K-1 from zero into OUT (chunk c of a
    state array at row c + SHIFT of ROWS per head); the segment's end state into END[s] and its decay product
    into DPROD[s]."""
    offs_m, dmask, tile, first_tile = _tile(M, DX, BM, BD)
    pid_bh = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    dec_bh = pid_bh % NBH
    x = tl.zeros([BM, BD], dtype=tl.float32)
    prod = tl.full([BM], 1.0, dtype=tl.float32)
    for i in range(s * K, tl.minimum(s * K + K, N)):
        c = _chunk(i, N, REVERSE)
        row = (pid_bh * ROWS + c + SHIFT) * M * DX
        if REVERSE:  # exclusive: the state after chunk c is what the later chunks sent back
            tl.store(OUT + row + tile, x, mask=dmask[None, :])
        dec = tl.load(DEC + (dec_bh * N + c) * M + offs_m)
        x = dec[:, None] * x + tl.load(BIN + row + tile, mask=dmask[None, :], other=0.0)
        prod = prod * dec
        if not REVERSE:
            tl.store(OUT + row + tile, x, mask=dmask[None, :])
    seg = pid_bh * NSEG + s
    tl.store(END + seg * M * DX + tile, x, mask=dmask[None, :])
    if first_tile:
        tl.store(DPROD + seg * M + offs_m, prod)


@triton.jit
def _segment_fixup_kernel(X0, DEC, OUT, END, DPROD, N, NSEG, ROWS, SHIFT, NBH,
                          M: tl.constexpr, DX: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, K: tl.constexpr,
                          REVERSE: tl.constexpr, HAS_X0: tl.constexpr):
    """Per (tile, batch x head, segment s): the carry into segment s (x0 through the earlier segments' decay
    products and end states), added to each of its chunks decayed by the products of the steps before. Without
    x0, segment 0 has no carry and is not launched."""
    offs_m, dmask, tile, first_tile = _tile(M, DX, BM, BD)
    pid_bh = tl.program_id(1).to(tl.int64)
    if HAS_X0:
        s = tl.program_id(2)
        carry = tl.load(X0 + pid_bh * M * DX + tile, mask=dmask[None, :], other=0.0).to(tl.float32)
    else:
        s = tl.program_id(2) + 1
        carry = tl.zeros([BM, BD], dtype=tl.float32)
    for p in range(0, s):
        seg = pid_bh * NSEG + p
        dprod = tl.load(DPROD + seg * M + offs_m)
        carry = dprod[:, None] * carry + tl.load(END + seg * M * DX + tile, mask=dmask[None, :], other=0.0)
    dec_bh = pid_bh % NBH
    decay = tl.full([BM], 1.0, dtype=tl.float32)
    for i in range(s * K, tl.minimum(s * K + K, N)):
        c = _chunk(i, N, REVERSE)
        row = (pid_bh * ROWS + c + SHIFT) * M * DX
        if not REVERSE:
            decay = decay * tl.load(DEC + (dec_bh * N + c) * M + offs_m)
        out = tl.load(OUT + row + tile, mask=dmask[None, :], other=0.0)
        tl.store(OUT + row + tile, out + decay[:, None] * carry, mask=dmask[None, :])
        if REVERSE:
            decay = decay * tl.load(DEC + (dec_bh * N + c) * M + offs_m)


def segmented_chunk_scan(bin_, dec, out, segment, tile, x0=None, reverse=False):
    """The scan of `naive_chunk_scan` in segments of `segment` chunks, into `out` (may be `bin_`: in place).

    bin_ / out: [S * BH, rows, M, X] fp32 state arrays holding chunk c at row c + rows - n (the forward's states
    have the state before chunk 0 in row 0), S of them sharing dec: [BH, n, M]; x0: [S * BH, M, X] or None (zero);
    tile: the (slots, columns) of one program."""
    nbh, n, M = dec.shape
    BH, rows, X = out.shape[0], out.shape[1], out.shape[-1]
    BM, BD = tile
    nseg = triton.cdiv(n, segment)
    end = torch.empty(BH, nseg, M, X, dtype=torch.float32, device=out.device)
    dprod = torch.empty(BH, nseg, M, dtype=torch.float32, device=out.device)
    ntile = (M // BM) * triton.cdiv(X, BD)
    args = (dec, out, end, dprod, n, nseg, rows, rows - n, nbh)
    meta = dict(M=M, DX=X, BM=BM, BD=BD, K=segment, REVERSE=reverse, num_warps=4)
    _segment_scan_kernel[(ntile, BH, nseg)](bin_, *args, **meta)
    has_x0 = x0 is not None
    if nseg > 1 or has_x0:
        _segment_fixup_kernel[(ntile, BH, nseg - 1 + has_x0)](x0 if has_x0 else out, *args, HAS_X0=has_x0, **meta)
    return out
