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

Kernels (values as wide as keys, D = DV: `dispatch.shapes_supported`):
- `_rows_kernel`, per (16-token query block, kv head), rows = tokens x G heads, as the forward: loads the forward's
  slot logits, forms dP = dO . Sv_u, completes the exact delta = sum P * dP unless it is already whole (without a
  window: `chunk_bwd_window.window_delta` gives the window share), forms dl = P (dP - delta), and writes dq (slot
  part), the slot_bias gradient per row, E[u] = sum_g (dl * l + P * dP) (summed over a token's G heads by a 0/1
  selection product) and the row weights Wk = scale dl, Wv = P. No atomics.
- `_state_grad_kernel`, per (stream chunk, kv head, key side then value side): the chunk's contribution to the
  gradient w.r.t. the state before it, (Wk exp(a_u))^T q and (Wv exp(a_u))^T dO, over its row blocks.
- `reverse_scan`: the state gradients after each chunk (a chained scan, `chunk_scan.py`).
- `_keys_merged_kernel`, per (chunk, kv head), all D columns and M <= 64 slots in one program: dk and dv = to_end R
  + sum over the chunk's query blocks of (slot-weighted W, causal)^T Y, and d/dA = E - s (<dK~, k> + <dV~, v>) with
  its chunk sum and the alpha term; each row block's weights and rows loaded once for all of them. Given the window
  half's dv it stores the sum of both halves. With more slots, `_keys_kernel` (dk, dv) and `_keys_da_kernel` (the
  gate terms, per block of 64 slots) do its work in two launches.
- `_alpha_grad_kernel` finishes dlog_alpha (per chunk a reverse cumsum plus the later chunks' sum, shifted by the
  window, masked, transposed, zero on padding and on the last W tokens).
Slot weights inside a chunk are factored around each query block's start (`slot_weights.py`); the row weights Wk,
Wv are stored without decay factors.

fp32 products take three bf16 MMAs on hi/lo splits (3xTF32 below 64 slots, `SLOT_PRECISION`; plain TF32 broke the
log_alpha gradient), with one MMA fewer where one operand is an upcast input (`dot_xa`, `dot_xb`). Products of two
bf16/fp16 operands are exact in fp32 accumulation. The products whose only use is dq, dk or dv round their fp32
operands to bf16 for one MMA, as flash attention's backward rounds dS and P (`gradient_precision`); the logits, dP,
E, UV and the state gradients keep the split products (the log_alpha and slot_bias gradients are cancellations).
"""

import torch
import triton
import triton.language as tl

from ...utils.launch import cdiv, launch, next_power_of_2
from ...utils.products import dot_f32, dot_xa, dot_xb, product_precision
from .chunk_inputs import batch_strides
from .chunk_states import chained_scan
from .rows import load_rows, query_rows, real, row_lanes, row_stats, token_strides
from .slot_weights import (block_split, block_split_cumsum, block_token_decay, carried_block_split, chunk_gates,
                           chunk_products, cumsum_row, prefix_sums, row_decay)

SLOT_PRECISION = "bf16x3"


def slot_precision(dtype, slots):
    """SPREC (ops/utils/products.py) of the slot backward's fp32 products for `dtype` inputs: "tf32x3" instead of "bf16x3"
    below 64 slots (Triton 3.6 miscompiled the rows kernel's 16/32-wide bf16 slot products at D = 64 with 8 query
    heads per kv head on the H200: wrong gradients or a fault)."""
    sprec = product_precision(SLOT_PRECISION, dtype)
    return "tf32x3" if sprec == "bf16x3" and slots < 64 else sprec


def gradient_precision(sprec):
    """The SPREC of the products that form only dq, or dk and dv, given the others' `sprec`: one bf16 MMA of rounded
    operands where those are bf16x3 (the 32K step 7.11 -> 6.84 ms on the H200), else the same."""
    return "bf16" if sprec == "bf16x3" else sprec


def reverse_scan(settings, cont, dec):
    """cont [..., B, H, n, M, X] (several state gradients sharing dec), dec [B, H, n, M] -> R of cont's shape:
    R[c] = sum_{c' > c} (prod_{c < c'' < c'} dec[c'']) * cont[c'], the gradient w.r.t. the state after chunk c."""
    B, H, n, M = dec.shape
    X = cont.shape[-1]
    rows = cont.numel() // (n * M * X)
    out = torch.empty_like(cont)
    flat = (rows, n, M, X)
    chained_scan(settings, cont.contiguous().view(flat), dec.contiguous().view(B * H, n, M), out.view(flat),
                 reverse=True)
    return out


@triton.jit
def _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H: tl.constexpr, M: tl.constexpr, CSZ: tl.constexpr,
                BD: tl.constexpr, REST_PRODUCT: tl.constexpr):
    """A keys-side program (axes: stream chunk c, batch x kv head, BD columns): its gates g, their cumsum a,
    positions j and which are real tokens jr, write weights s of those, to_end = s exp(a_end - a) (the decay to its
    end) and rest = a_end - a [CS, M], the gates after each token. With REST_PRODUCT (and tiles of 64 slots or more,
    as `prefix_sums`) rest is one product of the gates with a strictly upper 0/1 matrix, not the gates' sum over the
    chunk's tokens (a reduction across the warps) less a."""
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    d0 = tl.program_id(2) * BD
    b = pid_bh // H
    h = pid_bh % H
    cs0 = c * CSZ
    offs_c = d0 + tl.arange(0, BD)
    g, a, j, jr = chunk_gates(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, cs0 + CSZ, M, CSZ)
    if REST_PRODUCT and M >= 64:
        offs_u = tl.arange(0, CSZ)
        rest = prefix_sums(g.to(G.dtype.element_ty), offs_u[None, :] > offs_u[:, None])  # (g: exact in G's dtype)
    else:
        rest = tl.sum(g, 0)[None, :] - a
    s = tl.where(jr[:, None], 1.0 - tl.exp(g), 0.0)
    to_end = s * tl.exp(rest)
    return c, pid_bh, b, h, cs0, offs_c, g, a, j, jr, s, to_end, rest


@triton.jit
def _row_block(G, MASK, WST, b, h, sg_b, sg_t, sg_h, a, s, a_ref, factored, cs0, off, r, tok, hq, rok, T, W,
               HQ: tl.constexpr, GQ: tl.constexpr, M: tl.constexpr, CQB: tl.constexpr, CSZ: tl.constexpr):
    """Query block at chunk offset off, split by the caller (a_ref, the gates before it, and which tokens are
    `factored`): tokens t, valid rows tv, the causal mask [rows, CS], the factored weights kw, the rows' [rows, M]
    weights from WST and their decays a_in from the block start (`row_decay` by a scan: its product form's tiles
    spill in the key-side kernels)."""
    offs_u = tl.arange(0, CSZ)
    t = cs0 + off + tok
    tv = rok & (t < T)
    causal = (offs_u[None, :] <= (off + tok)[:, None]) & tv[:, None]
    kw = tl.where(factored[:, None], s * tl.exp(a_ref[None, :] - a), 0.0)
    w_off = ((b * T + t).to(tl.int64) * HQ + hq)[:, None] * M + tl.arange(0, M)[None, :]
    w = tl.load(WST + w_off, mask=tv[:, None], other=0.0)
    a_in = row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off, tok, tv & (r % GQ == 0), T, W, CQB, M, M, True)
    return t, tv, causal, kw, w, a_in


@triton.jit
def _block_weights(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, kw, a_in, w, direct, T, W,
                   M: tl.constexpr, CQB: tl.constexpr, CSZ: tl.constexpr, SPREC: tl.constexpr):
    """[rows, CS] slot-weighted row weights of w: w kw^T (causal) for the factored tokens; with `direct`, direct ones
    for the block's own tokens."""
    offs_u = tl.arange(0, CSZ)
    out = tl.where(causal, dot_f32(w * tl.exp(a_in), tl.trans(kw), SPREC), 0.0)
    if direct:
        cum = tl.zeros([M], dtype=tl.float32)
        for jj in range(CQB):
            e_j, s_j, cum = block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum, a_in,
                                              tok >= jj, M, M)
            out = tl.where(offs_u[None, :] == off + jj, tl.sum(w * e_j * s_j[None, :], 1)[:, None], out)
    return out


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
def _block_chunk(G, MASK, pid_bh, b, h, t0, r, tok, tv, sk_b, sk_t, sk_h, sg_b, sg_t, sg_h, T, W, NCH,
                 GQ: tl.constexpr, M: tl.constexpr, CQB: tl.constexpr, CSZ: tl.constexpr):
    """The stream chunk of a query-block program (`rows.query_rows`): its start cs0, the block's offset in it, the
    positions j (real: jr), the causal mask [rows, CS], the block split (a_ref, direct; from two rows of the gates'
    cumsum), the factored slot weights kw [CS, M], the rows' decays a_in from the block start, the key rows krow and
    the state index st."""
    c = t0 // CSZ
    cs0 = c * CSZ
    off = t0 - cs0
    g, a, j, jr = chunk_gates(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, t0 + CQB, M, CSZ)
    causal = tl.arange(0, CSZ)[None, :] <= (off + tok)[:, None]
    a_ref, factored, direct = block_split_cumsum(a, off, CQB, CSZ)
    kw = tl.where(jr[:, None] & factored[:, None], (1.0 - tl.exp(g)) * tl.exp(a_ref[None, :] - a), 0.0)
    a_in = row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, t0, tok, tv & (r % GQ == 0), T, W, CQB, M, M, False)
    krow = b * sk_b + j.to(tl.int64) * sk_t + h * sk_h
    st = pid_bh.to(tl.int64) * (NCH + 1) + c
    return cs0, off, j, jr, causal, a_ref, direct, kw, a_in, krow, st


@triton.jit
def _rows_dp(DO, orow, V, vrow, SV, st, G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, tv, jr, causal, kw, a_in,
             e_car, direct, T, W, offs_c, DX: tl.constexpr, BD: tl.constexpr, M: tl.constexpr, BR: tl.constexpr,
             CQB: tl.constexpr, CSZ: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr):
    """dP [rows, M]: the block's rows of dO against the slots they read (the value state before the chunk and the
    chunk's values, slot-weighted)."""
    offs_u = tl.arange(0, CSZ)
    xy, xs = chunk_products(DO, orow, V, vrow, SV, st, None, 0, None, tv, jr, offs_c, DX, BD, M, M, BR, CSZ, PREC,
                            SPREC)
    out = dot_f32(tl.where(causal, xy, 0.0), kw, SPREC) * tl.exp(a_in) + xs * e_car
    if direct:  # the block's own tokens: direct weights, as the forward
        cum = tl.zeros([M], dtype=tl.float32)
        for jj in range(CQB):
            e_j, s_j, cum = block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum, a_in,
                                              tok >= jj, M, M)
            out += tl.sum(tl.where(offs_u[None, :] == off + jj, xy, 0.0), 1)[:, None] * e_j * s_j[None, :]
    return out


@triton.jit
def _slot_dq(DQ, K, SK, G, MASK, wk, kw, a_in, a_ref, causal, direct, row, krow, st, jr, tv, b, h, sg_b, sg_t, sg_h,
             cs0, off, tok, T, W, D: tl.constexpr, BD: tl.constexpr, M: tl.constexpr, CQB: tl.constexpr,
             CSZ: tl.constexpr, GPREC: tl.constexpr):
    """dq (slot part) of the block's rows from their weights wk = scale dl: wk e^(a_u) . Sk (the state before the
    chunk) + (wk slot-weighted)[rows, CS] . k (the chunk's tokens), in BD-column passes, products at GPREC."""
    offs_u = tl.arange(0, CSZ)
    offs_c = tl.arange(0, BD)
    offs_m = tl.arange(0, M)
    wk_in = wk * tl.exp(a_in)
    bk = tl.where(causal, dot_f32(wk_in, tl.trans(kw), GPREC), 0.0)
    if direct:
        cum = tl.zeros([M], dtype=tl.float32)
        for jj in range(CQB):
            e_j, s_j, cum = block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum, a_in,
                                              tok >= jj, M, M)
            bk = tl.where(offs_u[None, :] == off + jj, tl.sum(wk * e_j * s_j[None, :], 1)[:, None], bk)
    # (wk e^a_in) e^a_ref, not wk times the rows' carried decay, which would then stay live from the kernel's start
    wc = wk_in * tl.exp(a_ref)[None, :]
    for d0 in range(0, D, BD):
        kd = tl.load(K + krow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        skd = tl.load(SK + st * M * D + offs_m[:, None] * D + d0 + offs_c[None, :])
        dq = dot_f32(wc, skd, GPREC) + dot_xb(bk, kd.to(tl.float32), GPREC)
        tl.store(DQ + row[:, None] + d0 + offs_c[None, :], dq.to(DQ.dtype.element_ty), mask=tv[:, None])


@triton.jit
def _rows_kernel(
    K, V, DO, G, MASK, FIRST, BIAS, SK, SV, LSE, DELTA, LOGITS,
    DQ, DB, E, WK, WV,
    sq_b, sk_b, sv_b, sg_b, so_b,
    T, W, NCH, L, scale,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, SPREC: tl.constexpr, DELTA_WHOLE: tl.constexpr, GPREC: tl.constexpr,
):
    """Per query block (module docstring). DELTA holds sum P * dP (DELTA_WHOLE), or its window share and gets the
    slot share added in place; BT: a power of two >= CQB, the tokens of the E product; LOGITS: the forward's scaled
    slot logits [B, T, HQ, M]."""
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = token_strides(HQ, H, D, D)
    sg_t, sg_h = H * M, M
    pid_bh, b, h, t0, r, tok, t, tv, hq = query_rows(T, H, GQ, CQB, BR)
    offs_c = tl.arange(0, BD)
    offs_m = tl.arange(0, M)
    first = tl.load(FIRST + b)
    readable = real(MASK, b, T, t, tv) & (t - W >= first)
    row = b * sq_b + t.to(tl.int64) * sq_t + hq * D
    orow = b * so_b + t.to(tl.int64) * so_t + hq * D
    lrow, lse, delta = row_stats(LSE, DELTA, b, t, hq, tv, T, HQ)
    cs0, off, j, jr, causal, a_ref, direct, kw, a_in, krow, st = _block_chunk(
        G, MASK, pid_bh, b, h, t0, r, tok, tv, sk_b, sk_t, sk_h, sg_b, sg_t, sg_h, T, W, NCH, GQ, M, CQB, CSZ)
    e_car = tl.exp(a_in) * tl.exp(a_ref)[None, :]  # as the forward's
    vrow = b * sv_b + j.to(tl.int64) * sv_t + h * sv_h

    lraw = tl.load(LOGITS + lrow[:, None] * M + offs_m[None, :], mask=tv[:, None], other=0.0)
    dp = _rows_dp(DO, orow, V, vrow, SV, st, G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, tv, jr, causal, kw, a_in,
                  e_car, direct, T, W, offs_c, D, BD, M, BR, CQB, CSZ, PREC, SPREC)
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

    _slot_dq(DQ, K, SK, G, MASK, wk, kw, a_in, a_ref, causal, direct, row, krow, st, jr, tv, b, h, sg_b, sg_t, sg_h,
             cs0, off, tok, T, W, D, BD, M, CQB, CSZ, GPREC)


@triton.jit
def _da_side(Y, yrow, X, xrow, WST, w_off, GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, tv, jr, causal, a_in, a,
             a_ref, factored, direct, T, W, DX: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
             CQB: tl.constexpr, CSZ: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr):
    """A query block's share of one side of UV (q with the chunk's k and Wk, or dO with v and Wv), [CS, BM]:
    `_da_weights` of xy = X Y^T [CS, rows] (formed in BD-column passes, transposed: no fp32 transpose for the
    product) and the rows' weights. The two sides run one after the other, so only one [CS, rows] product and one
    weight tile are live at a time."""
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
            e_j, s_j, cum = block_token_decay(GB, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum, a_in,
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
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
    SPREC: tl.constexpr, BM: tl.constexpr,
):
    """DA[u] = E[u] - s_u * UV[u] and XA[u] = -alpha_u * UV[u], UV[u] = <dK~_u, k_u> + <dV~_u, v_u>, and the
    chunk's sum of DA (TOT), for the slots m0 .. m0 + BM - 1 of program axis 2 (every term is per slot: the slot
    blocks are independent). The loop over query blocks keeps only the gates' cumsum a live (the blocks' split
    comes from it, the gates are reloaded at the end)."""
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = token_strides(HQ, H, D, D)
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
    _, a, j, jr = chunk_gates(GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, cs0 + CSZ, BM, CSZ)
    krow = b * sk_b + j.to(tl.int64) * sk_t + h * sk_h
    vrow = b * sv_b + j.to(tl.int64) * sv_t + h * sv_h
    cidx = pid_bh.to(tl.int64) * NCH + c
    uv = tl.zeros([CSZ, BM], dtype=tl.float32)
    for d0 in range(0, D, BD):
        kd = tl.load(K + krow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        rkd = tl.load(RK + cidx * M * D + offs_m[:, None] * D + d0 + offs_c[None, :])
        uv += dot_xa(kd.to(tl.float32), tl.trans(rkd), SPREC)
    for d0 in range(0, D, BD):
        vd = tl.load(V + vrow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        rvd = tl.load(RV + cidx * M * D + offs_m[:, None] * D + d0 + offs_c[None, :])
        uv += dot_xa(vd.to(tl.float32), tl.trans(rvd), SPREC)
    a_end = cumsum_row(a, CSZ - 1, CSZ)
    uv = uv * tl.exp(a_end[None, :] - a)
    r, tok, hq, rok = row_lanes(h, GQ, CQB, BR)
    for blk in range(CSZ // CQB):
        off = blk * CQB
        t = cs0 + off + tok
        tv = rok & (t < T)
        causal = (offs_u[None, :] <= (off + tok)[:, None]) & tv[:, None]
        a_ref, factored, direct = block_split_cumsum(a, off, CQB, CSZ)
        w_off = ((b * T + t).to(tl.int64) * HQ + hq)[:, None] * M + offs_m[None, :]
        a_in = row_decay(GB, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off, tok, tv & (r % GQ == 0), T, W, CQB, BM, BM, True)
        row = b * sq_b + t.to(tl.int64) * sq_t + hq * D
        uv += _da_side(Q, row, K, krow, WK, w_off, GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, tv, jr, causal,
                       a_in, a, a_ref, factored, direct, T, W, D, BD, BM, BR, CQB, CSZ, PREC, SPREC)
        orow = b * so_b + t.to(tl.int64) * so_t + hq * D
        uv += _da_side(DO, orow, V, vrow, WV, w_off, GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, tv, jr,
                       causal, a_in, a, a_ref, factored, direct, T, W, D, BD, BM, BR, CQB, CSZ, PREC, SPREC)
    g, _, _, _ = chunk_gates(GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, cs0 + CSZ, BM, CSZ)
    _store_da(E, DA, XA, TOT, uv, g, jr, pid_bh, c, cs0, offs_m, T, L, NCH, M, CSZ)


@triton.jit
def _alpha_grad_kernel(DA, XA, LATER, MASK, DLA, sd_b, T, W, NCH, L,
                       H: tl.constexpr, M: tl.constexpr, CSZ: tl.constexpr, BM: tl.constexpr):
    """DLA[b, j, h] = sum_{u >= j + W} DA[u] + XA[j + W] for the real tokens j < T - W and zero for the others, per
    (stream chunk, batch x kv head, slot block): the chunk's own reverse cumsum plus the later chunks' sum
    (LATER [B * H, M, NCH]: the cumsum of the chunk sums stored in reverse chunk order, so chunk c's carry sits at
    NCH - 2 - c), written straight into the [B, T, H, M] layout."""
    sd_t, sd_h = H * M, M  # [B, T, H, M], contiguous (as `rows.token_strides`)
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
    is_real = real(MASK, b, T, j, inside)
    tl.store(DLA + b * sd_b + j[:, None].to(tl.int64) * sd_t + h * sd_h + offs_m[None, :],
             tl.where(is_real[:, None], dla, 0.0).to(DLA.dtype.element_ty), mask=inside[:, None])
    _store_tail(DLA, None, b, h, sd_b, sd_t, sd_h, offs_m, c * CSZ, T, W, CSZ, BM)


def _log_alpha_grad(p, dA, xa, totals):
    """d log_alpha [B, T, H, M] in log_alpha's dtype from the gate terms [B, H, L, M] over stream positions
    u = j + W and their chunk sums `totals` [B, H, M, L / CS] (in reverse chunk order): the suffix sum of dA plus
    xa, shifted back by the window; padding rows get none. One kernel per chunk (a reverse cumsum plus the later
    chunks' sum: 0.65 ms less per 32K step than ~8 PyTorch ops), after the cumsum of the chunk sums."""
    B, H, L, M = dA.shape
    n = L // p.cs
    later = totals.cumsum(-1)
    dla = torch.empty(B, p.T, H, M, dtype=p.log_alpha.dtype, device=dA.device)
    bm = min(M, 64)
    launch(_alpha_grad_kernel, (n, B * H, M // bm), dA, xa, later, p.mask, dla, dla.stride(0), p.T, p.W, n, L,
           H=H, M=M, CSZ=p.cs, BM=bm)
    return dla


@triton.jit
def _state_grad_chunk(Y, WST, G, MASK, sy_b, sy_t, sg_b, sg_t, sg_h, T, W, b, h, cs0, offs_c, g, a, s,
                      HQ: tl.constexpr, GQ: tl.constexpr, DX: tl.constexpr, M: tl.constexpr, CQB: tl.constexpr,
                      CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SPREC: tl.constexpr):
    """sum over the chunk's rows u of (W_u exp(a_u))^T Y_u[cols]: [M, BD]. With at least 64 slots each row block's
    a_u come from the chunk's start in one product of its gates (`row_decay`'s product form: no reduction across the
    warps); else from the block's start plus the gates before it (`block_split`)."""
    r, tok, hq, rok = row_lanes(h, GQ, CQB, BR)
    acc = tl.zeros([M, BD], dtype=tl.float32)
    for blk in range(CSZ // CQB):
        if M >= 64:
            t = cs0 + blk * CQB + tok
            tv = rok & (t < T)
            wst = load_rows(WST, b, t, hq, tv, T * HQ * M, HQ * M, M, tl.arange(0, M))  # ([B, T, HQ, M])
            decay = tl.exp(row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, blk * CQB + tok, tv & (r % GQ == 0), T,
                                     W, CSZ, M, M, False))
        else:
            a_ref, factored, direct = block_split(g, blk * CQB, CQB, CSZ)
            t, tv, causal, kw, wst, a_in = _row_block(G, MASK, WST, b, h, sg_b, sg_t, sg_h, a, s, a_ref, factored,
                                                      cs0, blk * CQB, r, tok, hq, rok, T, W, HQ, GQ, M, CQB, CSZ)
            decay = tl.exp(a_in + a_ref[None, :])
        y = load_rows(Y, b, t, hq, tv, sy_b, sy_t, DX, offs_c)
        acc = acc + dot_xb(tl.trans(wst * decay), y.to(tl.float32), SPREC)
    return acc


@triton.jit
def _state_grad_kernel(
    Y, WST, Y2, WST2, G, MASK, C_OUT,
    sy_b, sg_b, T, W, NCH,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, DX: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SPREC: tl.constexpr,
):
    """C_OUT[c][:, cols] = sum over the chunk's rows u of (W_u exp(a_u))^T Y_u[cols], a_u the chunk's summed
    log gates through u: the chunk's contribution to the gradient w.r.t. the state before it (with (q, Wk) and
    with (dO, Wv)). Program axis 2 runs over the column blocks of (Y, WST), then of (Y2, WST2), whose results follow
    in C_OUT (both state gradients in one launch). Y and Y2: [B, T, HQ, DX] (q and dO)."""
    sy_t, sg_t, sg_h = HQ * DX, H * M, M  # contiguous layouts (as `rows.token_strides`)
    c, pid_bh, b, h, cs0, offs_c, g, a, j, _, s, to_end, _ = _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H, M, CSZ,
                                                                         BD, False)
    NDB: tl.constexpr = DX // BD
    stream = tl.program_id(2) // NDB
    offs_c = offs_c - stream * DX  # _keys_chunk's columns count over both streams
    if stream == 0:
        acc = _state_grad_chunk(Y, WST, G, MASK, sy_b, sy_t, sg_b, sg_t, sg_h, T, W, b, h, cs0, offs_c, g, a, s, HQ,
                                GQ, DX, M, CQB, CSZ, BR, BD, SPREC)
    else:
        acc = _state_grad_chunk(Y2, WST2, G, MASK, sy_b, sy_t, sg_b, sg_t, sg_h, T, W, b, h, cs0, offs_c, g, a, s,
                                HQ, GQ, DX, M, CQB, CSZ, BR, BD, SPREC)
    offs_m = tl.arange(0, M)
    out = (stream * tl.num_programs(1) + pid_bh).to(tl.int64) * NCH + c
    tl.store(C_OUT + out * M * DX + offs_m[:, None] * DX + offs_c[None, :], acc)


@triton.jit
def _keys_kernel(
    Q, DO, WK, WV, RK, RV, G, MASK, DK, DV_,
    sq_b, sk_b, sv_b, sg_b, so_b,
    T, W, NCH,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SPREC: tl.constexpr,
):
    """Columns cols = BD * program axis 2 of dk and dv for the chunk's tokens (more slots than the merged key kernel
    takes): dX[j, cols] = sum_i to_end[j, i] R[i, cols] + sum_u (W_u kw^T)[u, j] Y_u[cols], (Y, W, R) = (q, Wk, Rk)
    for dk and (dO, Wv, Rv) for dv. Its products form only dk and dv: SPREC is the `gradient_precision`."""
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = token_strides(HQ, H, D, D)
    sg_t, sg_h = H * M, M
    c, pid_bh, b, h, cs0, offs_c, g, a, j, _, s, to_end, _ = _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H, M, CSZ,
                                                                         BD, False)
    offs_m = tl.arange(0, M)
    state = (pid_bh.to(tl.int64) * NCH + c) * M * D + offs_m[:, None] * D + offs_c[None, :]
    acc_k = dot_f32(to_end, tl.load(RK + state), SPREC)
    acc_v = dot_f32(to_end, tl.load(RV + state), SPREC)
    r, tok, hq, rok = row_lanes(h, GQ, CQB, BR)
    for blk in range(CSZ // CQB):
        off = blk * CQB
        a_ref, factored, direct = block_split(g, off, CQB, CSZ)
        t, tv, causal, kw, wk, a_in = _row_block(G, MASK, WK, b, h, sg_b, sg_t, sg_h, a, s, a_ref, factored, cs0, off,
                                                 r, tok, hq, rok, T, W, HQ, GQ, M, CQB, CSZ)
        bk = _block_weights(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, kw, a_in, wk, direct, T, W, M, CQB,
                            CSZ, SPREC)
        acc_k += dot_xb(tl.trans(bk), load_rows(Q, b, t, hq, tv, sq_b, sq_t, D, offs_c).to(tl.float32), SPREC)
        wv = tl.load(WV + ((b * T + t).to(tl.int64) * HQ + hq)[:, None] * M + offs_m[None, :], mask=tv[:, None],
                     other=0.0)
        bv = _block_weights(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, kw, a_in, wv, direct, T, W, M, CQB,
                            CSZ, SPREC)
        acc_v += dot_xb(tl.trans(bv), load_rows(DO, b, t, hq, tv, so_b, so_t, D, offs_c).to(tl.float32), SPREC)
    _store_keys(DK, acc_k, b, j, h, sk_b, sk_t, sk_h, offs_c, T, W)
    _store_tail(DK, None, b, h, sk_b, sk_t, sk_h, offs_c, cs0, T, W, CSZ, BD)
    _store_keys(DV_, acc_v, b, j, h, sv_b, sv_t, sv_h, offs_c, T, W)
    _store_tail(DV_, None, b, h, sv_b, sv_t, sv_h, offs_c, cs0, T, W, CSZ, BD)


@triton.jit
def _keys_merged_kernel(
    Q, K, V, DO, WK, WV, RK, RV, G, MASK, E, DK, DV_, DVW, DA, XA, TOT,
    sq_b, sk_b, sv_b, sg_b, so_b,
    T, W, NCH, L,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, M: tl.constexpr, CQB: tl.constexpr,
    CSZ: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, GPREC: tl.constexpr,
):
    """dk and dv (as `_keys_kernel`) and the gate terms DA, XA, TOT (as `_keys_da_kernel`) in one program per (chunk,
    batch x kv head), all D columns and all M slots: each row block's weights Wk, Wv, its q and dO rows and its
    [rows, CS] slot weights are loaded or formed once for both. With DVW (the window half's fp32 dv, v's layout) dv
    is the sum of both halves, rounded once into DV_. Each row block's split comes from one row of the gates' cumsum
    (its end, the next block's start), and its value side is loaded and formed after its key side's products, so the
    two sides' tiles are not live at once."""
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = token_strides(HQ, H, D, D)
    sg_t, sg_h = H * M, M
    c, pid_bh, b, h, cs0, offs_c, g, a, j, jr, s, to_end, rest = _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H, M,
                                                                              CSZ, D, True)
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
    r, tok, hq, rok = row_lanes(h, GQ, CQB, BR)
    a_ref = tl.zeros([M], dtype=tl.float32)  # the chunk's summed gates before the block
    for blk in range(CSZ // CQB):
        off = blk * CQB
        a_last, factored, direct = carried_block_split(a, a_ref, off, CQB, CSZ)
        t, tv, causal, kw, wk, a_in = _row_block(G, MASK, WK, b, h, sg_b, sg_t, sg_h, a, s, a_ref, factored, cs0, off,
                                                 r, tok, hq, rok, T, W, HQ, GQ, M, CQB, CSZ)
        bk = _block_weights(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, kw, a_in, wk, direct, T, W, M, CQB,
                            CSZ, GPREC)
        qb = load_rows(Q, b, t, hq, tv, sq_b, sq_t, D, offs_c)
        acc_k += dot_xb(tl.trans(bk), qb.to(tl.float32), GPREC)
        uv += _da_weights(tl.dot(kc, tl.trans(qb), input_precision=PREC), wk, G, MASK, b, h, sg_b, sg_t, sg_h, cs0,
                          off, tok, causal, a_in, a, a_ref, factored, direct, T, W, M, CQB, CSZ, SPREC)
        wv = tl.load(WV + ((b * T + t).to(tl.int64) * HQ + hq)[:, None] * M + offs_m[None, :], mask=tv[:, None],
                     other=0.0)
        bv = _block_weights(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, kw, a_in, wv, direct, T, W, M, CQB,
                            CSZ, GPREC)
        dob = load_rows(DO, b, t, hq, tv, so_b, so_t, D, offs_c)
        acc_v += dot_xb(tl.trans(bv), dob.to(tl.float32), GPREC)
        uv += _da_weights(tl.dot(vc, tl.trans(dob), input_precision=PREC), wv, G, MASK, b, h, sg_b, sg_t, sg_h, cs0,
                          off, tok, causal, a_in, a, a_ref, factored, direct, T, W, M, CQB, CSZ, SPREC)
        a_ref = a_last
    _store_keys(DK, acc_k, b, j, h, sk_b, sk_t, sk_h, offs_c, T, W)
    _store_tail(DK, None, b, h, sk_b, sk_t, sk_h, offs_c, cs0, T, W, CSZ, D)
    if DVW is not None:
        jv = (j >= 0) & (j < T - W)
        acc_v += tl.load(DVW + (b * sv_b + j.to(tl.int64) * sv_t + h * sv_h)[:, None] + offs_c[None, :],
                         mask=jv[:, None], other=0.0)
    _store_keys(DV_, acc_v, b, j, h, sv_b, sv_t, sv_h, offs_c, T, W)
    _store_tail(DV_, DVW, b, h, sv_b, sv_t, sv_h, offs_c, cs0, T, W, CSZ, D)
    _store_da(E, DA, XA, TOT, uv, g, jr, pid_bh, c, cs0, offs_m, T, L, NCH, M, CSZ)


def _stages(settings, rows, dim):
    """Software-pipelining stages of a slot-backward kernel with [rows, dim] row blocks: one where two overflow the
    shared memory (128 rows x 128 at 8 query heads per kv head needed 240 KB with 2, over the H200's 227 KB)."""
    return settings.stages if rows * dim <= settings.stages_elements else 1


def slot_backward_triton(p, do, lse, delta, scale, states, bias_grad=True, delta_whole=False, dv_window=None,
                         window_ready=None):
    """Gradients of the slot half: (dq, dk, dv, dlog_alpha, dslot_bias or None without `bias_grad`); dq, dk and
    dlog_alpha in the inputs' dtypes (stored once, rounded in the kernel), dv fp32 (or, with `dv_window`, the sum of
    both halves in v's dtype) and dslot_bias fp32.

    `states`: the forward's (Sk, Sv, dec, logits). `delta` holds sum P * dP (`delta_whole`: from
    `chunk_bwd_window.window_dq` with the forward's exact output), or its window share (`window_delta`) and is
    completed in place with the slot share, for the window backward that follows. `dv_window`: the window half's
    fp32 dv, summed in the merged key kernel where it runs, else by PyTorch at the end; `window_ready`, if given, is
    called before anything reads it (it joins the stream that formed it)."""
    B, T, HQ, D, H, M, G, W = p.B, p.T, p.HQ, p.D, p.H, p.M, p.G, p.W
    assert T > W and p.D == p.DV, "the slot backward needs slots (window < T) and values as wide as keys"
    settings = p.settings.slot_backward
    n, CS = p.nch, p.cs
    L = n * CS
    device = do.device
    f32 = torch.float32
    sk, sv, dec, logits = states
    bq, rows_bq = settings.block_tokens, settings.rows_block_tokens
    assert CS % bq == 0 and CS % rows_bq == 0, "the slot backward's blocks must divide the chunk"
    BR = max(16, next_power_of_2(bq * G))
    rows_br = max(16, next_power_of_2(rows_bq * G))
    sprec = slot_precision(p.q.dtype, M)
    gprec = gradient_precision(sprec)
    cols = min(settings.columns, D)
    strides = batch_strides(p, do)
    shape = dict(HQ=HQ, H=H, GQ=G, M=M, CSZ=CS)
    blocks = dict(shape, CQB=bq, BR=BR, num_stages=_stages(settings, BR, D))

    dq = torch.empty(B, T, HQ, D, dtype=p.q.dtype, device=device)
    dbr = torch.empty(B, T, HQ, dtype=f32, device=device)
    E = torch.empty(B, H, L, M, dtype=f32, device=device)
    wk = torch.empty(B, T, HQ, M, dtype=f32, device=device)
    wv = torch.empty(B, T, HQ, M, dtype=f32, device=device)
    launch(
        _rows_kernel, (cdiv(T, rows_bq), B * H),
        p.k, p.v, do, p.log_alpha, p.mask, p.first, p.bias, sk, sv, lse, delta, logits, dq, dbr, E, wk, wv,
        *strides, T, W, n, L, float(scale), D=D, CQB=rows_bq, BR=rows_br, BT=max(16, next_power_of_2(rows_bq)),
        BD=min(64, D), PREC=p.prec, SPREC=sprec, DELTA_WHOLE=delta_whole, GPREC=gprec, num_warps=settings.warps,
        num_stages=_stages(settings, rows_br, D), **shape,
    )
    # the key and value state gradients in one array: one launch and one reverse scan for both
    both = torch.empty(2, B, H, n, M, D, dtype=f32, device=device)
    launch(
        _state_grad_kernel, (n, B * H, 2 * D // cols),
        p.q, wk, do, wv, p.log_alpha, p.mask, both, p.q.stride(0), p.log_alpha.stride(0), T, W, n,
        DX=D, BD=cols, SPREC=sprec, num_warps=settings.warps, **blocks,
    )
    rk, rv = reverse_scan(p.settings, both, dec).unbind(0)
    merged = cols == D and M <= settings.keys_gate_slots  # all columns and slots in one program
    fold = dv_window is not None and merged
    dk = torch.empty(B, T, H, D, dtype=p.k.dtype, device=device)
    dv = torch.empty(B, T, H, D, dtype=p.v.dtype if fold else f32, device=device)
    dA = torch.empty(B, H, L, M, dtype=f32, device=device)
    xa = torch.empty(B, H, L, M, dtype=f32, device=device)
    totals = torch.empty(B, H, M, n, dtype=f32, device=device)
    if window_ready is not None:
        window_ready()
    if merged:
        launch(
            _keys_merged_kernel, (n, B * H),
            p.q, p.k, p.v, do, wk, wv, rk, rv, p.log_alpha, p.mask, E, dk, dv, dv_window if fold else None,
            dA, xa, totals, *strides, T, W, n, L, D=D, PREC=p.prec, SPREC=sprec, GPREC=gprec,
            num_warps=settings.merged_keys_warps, **blocks,
        )
    else:
        launch(
            _keys_kernel, (n, B * H, D // cols),
            p.q, do, wk, wv, rk, rv, p.log_alpha, p.mask, dk, dv, *strides, T, W, n,
            D=D, BD=cols, SPREC=gprec, num_warps=settings.warps, **blocks,
        )
        bm = min(M, settings.keys_gate_slots)
        launch(
            _keys_da_kernel, (n, B * H, M // bm),
            p.q, p.k, p.v, do, p.log_alpha, p.mask, wk, wv, E, rk, rv, dA, xa, totals, *strides, T, W, n, L,
            D=D, BD=min(64, D), PREC=p.prec, SPREC=sprec, BM=bm, num_warps=settings.warps, **blocks,
        )
    if dv_window is not None and not fold:
        dv = torch.add(dv, dv_window, out=torch.empty_like(dv, dtype=p.v.dtype))  # the sum rounded once, one kernel
    return dq, dk, dv, _log_alpha_grad(p, dA, xa, totals), dbr.sum((0, 1)) if bias_grad else None
