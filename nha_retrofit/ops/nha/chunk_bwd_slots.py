"""Triton backward of the slot half of NHA, fed the joint log-sum-exp L and delta.

Stream index u = query position; the slot stream holds token u - W at position u (the shift), and query u
reads the slot state after stream positions 0..u (inclusive gated-slot read). With A the cumulative (masked)
log gate of the stream, s = 1 - alpha the write weight, l the slot logits, P = exp(l - L):
    dP[u,i] = dO_u . Sv_u[i],   dl = P * (dP - delta),
    dSk_u = scale * sum_g dl[u,g] (x) q[u,g],   dSv_u = sum_g P[u,g] (x) dO[u,g],
    dq_u = scale * sum_i dl[u,i] Sk_u[i],
    dk_j = sum_i s_j[i] dK~_j[i],   dK~_j = sum_{u >= j} exp(A_u - A_j) dSk_u   (likewise dv),
    d/dA_n = <dSk_n, Sk_n> + <dSv_n, Sv_n> - s_n (<dK~_n, k_n> + <dV~_n, v_n>),
    dlog_alpha_j = sum_{n >= j} d/dA_n - alpha_j (<dK~_j, k_j> + <dV~_j, v_j>)   (real tokens only).

The rows and keys_da kernels take their D-sized products in column passes of BD = 64; the state_grad and keys
kernels take CONFIG["slot_bwd_columns"] columns per program (128 by default: all of D = 128 in one program).

- `_rows_kernel`, per (BQ-token query block, kv head), rows = BQ tokens x G heads, as the forward: recomputes
  the slot logits and dP = dO . Sv_u, completes the exact delta = sum P * dP unless it is already whole (the
  window share comes from `window_bwd.window_delta`; `window_bwd.window_dq` forms all of it from an exact
  forward output), forms dl = P (dP - delta), and writes dq (slot part), the slot_bias gradient
  per row, E[u] = sum_g (dl * l + P * dP) (summed over a token's G heads by a 0/1 selection product) and the row
  weights Wk = scale dl, Wv = P. No atomics.
- `_state_grad_kernel`, per (stream chunk, kv head, BD columns of the key side, then of the value side:
  both in one launch when they share a shape): the chunk's contribution to the gradient w.r.t. the state before
  it, (Wk exp(a_u))^T q and (Wv exp(a_u))^T dO, over its row blocks.
- `reverse_scan` (`_rev_scan_kernel` or the chained scan of `chunk_scan.py`): the state gradients after each
  chunk (for the keys and the values in one launch set with CONFIG["merge_kv_states"]).
- `_keys_kernel`, per (chunk, kv head, BD columns): dk and dv = to_end R + sum over the chunk's query blocks of
  (slot-weighted W, causal)^T Y, both in one pass; it also zeroes its share of the last W tokens' rows.
- `_keys_da_kernel`, per (chunk, kv head, slot block): d/dA = E - s (<dK~, k> + <dV~, v>), its chunk sum, and the
  alpha term; `_alpha_grad_kernel` finishes dlog_alpha (per chunk a reverse cumsum plus the later chunks' sum,
  shifted by the window, masked, transposed, zero on padding and on the last W tokens).
- `_keys_merged_kernel` (the default where it applies: D == DV, all D columns and all M slots in one program):
  the keys and keys_da kernels' work in one program per (chunk, kv head), each row block's weights and rows loaded
  once for both; given the window half's dv (`dv_window`), it stores the sum of both halves.
Slot weights inside a chunk are factored around each query block's start (`chunk_fwd._block_split`): tokens
before the block take exp(a_u - a_ref) exp(a_ref - a_j), both <= 1, and so do the block's own tokens unless the
block decays a slot by more than CONFIG["block_factor_limit"] nats; then they get direct weights
exp(a_u - a_j) s_j (loops of BQ rank-1 updates, as the forward), so no decay overflows. The row weights Wk, Wv
are stored without decay factors.
fp32 products use CONFIG["slot_bwd_precision"] (products.py; three bf16 MMAs on hi/lo splits by default,
3xTF32 below 64 slots: plain TF32 broke the log_alpha gradient, NOTES.md v2), with one MMA fewer where one
operand is an upcast input (`dot_xa`, `dot_xb`). Products of two bf16/fp16 operands are exact in fp32
accumulation. The products whose only use is dq, dk or dv take `gradient_precision` (CONFIG["slot_bwd_grad_precision"]).
"""

import torch
import triton
import triton.language as tl

from .chunk_fwd import (_block_split, _block_split_bounds, _block_split_cumsum, _prefix_sums, _carried_block_split,
                        _block_token_decay,
                        _chunk_products, _chunk_cumsum, _cumsum_row, _prefetch_rows, _query_rows, _real, _row_decay,
                        _row_stats, _token_strides, alloc, batch_strides, chained_scan, kv_states, launch, launched,
                        prefetchable, scan_tile)
from .settings import CONFIG
from .launch import cdiv, next_power_of_2
from .products import dot_f32, dot_xa, dot_xb, product_precision

BD = 64  # columns per pass over D
BQ = 16  # query tokens per row block (CONFIG["slot_bwd_block"] overrides; 16 was ~1.1 ms faster than 8 per 32K
# step on the H200, 32 ~3.6 ms slower)


@triton.jit
def _rev_scan_kernel(CONT, DEC, R, NCH, NBH, M: tl.constexpr, DX: tl.constexpr, BM: tl.constexpr,
                     BD: tl.constexpr):
    """R[c] = sum_{c' > c} (prod_{c < c'' < c'} dec[c'']) * cont[c']: gradient w.r.t. the state after chunk c
    (row r of CONT with the decays of row r % NBH of DEC)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    NDB: tl.constexpr = (DX + BD - 1) // BD
    offs_m = (pid_t // NDB) * BM + tl.arange(0, BM)
    offs_d = (pid_t % NDB) * BD + tl.arange(0, BD)
    dmask = offs_d < DX
    tile = offs_m[:, None] * DX + offs_d[None, :]
    base = pid_bh.to(tl.int64) * NCH
    dec_base = (pid_bh % NBH).to(tl.int64) * NCH
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for i in range(NCH):
        c = NCH - 1 - i
        tl.store(R + (base + c) * M * DX + tile, acc, mask=dmask[None, :])
        dec = tl.load(DEC + (dec_base + c) * M + offs_m)
        cont = tl.load(CONT + (base + c) * M * DX + tile, mask=dmask[None, :], other=0.0)
        acc = dec[:, None] * acc + cont


def reverse_scan(cont, dec):
    """cont [..., B, H, n, M, X] (several state gradients sharing dec), dec [B, H, n, M] -> R of cont's shape (see
    the kernel)."""
    B, H, n, M = dec.shape
    X = cont.shape[-1]
    rows = cont.numel() // (n * M * X)
    cont, dec = cont.contiguous(), dec.contiguous()
    out = alloc(*cont.shape, dtype=cont.dtype, device=cont.device)
    if CONFIG["scan_segment"]:  # chained segments (chunk_scan.py)
        flat = (rows, n, M, X)
        chained_scan(cont.view(flat), dec.view(B * H, n, M), out.view(flat), reverse=True)
        launched("chained rev_scan")
        return out
    BM, BD = scan_tile(M, X, M)
    launch("rev_scan", _rev_scan_kernel, ((M // BM) * cdiv(X, BD), rows), cont, dec, out, n, B * H, M=M, DX=X,
           BM=BM, BD=BD, num_warps=4, num_stages=3)
    return out


@triton.jit
def _chunk_gates(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, limit_u,
                 M: tl.constexpr, CSZ: tl.constexpr):
    """Masked gates of the stream chunk starting at cs0 (positions u < limit_u), their cumsum, validity."""
    offs_u = tl.arange(0, CSZ)
    u = cs0 + offs_u
    j = u - W
    jv = (j >= 0) & (j < T - W) & (u < limit_u)
    jr = _real(MASK, b, T, j, jv)
    offs_m = tl.arange(0, M)
    g = tl.load(G + b * sg_b + j[:, None].to(tl.int64) * sg_t + h * sg_h + offs_m[None, :],
                mask=jr[:, None], other=0.0)
    return g.to(tl.float32), _chunk_cumsum(g, CSZ), j, jr


@triton.jit
def _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H: tl.constexpr, M: tl.constexpr, CSZ: tl.constexpr,
                BD: tl.constexpr, REST_PRODUCT: tl.constexpr):
    """A keys-side program (axes: stream chunk c, batch x kv head, BD columns): its gates g, their cumsum a,
    positions j and which are real tokens jr, write weights s of those, to_end = s exp(a_end - a) (the decay to its
    end) and a_end - a [CS, M], the gates after each token. With REST_PRODUCT (and tiles of 64 slots or more, as
    `_prefix_sums`) a_end - a is one product of the gates with a strictly upper 0/1 matrix, not the gates' sum over
    the chunk's tokens (a reduction across the warps) less a."""
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    d0 = tl.program_id(2) * BD
    b = pid_bh // H
    h = pid_bh % H
    cs0 = c * CSZ
    offs_c = d0 + tl.arange(0, BD)
    g, a, j, jr = _chunk_gates(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, cs0 + CSZ, M, CSZ)
    if REST_PRODUCT and M >= 64:
        offs_u = tl.arange(0, CSZ)
        rest = _prefix_sums(g.to(G.dtype.element_ty), offs_u[None, :] > offs_u[:, None])  # (g: exact in G's dtype)
    else:
        rest = tl.sum(g, 0)[None, :] - a
    s = tl.where(jr[:, None], 1.0 - tl.exp(g), 0.0)
    to_end = s * tl.exp(rest)
    return c, pid_bh, b, h, cs0, offs_c, g, a, j, jr, s, to_end, rest


@triton.jit
def _row_lanes(h, GQ: tl.constexpr, CQB: tl.constexpr, BR: tl.constexpr):
    """The BR rows of a CQB-token query block: token r // GQ, query head hq, whether the row exists."""
    r = tl.arange(0, BR)
    return r, r // GQ, h * GQ + r % GQ, r < CQB * GQ


@triton.jit
def _row_block(G, MASK, WA, WB, b, h, sg_b, sg_t, sg_h, a, s, a_ref, factored, cs0, off, r, tok, hq, rok, T, W,
               A_IN, HQ: tl.constexpr, GQ: tl.constexpr, M: tl.constexpr, CQB: tl.constexpr, CSZ: tl.constexpr,
               A: tl.constexpr, B: tl.constexpr, ROW_SCAN: tl.constexpr):
    """Query block at chunk offset off, split by the caller (`_block_split`: a_ref, the gates before it, and
    which tokens are `factored`): tokens t, valid rows tv, the causal mask [rows, CS], the factored weights kw,
    the rows' [rows, M] weights from WA (if A) and WB (if B; zeros where not loaded) and their decays a_in from
    the block start (A_IN where the caller has them, else `_row_decay`, by a scan with ROW_SCAN)."""
    offs_u = tl.arange(0, CSZ)
    t = cs0 + off + tok
    tv = rok & (t < T)
    causal = (offs_u[None, :] <= (off + tok)[:, None]) & tv[:, None]
    kw = tl.where(factored[:, None], s * tl.exp(a_ref[None, :] - a), 0.0)
    w_off = ((b * T + t).to(tl.int64) * HQ + hq)[:, None] * M + tl.arange(0, M)[None, :]
    wa = tl.zeros(w_off.shape, dtype=tl.float32)
    wb = tl.zeros(w_off.shape, dtype=tl.float32)
    if A:
        wa = tl.load(WA + w_off, mask=tv[:, None], other=0.0)
    if B:
        wb = tl.load(WB + w_off, mask=tv[:, None], other=0.0)
    if A_IN is not None:
        a_in = A_IN
    else:
        a_in = _row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off, tok, tv & (r % GQ == 0), T, W, CQB, M, M,
                          ROW_SCAN)
    return t, tv, causal, kw, wa, wb, a_in


@triton.jit
def _shared_row_decays(BCUM, pid_bh, L, cs0, off, tok, rok, T, M: tl.constexpr, CQB: tl.constexpr):
    """The row decays of the rows or the state_grad kernel for the block at chunk offset off (BCUM [B * H, L, M]:
    each token's decay from its block's start; CONFIG["shared_row_decays"]): the block's own decay a_blk [M], to its
    last token before T (the gates after it are zeros; zeros for a block after the stream's end), and its rows'
    [rows, M], a_blk in the rows after the stream's end, as a scan over the block gives them (so exp(a_in - a_j)
    stays <= 1 there)."""
    offs_m = tl.arange(0, M)
    base = pid_bh.to(tl.int64) * L
    end = tl.minimum(cs0 + off + CQB, T) - 1
    a_blk = tl.load(BCUM + (base + end) * M + offs_m, mask=end + 0 * offs_m >= cs0 + off, other=0.0)
    t = cs0 + off + tok
    tv = rok & (t < T)
    # (no `other`: a masked load with other=0.0 compiled to 240 more instructions, NOTES.md session 36)
    rows = tl.load(BCUM + (base + t)[:, None] * M + offs_m[None, :], mask=tv[:, None])
    return a_blk, tl.where(tv[:, None], rows, a_blk[None, :])


@triton.jit
def _store_row_decays(BCUM, a_in, pid_bh, L, t, first_row, M: tl.constexpr):
    """Each token's decay from its row block's start, a_in [rows, M], into BCUM [B * H, L, M] from its first head's
    row (`first_row`), for `_shared_row_decays`."""
    offs = (pid_bh.to(tl.int64) * L + t)[:, None] * M + tl.arange(0, M)[None, :]
    tl.store(BCUM + offs, a_in, mask=first_row[:, None])


@triton.jit
def _block_weights(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, kw, a_in, wa, wb, direct, T, W,
                   M: tl.constexpr, CQB: tl.constexpr, CSZ: tl.constexpr, SPREC: tl.constexpr,
                   A: tl.constexpr, B: tl.constexpr):
    """[rows, CS] slot-weighted row weights (wa kw^T causal for the factored tokens; with `direct`, direct ones
    for the block's own tokens, walked once for both) for wa (if A) and wb (if B)."""
    offs_u = tl.arange(0, CSZ)
    e_in = tl.exp(a_in)
    ba = tl.zeros(causal.shape, dtype=tl.float32)
    bb = tl.zeros(causal.shape, dtype=tl.float32)
    if A:
        ba = tl.where(causal, dot_f32(wa * e_in, tl.trans(kw), SPREC), 0.0)
    if B:
        bb = tl.where(causal, dot_f32(wb * e_in, tl.trans(kw), SPREC), 0.0)
    if direct:
        cum = tl.zeros([M], dtype=tl.float32)
        for jj in range(CQB):
            e_j, s_j, cum = _block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum, a_in,
                                               tok >= jj, M, M)
            col = offs_u[None, :] == off + jj
            if A:
                ba = tl.where(col, tl.sum(wa * e_j * s_j[None, :], 1)[:, None], ba)
            if B:
                bb = tl.where(col, tl.sum(wb * e_j * s_j[None, :], 1)[:, None], bb)
    return ba, bb


@triton.jit
def _key_block(G, MASK, WA, WB, b, h, sg_b, sg_t, sg_h, a, s, a_ref, factored, direct, cs0, off, r, tok, hq, rok, T,
               W, A_IN, HQ: tl.constexpr, GQ: tl.constexpr, M: tl.constexpr, CQB: tl.constexpr, CSZ: tl.constexpr,
               SPREC: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    """A key-side program's query block at chunk offset off, split by the caller (`_block_split`): `_row_block` (WA
    if A, WB if B; the rows' decays A_IN unless None) and their `_block_weights`; returns (t, tv, causal, a_in, wa,
    wb, ba, bb)."""
    t, tv, causal, kw, wa, wb, a_in = _row_block(G, MASK, WA, WB, b, h, sg_b, sg_t, sg_h, a, s, a_ref, factored, cs0,
                                                 off, r, tok, hq, rok, T, W, A_IN, HQ, GQ, M, CQB, CSZ, A, B, True)
    ba, bb = _block_weights(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, kw, a_in, wa, wb, direct, T, W, M,
                            CQB, CSZ, SPREC, A, B)
    return t, tv, causal, a_in, wa, wb, ba, bb


@triton.jit
def _load_rows(Y, b, t, hq, tv, sy_b, sy_t, DX: tl.constexpr, offs_c):
    """Y[b, t, hq, offs_c] of the block's rows (0 where a row is out)."""
    return tl.load(Y + (b * sy_b + t.to(tl.int64) * sy_t + hq * DX)[:, None] + offs_c[None, :], mask=tv[:, None],
                   other=0.0)


@triton.jit
def _store_keys(OUT, acc, b, j, h, so_b, so_t, so_h, offs_c, T, W):
    """OUT[b, j, h, offs_c] = acc for the chunk's positions j in the stream."""
    jv = (j >= 0) & (j < T - W)
    tl.store(OUT + (b * so_b + j.to(tl.int64) * so_t + h * so_h)[:, None] + offs_c[None, :],
             acc.to(OUT.dtype.element_ty), mask=jv[:, None])


@triton.jit
def _store_tail(OUT, SRC, b, h, so_b, so_t, so_h, cols, cs0, T, W, CSZ: tl.constexpr, BC: tl.constexpr):
    """Zeros into OUT[b, j, h, cols] (BC columns) for this chunk's share j = T - W + cs0 + (0 .. CS - 1), j < T, of
    the last W tokens: no stream chunk holds them (no query reads them through the slots), and the T / CS chunks of
    a grid clear all W < T of them. With SRC (not None: the window half's gradient, in OUT's layout) its rows
    instead."""
    jt = T - W + cs0 + tl.arange(0, CSZ)
    rows = (b * so_b + jt.to(tl.int64) * so_t + h * so_h)[:, None] + cols[None, :]
    tail = tl.zeros([CSZ, BC], dtype=tl.float32)
    if SRC is not None:
        tail = tl.load(SRC + rows, mask=(jt < T)[:, None], other=0.0)
    tl.store(OUT + rows, tail.to(OUT.dtype.element_ty), mask=(jt < T)[:, None])


@triton.jit
def _rows_side(X, xrow, Y, yrow, S, st, G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, tv, jr, causal, kw, a_in,
               e_car, direct, T, W, offs_c, DX: tl.constexpr, BD: tl.constexpr, M: tl.constexpr, BR: tl.constexpr,
               CQB: tl.constexpr, CSZ: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr):
    """[rows, M] products of the block's rows of X (q or dO) with the slots they read (state S before the chunk
    and the chunk's tokens of Y, k or v, slot-weighted): the logits before scale, or dP."""
    offs_u = tl.arange(0, CSZ)
    xy, xs = _chunk_products(X, xrow, Y, yrow, S, st, None, 0, None, tv, jr, offs_c, DX, BD, M, M, BR, CSZ, PREC,
                             SPREC)
    out = dot_f32(tl.where(causal, xy, 0.0), kw, SPREC) * tl.exp(a_in) + xs * e_car
    if direct:  # the block's own tokens: direct weights, as the forward
        cum = tl.zeros([M], dtype=tl.float32)
        for jj in range(CQB):
            e_j, s_j, cum = _block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum, a_in,
                                               tok >= jj, M, M)
            out += tl.sum(tl.where(offs_u[None, :] == off + jj, xy, 0.0), 1)[:, None] * e_j * s_j[None, :]
    return out


@triton.jit
def _block_chunk(G, MASK, pid_bh, b, h, t0, r, tok, t, tv, sk_b, sk_t, sk_h, sg_b, sg_t, sg_h, T, W, NCH,
                 GQ: tl.constexpr, M: tl.constexpr, CQB: tl.constexpr, CSZ: tl.constexpr, LIMIT: tl.constexpr,
                 CUMSUM_SPLIT: tl.constexpr):
    """The stream chunk of a query-block program (`_query_rows`): its start cs0, the block's offset in it, the
    positions j (real: jr), the causal mask [rows, CS], the block split (a_ref, direct; from two rows of the
    gates' cumsum with CUMSUM_SPLIT, else two sums of the gates), the factored slot weights kw [CS, M], the rows'
    decays a_in from the block start, the key rows krow and the state index st."""
    c = t0 // CSZ
    cs0 = c * CSZ
    off = t0 - cs0
    g, a, j, jr = _chunk_gates(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, t0 + CQB, M, CSZ)
    causal = tl.arange(0, CSZ)[None, :] <= (off + tok)[:, None]
    if CUMSUM_SPLIT:
        a_ref, factored, direct = _block_split_cumsum(a, off, CQB, CSZ, LIMIT)
    else:
        a_ref, factored, direct = _block_split(g, off, CQB, CSZ, LIMIT)
    kw = tl.where(jr[:, None] & factored[:, None], (1.0 - tl.exp(g)) * tl.exp(a_ref[None, :] - a), 0.0)
    a_in = _row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, t0, tok, tv & (r % GQ == 0), T, W, CQB, M, M, False)
    krow = b * sk_b + j.to(tl.int64) * sk_t + h * sk_h
    st = pid_bh.to(tl.int64) * (NCH + 1) + c
    return cs0, off, j, jr, causal, a_ref, direct, kw, a_in, krow, st


@triton.jit
def _slot_dq(DQ, K, SK, G, MASK, wk, kw, a_in, a_ref, causal, direct, row, krow, st, jr, tv, b, h, sg_b, sg_t, sg_h,
             cs0, off, tok, T, W, D: tl.constexpr, BD: tl.constexpr, M: tl.constexpr, CQB: tl.constexpr,
             CSZ: tl.constexpr, GPREC: tl.constexpr, FACTORED_DECAY: tl.constexpr):
    """dq (slot part) of the block's rows from their weights wk = scale dl: wk e^(a_u) . Sk (the state before the
    chunk) + (wk slot-weighted)[rows, CS] . k (the chunk's tokens), in BD-column passes, products at GPREC.
    FACTORED_DECAY: the carried decay exp(a_in + a_ref) as exp(a_in) exp(a_ref) (CONFIG["factored_carry_decay"])."""
    offs_u = tl.arange(0, CSZ)
    offs_c = tl.arange(0, BD)
    offs_m = tl.arange(0, M)
    wk_in = wk * tl.exp(a_in)
    bk = tl.where(causal, dot_f32(wk_in, tl.trans(kw), GPREC), 0.0)
    if direct:
        cum = tl.zeros([M], dtype=tl.float32)
        for jj in range(CQB):
            e_j, s_j, cum = _block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum, a_in,
                                               tok >= jj, M, M)
            bk = tl.where(offs_u[None, :] == off + jj, tl.sum(wk * e_j * s_j[None, :], 1)[:, None], bk)
    if FACTORED_DECAY:  # (wk e^a_in) e^a_ref, not wk times the rows' e_car, which would then stay live from the
        # kernel's start to here
        wc = wk_in * tl.exp(a_ref)[None, :]
    else:
        wc = wk * tl.exp(a_in + a_ref[None, :])
    for d0 in range(0, D, BD):
        kd = tl.load(K + krow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        skd = tl.load(SK + st * M * D + offs_m[:, None] * D + d0 + offs_c[None, :])
        dq = dot_f32(wc, skd, GPREC) + dot_xb(bk, kd.to(tl.float32), GPREC)
        tl.store(DQ + row[:, None] + d0 + offs_c[None, :], dq.to(DQ.dtype.element_ty), mask=tv[:, None])


@triton.jit
def _rows_kernel(
    Q, K, V, DO, G, MASK, FIRST, BIAS, SK, SV, LSE, DELTA, LOGITS,
    DQ, DB, E, WK, WV, BCUM,
    sq_b, sk_b, sv_b, sg_b, so_b,
    T, W, NCH, L, scale,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, SPREC: tl.constexpr, LIMIT: tl.constexpr, HAS_LOGITS: tl.constexpr,
    DELTA_WHOLE: tl.constexpr, GPREC: tl.constexpr, CUMSUM_SPLIT: tl.constexpr, FACTORED_DECAY: tl.constexpr,
):
    """Per query block (module docstring). DELTA holds sum P * dP (DELTA_WHOLE), or its window share and gets the
    slot share added in place; BT: a power of two >= CQB, the tokens of the E product. With HAS_LOGITS the scaled
    logits are the forward's (LOGITS [B, T, HQ, M]), else they are formed again from q, the state and the chunk's
    keys. Unless BCUM is None it gets each token's decay from the block's start, a_in, for the merged key kernel
    (CONFIG["shared_row_decays"])."""
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = _token_strides(HQ, H, D, DV)
    sg_t, sg_h = H * M, M
    pid_bh, b, h, t0, r, tok, t, tv, hq = _query_rows(T, H, GQ, CQB, BR)
    offs_c = tl.arange(0, BD)
    offs_m = tl.arange(0, M)
    first = tl.load(FIRST + b)
    readable = _real(MASK, b, T, t, tv) & (t - W >= first)
    row = b * sq_b + t.to(tl.int64) * sq_t + hq * D
    orow = b * so_b + t.to(tl.int64) * so_t + hq * DV
    lrow, lse, delta = _row_stats(LSE, DELTA, b, t, hq, tv, T, HQ)
    cs0, off, j, jr, causal, a_ref, direct, kw, a_in, krow, st = _block_chunk(
        G, MASK, pid_bh, b, h, t0, r, tok, t, tv, sk_b, sk_t, sk_h, sg_b, sg_t, sg_h, T, W, NCH, GQ, M, CQB, CSZ, LIMIT,
        CUMSUM_SPLIT)
    if FACTORED_DECAY:  # as the forward's
        e_car = tl.exp(a_in) * tl.exp(a_ref)[None, :]
    else:
        e_car = tl.exp(a_in + a_ref[None, :])
    vrow = b * sv_b + j.to(tl.int64) * sv_t + h * sv_h

    # the scaled logits (the forward's, or formed again) and dP, one side after the other
    if HAS_LOGITS:
        lraw = tl.load(LOGITS + lrow[:, None] * M + offs_m[None, :], mask=tv[:, None], other=0.0)
    else:
        lraw = _rows_side(Q, row, K, krow, SK, st, G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, tv, jr, causal,
                          kw, a_in, e_car, direct, T, W, offs_c, D, BD, M, BR, CQB, CSZ, PREC, SPREC) * scale
    dp = _rows_side(DO, orow, V, vrow, SV, st, G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, tv, jr, causal, kw,
                    a_in, e_car, direct, T, W, offs_c, DV, BD, M, BR, CQB, CSZ, PREC, SPREC)
    bias = tl.load(BIAS + hq, mask=tv, other=0.0).to(tl.float32)
    p = tl.where(readable[:, None], tl.exp(lraw + bias[:, None] - lse[:, None]), 0.0)
    if not DELTA_WHOLE:
        delta += tl.sum(p * dp, 1)  # the window share plus the slot share, kept for the window backward
        tl.store(DELTA + lrow, delta, mask=tv)
    dl = p * (dp - delta[:, None])
    wk = dl * scale

    tl.store(DB + lrow, tl.sum(dl, 1), mask=tv)  # slot_bias gradient per row, summed in PyTorch
    # E per stream position: the sum over a token's G rows, as a 0/1 selection product
    it = tl.arange(0, BT)
    pick = ((tok[None, :] == it[:, None]) & tv[None, :]).to(tl.float32)  # [BT, BR]
    etok = dot_xa(pick, tl.where(tv[:, None], dl * lraw + p * dp, 0.0), SPREC)  # [BT, M]
    te = t0 + it
    e_off = (pid_bh.to(tl.int64) * L + te) * M
    tl.store(E + e_off[:, None] + offs_m[None, :], etok, mask=((it < CQB) & (te < T))[:, None])
    # the row weights of the key passes
    tl.store(WK + lrow[:, None] * M + offs_m[None, :], wk, mask=tv[:, None])
    tl.store(WV + lrow[:, None] * M + offs_m[None, :], p, mask=tv[:, None])
    if BCUM is not None:  # (stored last: its offsets are not live through the kernel)
        _store_row_decays(BCUM, a_in, pid_bh, L, t, tv & (r % GQ == 0), M)

    _slot_dq(DQ, K, SK, G, MASK, wk, kw, a_in, a_ref, causal, direct, row, krow, st, jr, tv, b, h, sg_b, sg_t, sg_h,
             cs0, off, tok, T, W, D, BD, M, CQB, CSZ, GPREC, FACTORED_DECAY)


@triton.jit
def _da_side(Y, yrow, X, xrow, WST, w_off, GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, tv, jr, causal, a_in, a,
             a_ref, factored, direct, T, W, DX: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
             CQB: tl.constexpr, CSZ: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr):
    """A query block's share of one side of UV (q with the chunk's k and Wk, or dO with v and Wv), [CS, BM]:
    `_da_weights` of xy = X Y^T [CS, rows] (formed in BD-column passes, transposed: no fp32 transpose for the
    product) and the rows' weights. The keys_da kernel runs the two sides one after the other, so only one
    [CS, rows] product and one weight tile are live at a time."""
    offs_c = tl.arange(0, BD)
    xy = tl.zeros([CSZ, BR], dtype=tl.float32)
    for d0 in range(0, DX, BD):
        yd = tl.load(Y + yrow[:, None] + d0 + offs_c[None, :], mask=tv[:, None], other=0.0)
        xd = tl.load(X + xrow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        xy += tl.dot(xd, tl.trans(yd), input_precision=PREC)
    w = tl.load(WST + w_off, mask=tv[:, None], other=0.0)
    return _da_weights(xy, w, GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, a_in, a, a_ref, factored,
                       direct, T, W, BM, CQB, CSZ, SPREC)


@triton.jit
def _da_weights(xy, w, GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, a_in, a, a_ref, factored, direct, T,
                W, BM: tl.constexpr, CQB: tl.constexpr, CSZ: tl.constexpr, SPREC: tl.constexpr):
    """sum over the block's rows u >= j of (Y_u . X_j) W_u exp(a_u - a_j), [CS, BM], from xy = X Y^T [CS, rows]
    and the rows' weights w [rows, BM]."""
    offs_u = tl.arange(0, CSZ)
    xy = tl.where(tl.trans(causal), xy, 0.0)
    out = dot_f32(xy, w * tl.exp(a_in), SPREC) * tl.where(factored[:, None], tl.exp(a_ref[None, :] - a), 0.0)
    if direct:  # the block's own tokens
        cum = tl.zeros([BM], dtype=tl.float32)
        for jj in range(CQB):
            e_j, s_j, cum = _block_token_decay(GB, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum, a_in,
                                               tok >= jj, BM, BM)
            row_j = tl.sum(tl.sum(tl.where(offs_u[:, None] == off + jj, xy, 0.0), 0)[:, None] * w * e_j, 0)
            out += tl.where(offs_u[:, None] == off + jj, row_j[None, :], 0.0)
    return out


@triton.jit
def _store_da(E, DA, XA, TOT, uv, g, jr, pid_bh, c, cs0, offs_m, T, L, NCH, M: tl.constexpr, CSZ: tl.constexpr):
    """DA[u] = E[u] - s_u UV[u] and XA[u] = -alpha_u UV[u] for the chunk's stream positions (slots offs_m), and
    the chunk's sum of DA in TOT [B * H, M, NCH], in reverse chunk order (chunk c at NCH - 1 - c: the alpha
    kernel's carries are then a plain cumsum of TOT)."""
    u = cs0 + tl.arange(0, CSZ)
    e_off = (pid_bh.to(tl.int64) * L + u) * M
    e = tl.load(E + e_off[:, None] + offs_m[None, :], mask=(u < T)[:, None], other=0.0)
    s = tl.where(jr[:, None], 1.0 - tl.exp(g), 0.0)
    da = e - s * uv
    tl.store(DA + e_off[:, None] + offs_m[None, :], da)
    tl.store(XA + e_off[:, None] + offs_m[None, :], tl.where(jr[:, None], -tl.exp(g) * uv, 0.0))
    tl.store(TOT + (pid_bh.to(tl.int64) * M + offs_m) * NCH + NCH - 1 - c, tl.sum(da, 0))


@triton.jit
def _keys_da_kernel(
    Q, K, V, DO, G, MASK, WK, WV, E, RK, RV, DA, XA, TOT,
    sq_b, sk_b, sv_b, sg_b, so_b,
    T, W, NCH, L,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
    SPREC: tl.constexpr, BM: tl.constexpr, LIMIT: tl.constexpr,
):
    """DA[u] = E[u] - s_u * UV[u] and XA[u] = -alpha_u * UV[u], UV[u] = <dK~_u, k_u> + <dV~_u, v_u>, and the
    chunk's sum of DA (TOT), for the slots m0 .. m0 + BM - 1 of program axis 2 (every term is per slot: the slot
    blocks are independent).
    The loop over query blocks keeps only the gates' cumsum a live (the blocks' split comes from it, the gates
    are reloaded at the end)."""
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = _token_strides(HQ, H, D, DV)
    sg_t, sg_h = H * M, M
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    m0 = tl.program_id(2) * BM
    b = pid_bh // H
    h = pid_bh % H
    cs0 = c * CSZ
    offs_u = tl.arange(0, CSZ)
    offs_c = tl.arange(0, BD)
    offs_m = m0 + tl.arange(0, BM)  # absolute slot indices (M, all slots, is the row stride of E, DA, WK...)
    GB = G + m0  # the gate helpers read BM slots from here
    _, a, j, jr = _chunk_gates(GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, cs0 + CSZ, BM, CSZ)
    krow = b * sk_b + j.to(tl.int64) * sk_t + h * sk_h
    vrow = b * sv_b + j.to(tl.int64) * sv_t + h * sv_h
    cidx = pid_bh.to(tl.int64) * NCH + c
    uv = tl.zeros([CSZ, BM], dtype=tl.float32)
    for d0 in range(0, D, BD):
        kd = tl.load(K + krow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        rkd = tl.load(RK + cidx * M * D + offs_m[:, None] * D + d0 + offs_c[None, :])
        uv += dot_xa(kd.to(tl.float32), tl.trans(rkd), SPREC)
    for d0 in range(0, DV, BD):
        vd = tl.load(V + vrow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        rvd = tl.load(RV + cidx * M * DV + offs_m[:, None] * DV + d0 + offs_c[None, :])
        uv += dot_xa(vd.to(tl.float32), tl.trans(rvd), SPREC)
    a_end = _cumsum_row(a, CSZ - 1, CSZ)
    uv = uv * tl.exp(a_end[None, :] - a)
    r, tok, hq, rok = _row_lanes(h, GQ, CQB, BR)
    for blk in range(CSZ // CQB):
        off = blk * CQB
        t = cs0 + off + tok
        tv = rok & (t < T)
        causal = (offs_u[None, :] <= (off + tok)[:, None]) & tv[:, None]
        a_ref, factored, direct = _block_split_cumsum(a, off, CQB, CSZ, LIMIT)
        w_off = ((b * T + t).to(tl.int64) * HQ + hq)[:, None] * M + offs_m[None, :]
        a_in = _row_decay(GB, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off, tok, tv & (r % GQ == 0), T, W, CQB, BM, BM,
                          True)
        row = b * sq_b + t.to(tl.int64) * sq_t + hq * D
        uv += _da_side(Q, row, K, krow, WK, w_off, GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, tv, jr, causal,
                       a_in, a, a_ref, factored, direct, T, W, D, BD, BM, BR, CQB, CSZ, PREC, SPREC)
        orow = b * so_b + t.to(tl.int64) * so_t + hq * DV
        uv += _da_side(DO, orow, V, vrow, WV, w_off, GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, tv, jr,
                       causal, a_in, a, a_ref, factored, direct, T, W, DV, BD, BM, BR, CQB, CSZ, PREC, SPREC)
    g, _, _, _ = _chunk_gates(GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, cs0 + CSZ, BM, CSZ)
    _store_da(E, DA, XA, TOT, uv, g, jr, pid_bh, c, cs0, offs_m, T, L, NCH, M, CSZ)


def slot_bwd_precision(dtype, slots):
    """SPREC (products.py) of the slot backward's fp32 products for `dtype` inputs: CONFIG["slot_bwd_precision"],
    except "tf32x3" for bf16x3 with fewer than 64 slots (Triton 3.6 miscompiled its rows kernel's 16/32-wide bf16
    slot products at D = 64 with 8 query heads per kv head on the H200: wrong gradients or a fault)."""
    sprec = product_precision(CONFIG["slot_bwd_precision"], dtype)
    return "tf32x3" if sprec == "bf16x3" and slots < 64 else sprec


def keys_prefetch(p):
    """PREFETCH of the merged key kernel: CONFIG["keys_prefetch"] where its prefetched rows are whole 128-byte lines
    (`chunk_fwd.prefetchable`; E's fp32 rows of M slots: at least 32)."""
    return CONFIG["keys_prefetch"] and prefetchable(p) and p.M >= 32


def gradient_precision(kernel, sprec):
    """GPREC of the slot backward's `kernel` ("rows" or "keys"): the SPREC of its products that form only dq, or dk
    and dv (not the logits, dP, E, UV or the state gradients, which log_alpha's and slot_bias's gradients,
    cancellations, need near fp32-exact), given the others' `sprec`: CONFIG["slot_bwd_grad_precision"][kernel] where
    they are bf16x3, else the same."""
    return CONFIG["slot_bwd_grad_precision"].get(kernel, sprec) if sprec == "bf16x3" else sprec


@triton.jit
def _alpha_grad_kernel(DA, XA, LATER, MASK, DLA, sd_b, T, W, NCH, L,
                       H: tl.constexpr, M: tl.constexpr, CSZ: tl.constexpr, BM: tl.constexpr):
    """DLA[b, j, h] = sum_{u >= j + W} DA[u] + XA[j + W] for the real tokens j < T - W and zero for the others, per
    (stream chunk, batch x kv head, slot block): the chunk's own reverse cumsum plus the later chunks' sum
    (LATER [B * H, M, NCH]: the cumsum of the chunk sums stored in reverse chunk order, so chunk c's carry sits at
    NCH - 2 - c), written straight into the [B, T, H, M] layout."""
    sd_t, sd_h = H * M, M  # [B, T, H, M], contiguous (as `_token_strides`)
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_m = tl.program_id(2) * BM + tl.arange(0, BM)
    b = pid_bh // H
    h = pid_bh % H
    u = c * CSZ + tl.arange(0, CSZ)
    off = (pid_bh.to(tl.int64) * L + u)[:, None] * M + offs_m[None, :]
    carry = tl.load(LATER + (pid_bh.to(tl.int64) * M + offs_m) * NCH + NCH - 2 - c,
                    mask=(c + 0 * offs_m) < NCH - 1, other=0.0)  # (a vector mask: the interpreter lacks scalar ones)
    dla = tl.cumsum(tl.load(DA + off), axis=0, reverse=True) + carry[None, :] + tl.load(XA + off)
    j = u - W
    inside = (j >= 0) & (j < T - W)
    real = _real(MASK, b, T, j, inside)
    tl.store(DLA + b * sd_b + j[:, None].to(tl.int64) * sd_t + h * sd_h + offs_m[None, :],
             tl.where(real[:, None], dla, 0.0).to(DLA.dtype.element_ty), mask=inside[:, None])
    _store_tail(DLA, None, b, h, sd_b, sd_t, sd_h, offs_m, c * CSZ, T, W, CSZ, BM)


def _log_alpha_grad(p, dA, xa, totals):
    """d log_alpha [B, T, H, M] in log_alpha's dtype from the keys_da outputs [B, H, L, M] over stream positions
    u = j + W and their chunk sums `totals` [B, H, M, L / CS] (in reverse chunk order): the suffix sum of dA plus
    xa, shifted back by the window; padding rows get none. One kernel: per chunk a reverse cumsum plus the later
    chunks' sum (one kernel instead of ~8 PyTorch ops: 0.65 ms less per 32K step on the H200, NOTES.md session 8),
    after one small op (the cumsum of the chunk sums along their innermost dimension)."""
    B, H, L, M = dA.shape
    n = L // p.cs
    later = totals.cumsum(-1)
    dla = alloc(B, p.T, H, M, dtype=p.log_alpha.dtype, device=dA.device)
    bm = min(M, 64)
    launch("alpha grad", _alpha_grad_kernel, (n, B * H, M // bm), dA, xa, later, p.mask, dla, dla.stride(0), p.T,
           p.W, n, L, H=H, M=M, CSZ=p.cs, BM=bm)
    return dla


@triton.jit
def _state_grad_chunk(Y, WST, G, MASK, BCUM, sy_b, sy_t, sg_b, sg_t, sg_h, T, W, L, pid_bh, b, h, cs0, offs_c, g,
                      a, s, HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, DX: tl.constexpr, M: tl.constexpr,
                      CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SPREC: tl.constexpr,
                      LIMIT: tl.constexpr, CHUNK_DECAY: tl.constexpr):
    """sum over the chunk's rows u of (W_u exp(a_u))^T Y_u[cols]: [M, BD]. With CHUNK_DECAY and at least 64 slots
    each row block's a_u come from the chunk's start in one product of its gates (`_row_decay`'s product form: no
    reduction across the warps); else from the block's start plus the gates before it, a_ref (`_block_split`'s sum
    over the chunk's tokens; `_row_decay`'s scan form, below 64 slots, covers only the block's rows).
    Unless BCUM is None it gets each token's decay from its block's start (`_row_decay` as the rows kernel forms
    it) for the merged key kernel (CONFIG["shared_row_decays"] "state_grad")."""
    r, tok, hq, rok = _row_lanes(h, GQ, CQB, BR)
    acc = tl.zeros([M, BD], dtype=tl.float32)
    for blk in range(CSZ // CQB):
        if CHUNK_DECAY and M >= 64:
            t = cs0 + blk * CQB + tok
            tv = rok & (t < T)
            wst = _load_rows(WST, b, t, hq, tv, T * HQ * M, HQ * M, M, tl.arange(0, M))  # ([B, T, HQ, M])
            decay = tl.exp(_row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, blk * CQB + tok, tv & (r % GQ == 0), T,
                                      W, CSZ, M, M, False))
            if BCUM is not None:
                a_in = _row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + blk * CQB, tok, tv & (r % GQ == 0), T, W,
                                  CQB, M, M, False)
        else:
            a_ref, factored, direct = _block_split(g, blk * CQB, CQB, CSZ, LIMIT)
            t, tv, causal, kw, wst, unused, a_in = _row_block(G, MASK, WST, WST, b, h, sg_b, sg_t, sg_h, a, s, a_ref,
                                                              factored, cs0, blk * CQB, r, tok, hq, rok, T, W, None,
                                                              HQ, GQ, M, CQB, CSZ, True, False, False)
            decay = tl.exp(a_in + a_ref[None, :])
        if BCUM is not None:
            _store_row_decays(BCUM, a_in, pid_bh, L, t, tv & (r % GQ == 0), M)
        y = _load_rows(Y, b, t, hq, tv, sy_b, sy_t, DX, offs_c)
        acc = acc + dot_xb(tl.trans(wst * decay), y.to(tl.float32), SPREC)
    return acc


@triton.jit
def _state_grad_kernel(
    Y, WST, Y2, WST2, G, MASK, C_OUT, BCUM,
    sy_b, sg_b, T, W, NCH, L,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, DX: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SPREC: tl.constexpr,
    LIMIT: tl.constexpr, CHUNK_DECAY: tl.constexpr,
):
    """C_OUT[c][:, cols] = sum over the chunk's rows u of (W_u exp(a_u))^T Y_u[cols], a_u the chunk's summed
    log gates through u: the chunk's contribution to the gradient w.r.t. the state before it (CK with
    (q, Wk), CV with (dO, Wv)). Program axis 2 runs over the column blocks of (Y, WST), then (if it is twice as
    long) of (Y2, WST2), whose results follow in C_OUT (both state gradients in one launch). Y and Y2: [B, T, HQ,
    DX] (q or dO). BCUM: as `_state_grad_chunk`'s."""
    sy_t, sg_t, sg_h = HQ * DX, H * M, M  # contiguous layouts (as `_token_strides`)
    c, pid_bh, b, h, cs0, offs_c, g, a, j, _, s, to_end, _ = _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H, M, CSZ,
                                                                         BD, False)
    NDB: tl.constexpr = DX // BD
    stream = tl.program_id(2) // NDB
    offs_c = offs_c - stream * DX  # _keys_chunk's columns count over both streams
    if stream == 0:  # (the first stream's programs store the row decays, where BCUM is given)
        acc = _state_grad_chunk(Y, WST, G, MASK, BCUM, sy_b, sy_t, sg_b, sg_t, sg_h, T, W, L, pid_bh, b, h, cs0,
                                offs_c, g, a, s, HQ, H, GQ, DX, M, CQB, CSZ, BR, BD, SPREC, LIMIT, CHUNK_DECAY)
    else:
        acc = _state_grad_chunk(Y2, WST2, G, MASK, None, sy_b, sy_t, sg_b, sg_t, sg_h, T, W, L, pid_bh, b, h, cs0,
                                offs_c, g, a, s, HQ, H, GQ, DX, M, CQB, CSZ, BR, BD, SPREC, LIMIT, CHUNK_DECAY)
    offs_m = tl.arange(0, M)
    out = (stream * tl.num_programs(1) + pid_bh).to(tl.int64) * NCH + c
    tl.store(C_OUT + out * M * DX + offs_m[:, None] * DX + offs_c[None, :], acc)


@triton.jit
def _keys_kernel(
    Q, DO, WK, WV, RK, RV, G, MASK, DK, DV_,
    sq_b, sk_b, sv_b, sg_b, so_b,
    T, W, NCH,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SPREC: tl.constexpr,
    DO_K: tl.constexpr, DO_V: tl.constexpr, LIMIT: tl.constexpr,
):
    """Columns cols = BD * program axis 2 of dk (DO_K) and dv (DO_V) for the chunk's tokens:
    dX[j, cols] = sum_i to_end[j, i] R[i, cols] + sum_u (W_u kw^T)[u, j] Y_u[cols], (Y, W, R) = (q, Wk, Rk) for
    dk and (dO, Wv, Rv) for dv (both in one pass over the row blocks when DO_K and DO_V). DK, DV_: the layouts of
    k and v. Its products form only dk and dv: SPREC is the `gradient_precision` of "keys"."""
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = _token_strides(HQ, H, D, DV)
    sg_t, sg_h = H * M, M
    c, pid_bh, b, h, cs0, offs_c, g, a, j, _, s, to_end, _ = _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H, M, CSZ,
                                                                         BD, False)
    offs_m = tl.arange(0, M)
    cidx = pid_bh.to(tl.int64) * NCH + c
    acc_k = tl.zeros([CSZ, BD], dtype=tl.float32)
    acc_v = tl.zeros([CSZ, BD], dtype=tl.float32)
    if DO_K:
        acc_k = dot_f32(to_end, tl.load(RK + cidx * M * D + offs_m[:, None] * D + offs_c[None, :]), SPREC)
    if DO_V:
        acc_v = dot_f32(to_end, tl.load(RV + cidx * M * DV + offs_m[:, None] * DV + offs_c[None, :]), SPREC)
    r, tok, hq, rok = _row_lanes(h, GQ, CQB, BR)
    for blk in range(CSZ // CQB):
        a_ref, factored, direct = _block_split(g, blk * CQB, CQB, CSZ, LIMIT)
        t, tv, causal, a_in, wk, wv, bk, bv = _key_block(
            G, MASK, WK, WV, b, h, sg_b, sg_t, sg_h, a, s, a_ref, factored, direct, cs0, blk * CQB, r, tok, hq, rok, T,
            W, None, HQ, GQ, M, CQB, CSZ, SPREC, DO_K, DO_V)
        if DO_K:
            acc_k += dot_xb(tl.trans(bk), _load_rows(Q, b, t, hq, tv, sq_b, sq_t, D, offs_c).to(tl.float32), SPREC)
        if DO_V:
            acc_v += dot_xb(tl.trans(bv), _load_rows(DO, b, t, hq, tv, so_b, so_t, DV, offs_c).to(tl.float32),
                            SPREC)
    if DO_K:
        _store_keys(DK, acc_k, b, j, h, sk_b, sk_t, sk_h, offs_c, T, W)
        _store_tail(DK, None, b, h, sk_b, sk_t, sk_h, offs_c, cs0, T, W, CSZ, BD)
    if DO_V:
        _store_keys(DV_, acc_v, b, j, h, sv_b, sv_t, sv_h, offs_c, T, W)
        _store_tail(DV_, None, b, h, sv_b, sv_t, sv_h, offs_c, cs0, T, W, CSZ, BD)


@triton.jit
def _keys_merged_kernel(
    Q, K, V, DO, WK, WV, RK, RV, G, MASK, E, DK, DV_, DVW, DA, XA, TOT, BCUM,
    sq_b, sk_b, sv_b, sg_b, so_b,
    T, W, NCH, L,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, M: tl.constexpr, CQB: tl.constexpr,
    CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr,
    LIMIT: tl.constexpr, GPREC: tl.constexpr, PREFETCH: tl.constexpr, CARRY_SPLIT: tl.constexpr,
    SIDES_APART: tl.constexpr, REST_PRODUCT: tl.constexpr,
):
    """`_keys_kernel` (dk and dv) and `_keys_da_kernel` (DA, XA, TOT) in one program per (chunk, batch x kv head)
    (CONFIG["slot_bwd_keys_merged_warps"]; values as wide as keys, BD = D columns, all M slots): each row block's
    weights Wk, Wv, its q and dO rows and its [rows, CS] slot weights are loaded or formed once for both. With DVW
    (the window half's fp32 dv, v's layout) dv is the sum of both halves, rounded once into DV_. PREFETCH: L2
    prefetches of the rows it reads last, E and DVW (`keys_prefetch`). CARRY_SPLIT (`keys_carry_split`): each row
    block's split from one row of the gates' cumsum (its end, the next block's start) instead of two sums of the
    gates, each a reduction across the warps over the chunk's tokens. SIDES_APART (`keys_sides_apart`): each row
    block's Wv and its slot-weighted rows are loaded and formed after the key side's products, so the two sides'
    tiles are not live at once. REST_PRODUCT (`keys_rest_product`): the gates after each chunk token as one product
    (`_keys_chunk`). BCUM (or None; CONFIG["shared_row_decays"]): each token's decay from its row block's start as
    the rows kernel (or the state_grad kernel) formed it, from which it loads its rows' decays and each block's end
    instead of a scan over the rows and a row of the chunk's cumsum (reductions across the warps)."""
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = _token_strides(HQ, H, D, D)
    sg_t, sg_h = H * M, M
    c, pid_bh, b, h, cs0, offs_c, g, a, j, jr, s, to_end, rest = _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H, M,
                                                                              CSZ, BD, REST_PRODUCT)
    if PREFETCH:
        _prefetch_rows(E, (pid_bh.to(tl.int64) * L + tl.minimum(cs0 + tl.arange(0, CSZ), L - 1)) * M, M)
        if DVW is not None:
            jp = tl.minimum(tl.maximum(j, 0), T - 1).to(tl.int64)
            _prefetch_rows(DVW, b * sv_b + jp * sv_t + h * sv_h, D)
    offs_m = tl.arange(0, M)
    state = (pid_bh.to(tl.int64) * NCH + c) * M * D + offs_m[:, None] * D + offs_c[None, :]
    rk = tl.load(RK + state)
    rv = tl.load(RV + state)
    acc_k = dot_f32(to_end, rk, GPREC)
    acc_v = dot_f32(to_end, rv, GPREC)
    krow = b * sk_b + j.to(tl.int64) * sk_t + h * sk_h
    vrow = b * sv_b + j.to(tl.int64) * sv_t + h * sv_h
    kc = tl.load(K + krow[:, None] + offs_c[None, :], mask=jr[:, None], other=0.0)
    vc = tl.load(V + vrow[:, None] + offs_c[None, :], mask=jr[:, None], other=0.0)
    uv = dot_xa(kc.to(tl.float32), tl.trans(rk), SPREC) + dot_xa(vc.to(tl.float32), tl.trans(rv), SPREC)
    uv = uv * tl.exp(rest)
    r, tok, hq, rok = _row_lanes(h, GQ, CQB, BR)
    a_ref = tl.zeros([M], dtype=tl.float32)  # the chunk's summed gates before the block
    for blk in range(CSZ // CQB):
        off = blk * CQB
        a_in = None  # the rows' decays: formed by `_row_block` unless loaded here
        if BCUM is not None:
            a_blk, a_in = _shared_row_decays(BCUM, pid_bh, L, cs0, off, tok, rok, T, M, CQB)
            a_last = a_ref + a_blk
            factored, direct = _block_split_bounds(a_ref, a_last, off, CQB, CSZ, LIMIT)
        elif CARRY_SPLIT:
            a_last, factored, direct = _carried_block_split(a, a_ref, off, CQB, CSZ, LIMIT)
        else:
            a_ref, factored, direct = _block_split(g, off, CQB, CSZ, LIMIT)
        if SIDES_APART:  # the value side's weights loaded and formed after the key side's work
            t, tv, causal, kw, wk, _, a_in = _row_block(G, MASK, WK, WV, b, h, sg_b, sg_t, sg_h, a, s, a_ref, factored,
                                                        cs0, off, r, tok, hq, rok, T, W, a_in, HQ, GQ, M, CQB, CSZ,
                                                        True, False, True)
            bk, _ = _block_weights(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, kw, a_in, wk, wk, direct, T,
                                   W, M, CQB, CSZ, GPREC, True, False)
        else:
            t, tv, causal, a_in, wk, wv, bk, bv = _key_block(
                G, MASK, WK, WV, b, h, sg_b, sg_t, sg_h, a, s, a_ref, factored, direct, cs0, off, r, tok, hq, rok, T,
                W, a_in, HQ, GQ, M, CQB, CSZ, GPREC, True, True)
        qb = _load_rows(Q, b, t, hq, tv, sq_b, sq_t, D, offs_c)
        acc_k += dot_xb(tl.trans(bk), qb.to(tl.float32), GPREC)
        uv += _da_weights(tl.dot(kc, tl.trans(qb), input_precision=PREC), wk, G, MASK, b, h, sg_b, sg_t, sg_h, cs0,
                          off, tok, causal, a_in, a, a_ref, factored, direct, T, W, M, CQB, CSZ, SPREC)
        if SIDES_APART:
            wv = tl.load(WV + ((b * T + t).to(tl.int64) * HQ + hq)[:, None] * M + offs_m[None, :], mask=tv[:, None],
                         other=0.0)
            _, bv = _block_weights(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, kw, a_in, wv, wv, direct, T,
                                   W, M, CQB, CSZ, GPREC, False, True)
        dob = _load_rows(DO, b, t, hq, tv, so_b, so_t, D, offs_c)
        acc_v += dot_xb(tl.trans(bv), dob.to(tl.float32), GPREC)
        uv += _da_weights(tl.dot(vc, tl.trans(dob), input_precision=PREC), wv, G, MASK, b, h, sg_b, sg_t, sg_h, cs0,
                          off, tok, causal, a_in, a, a_ref, factored, direct, T, W, M, CQB, CSZ, SPREC)
        if CARRY_SPLIT or BCUM is not None:
            a_ref = a_last
    _store_keys(DK, acc_k, b, j, h, sk_b, sk_t, sk_h, offs_c, T, W)
    _store_tail(DK, None, b, h, sk_b, sk_t, sk_h, offs_c, cs0, T, W, CSZ, BD)
    if DVW is not None:
        jv = (j >= 0) & (j < T - W)
        acc_v += tl.load(DVW + (b * sv_b + j.to(tl.int64) * sv_t + h * sv_h)[:, None] + offs_c[None, :],
                         mask=jv[:, None], other=0.0)
    _store_keys(DV_, acc_v, b, j, h, sv_b, sv_t, sv_h, offs_c, T, W)
    _store_tail(DV_, DVW, b, h, sv_b, sv_t, sv_h, offs_c, cs0, T, W, CSZ, BD)
    _store_da(E, DA, XA, TOT, uv, g, jr, pid_bh, c, cs0, offs_m, T, L, NCH, M, CSZ)


def launch_shape():
    """(row-block tokens, warps) of the slot backward: CONFIG["slot_bwd_block"], CONFIG["slot_bwd_warps"]."""
    return CONFIG.get("slot_bwd_block") or BQ, CONFIG.get("slot_bwd_warps") or 8


def register_cap(kernel):
    """Launch options capping the registers per thread of the slot backward's `kernel` ("rows", "state_grad" or
    "keys", the merged key kernel) at CONFIG["slot_bwd_maxnreg"][kernel]: more programs per multiprocessor for
    more spills (none set: the compiler's choice, 255)."""
    cap = CONFIG["slot_bwd_maxnreg"].get(kernel)
    return dict(maxnreg=cap) if cap else {}


def pipeline_stages(rows, dim):
    """Software-pipelining stages of a slot-backward kernel with [rows, dim] row blocks (CONFIG["slot_bwd_stages"],
    or 1 above CONFIG["slot_bwd_stages_block"] elements, where 2 stages overflow the shared memory)."""
    return CONFIG["slot_bwd_stages"] if rows * dim <= CONFIG["slot_bwd_stages_block"] else 1


def slot_backward_triton(p, do, lse, delta, scale, states=None, bias_grad=True, delta_whole=False, dv_window=None,
                         window_ready=None):
    """Gradients of the slot half: (dq, dk, dv, dlog_alpha, dslot_bias or None without `bias_grad`); dq, dk and
    dlog_alpha in the inputs' dtypes (stored once, rounded in the kernel), dv and dslot_bias fp32.

    With `dv_window` (the window half's fp32 dv) dv is the sum of both halves in v's dtype, rounded once: summed by
    the merged key kernel where it runs (CONFIG["fold_dv_sum"]), else by PyTorch at the end. `window_ready`, if
    given, is called before anything reads `dv_window` (it joins the stream that formed it).

    `delta` holds sum P * dP (`delta_whole`: from `window_bwd.window_dq` with the forward's exact output), or its
    window share (`window_bwd.window_delta`) and is completed in place with the slot share, for the window backward
    that follows. `states`: the forward's (Sk, Sv, dec, logits or None), else the
    states are recomputed and the logits formed again in the rows kernel."""
    B, T, HQ, D, H, M, DV, G, W = p.B, p.T, p.HQ, p.D, p.H, p.M, p.DV, p.G, p.W
    assert T > W, "without slots (window >= T) the slot backward has nothing to do"
    n = p.nch
    CS = p.cs  # tokens per chunk
    L = n * CS
    dev = do.device
    f32 = torch.float32
    do = do.contiguous()
    sk, sv, dec, logits = states if states is not None else (*kv_states(p), None)  # recomputed when not kept
    bq, warps = launch_shape()
    BR = max(16, next_power_of_2(bq * G))
    rows_bq = CONFIG["slot_bwd_rows_block"] or bq  # the rows kernel's blocks are independent of the others'
    assert CS % bq == 0 and CS % rows_bq == 0, "the slot backward's blocks must divide the chunk"
    bd_ = min(BD, D, DV)
    sprec = slot_bwd_precision(p.q.dtype, p.M)
    dq = alloc(B, T, HQ, D, dtype=p.q.dtype, device=dev)
    dbr = alloc(B, T, HQ, dtype=f32, device=dev)
    E = alloc(B, H, L, M, dtype=f32, device=dev)
    wk = alloc(B, T, HQ, M, dtype=f32, device=dev)
    wv = alloc(B, T, HQ, M, dtype=f32, device=dev)
    strides = batch_strides(p, do)
    common = dict(HQ=HQ, H=H, GQ=G, M=M, CQB=bq, CSZ=CS, BR=BR, BD=bd_, SPREC=sprec,
                  LIMIT=CONFIG["block_factor_limit"], num_warps=warps, num_stages=pipeline_stages(BR, max(D, DV)))
    keys_common = dict(common, num_warps=CONFIG["slot_bwd_keys_warps"] or warps)  # keys and keys_da kernels
    rows_br = max(16, next_power_of_2(rows_bq * G))
    rows_common = dict(common, CQB=rows_bq, BR=rows_br, num_warps=CONFIG["slot_bwd_rows_warps"] or warps,
                       num_stages=pipeline_stages(rows_br, max(D, DV)), **register_cap("rows"))
    # the column-split kernels (state_grad, keys): each program recomputes its row blocks' [rows, CS] weights
    cols, cols_warps = CONFIG["slot_bwd_columns"] or (BD, None)
    cols = min(cols, D, DV)
    merged = D == DV and CONFIG.get("slot_bwd_merge_keys", True)  # dk and dv in one program
    bm = min(M, CONFIG.get("keys_da_slots") or M)
    merged_warps = CONFIG["slot_bwd_keys_merged_warps"]
    # and the keys_da kernel's work too (not when keys_da should take the rows kernel's blocks)
    one_key_kernel = merged and merged_warps and cols == D and bm == M and not CONFIG["keys_da_rows_block"]
    # the row decays the merged key kernel loads, from the rows kernel or the state_grad kernel
    # (CONFIG["shared_row_decays"]; the producer's row blocks must be the key kernel's)
    producer = CONFIG["shared_row_decays"] if one_key_kernel else None
    if producer == "rows" and rows_bq != bq:
        producer = None
    row_decays = alloc(B, H, L, M, dtype=f32, device=dev) if producer else None
    grad_common = dict(common, BD=cols, num_warps=cols_warps or warps, **register_cap("state_grad"))
    keys_launch = dict(keys_common, BD=cols, num_warps=cols_warps or keys_common["num_warps"])
    launch(
        "slot bwd rows", _rows_kernel, (cdiv(T, rows_bq), B * H),
        p.q, p.k, p.v, do, p.log_alpha, p.mask, p.first, p.bias, sk, sv, lse, delta,
        logits if logits is not None else lse, dq, dbr, E, wk, wv, row_decays if producer == "rows" else None,
        *strides, T, W, n, L, float(scale), D=D, DV=DV,
        BT=max(16, next_power_of_2(rows_bq)), PREC=p.prec, HAS_LOGITS=logits is not None,
        DELTA_WHOLE=delta_whole, GPREC=gradient_precision("rows", sprec), CUMSUM_SPLIT=CONFIG["rows_cumsum_split"],
        FACTORED_DECAY=CONFIG["factored_carry_decay"], **rows_common,
    )
    # the key and value state gradients in one array (one reverse scan for both) when they have one shape
    both = alloc(2, B, H, n, M, D, dtype=f32, device=dev) if D == DV and CONFIG["merge_kv_states"] else None
    ck, cv = both.unbind(0) if both is not None else (alloc(B, H, n, M, D, dtype=f32, device=dev),
                                                      alloc(B, H, n, M, DV, dtype=f32, device=dev))
    state_grads = [(both, (p.q, wk, do, wv), D, 2)] if both is not None else [
        (ck, (p.q, wk, p.q, wk), D, 1), (cv, (do, wv, do, wv), DV, 1)]  # one launch for both, or one each
    for i, (out, (y, wst, y2, wst2), dx, streams) in enumerate(state_grads):
        launch(
            "slot bwd state_grad", _state_grad_kernel, (n, B * H, streams * dx // cols),
            y, wst, y2, wst2, p.log_alpha, p.mask, out, row_decays if producer == "state_grad" and i == 0 else None,
            y.stride(0), p.log_alpha.stride(0), T, W, n, L, DX=dx,
            CHUNK_DECAY=CONFIG["state_grad_chunk_decay"], **grad_common,
        )
    rk, rv = reverse_scan(both, dec).unbind(0) if both is not None else (reverse_scan(ck, dec),
                                                                         reverse_scan(cv, dec))
    fold = dv_window is not None and one_key_kernel and CONFIG["fold_dv_sum"]
    dk = alloc(B, T, H, D, dtype=p.k.dtype, device=dev)
    dv = alloc(B, T, H, DV, dtype=p.v.dtype if fold else f32, device=dev)
    dA = alloc(B, H, L, M, dtype=f32, device=dev)
    xa = alloc(B, H, L, M, dtype=f32, device=dev)
    totals = alloc(B, H, M, n, dtype=f32, device=dev)
    if window_ready is not None:
        window_ready()
    if one_key_kernel:
        launch(
            "slot bwd keys merged", _keys_merged_kernel, (n, B * H),
            p.q, p.k, p.v, do, wk, wv, rk, rv, p.log_alpha, p.mask, E, dk, dv, dv_window if fold else None,
            dA, xa, totals, row_decays,
            *strides, T, W, n, L, D=D, PREC=p.prec, GPREC=gradient_precision("keys", sprec),
            PREFETCH=keys_prefetch(p), CARRY_SPLIT=CONFIG["keys_carry_split"],
            SIDES_APART=CONFIG["keys_sides_apart"], REST_PRODUCT=CONFIG["keys_rest_product"],
            **dict(keys_launch, num_warps=merged_warps, **register_cap("keys")),
        )
    else:
        for do_k, do_v, dx in [(True, True, D)] if merged else [(True, False, D), (False, True, DV)]:
            launch(
                "slot bwd keys", _keys_kernel, (n, B * H, dx // cols),
                p.q, do, wk, wv, rk, rv, p.log_alpha, p.mask, dk, dv, *strides, T, W, n,
                D=D, DV=DV, DO_K=do_k, DO_V=do_v, **dict(keys_launch, SPREC=gradient_precision("keys", sprec)),
            )
        da_launch = rows_common if CONFIG["keys_da_rows_block"] else keys_common  # (the rows kernel's blocks)
        launch(
            "slot bwd keys_da", _keys_da_kernel, (n, B * H, M // bm),
            p.q, p.k, p.v, do, p.log_alpha, p.mask, wk, wv, E, rk, rv, dA, xa, totals, *strides, T, W,
            n, L, D=D, DV=DV, PREC=p.prec, BM=bm, **da_launch,
        )
    if dv_window is not None and not fold:
        dv = torch.add(dv, dv_window, out=torch.empty_like(dv, dtype=p.v.dtype))  # the sum rounded once, one kernel
    return dq, dk, dv, _log_alpha_grad(p, dA, xa, totals), dbr.sum((0, 1)) if bias_grad else None
