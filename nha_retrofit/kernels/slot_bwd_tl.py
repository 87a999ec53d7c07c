"""Triton backward of the slot half of NHA (the same algebra as `slot_bwd.py`, which documents it).

The default slot backward on CUDA (`chunk_fwd.CONFIG["slot_backward"] = "triton"`; "torch" selects the
PyTorch form in `slot_bwd.py`, kept as the reference). Every operand of a D-sized product is taken in
column passes of BD = 64, so no [64 x 128] fp32 tile is ever live (this is what kept the first version of
this file above the H200's shared memory and spilling registers).

- `_rows_kernel`, per (BQ-token query block, kv head), rows = BQ tokens x G heads, as the forward: recomputes
  the slot logits and dP = dO . Sv_u, completes an exact delta if asked, forms dl = P (dP - delta), and
  writes dq (slot part), the slot_bias gradient (atomics), E[u] = sum_g (dl * l + P * dP) (atomics over the
  G heads), the row weights Wk = scale dl, Wv = P for the key passes, and adds the chunk's state-gradient
  contributions (scale dl exp(a_u))^T q and (P exp(a_u))^T dO into per-chunk buffers (atomics; CS / BQ blocks
  per chunk).
- `_rev_scan_kernel` (slot_bwd.py): state gradients after each chunk.
- `_keys_grad_kernel`, per (64-token stream chunk, kv head, BD columns), launched once for dk and once for
  dv: dX = to_end R + sum over the chunk's query blocks of (slot-weighted W, causal)^T Y.
- `_keys_da_kernel`, per (chunk, kv head): d/dA = E - s (<dK~, k> + <dV~, v>) and the alpha term; a reverse
  cumulative sum in PyTorch finishes dlog_alpha.
Inside a query block the tokens' slot weights exp(a_u - a_j) s_j are formed directly (loops of BQ rank-1
updates, as the forward), so no decay overflows; tokens before the block use exp(a_u - a_ref) exp(a_ref - a_j),
both <= 1. The row weights Wk, Wv are stored without decay factors.
fp32 products use CONFIG["slot_bwd_precision"] (3xTF32 by default: plain TF32 broke the log_alpha gradient,
NOTES.md v2); products of two bf16/fp16 operands are exact in fp32 accumulation.
"""

import torch
import triton
import triton.language as tl

from .chunk_fwd import (CONFIG, CS, _block_split, _block_token_decay, _query_rows, _row_decay, _row_stats, alloc, launched,
                        slot_states)
from .slot_bwd import reverse_scan, suffix_sum

BD = 64  # columns per pass over D
BQ = 8  # query tokens per row block (16 spills 4.5 KB of registers at D=128, 8 warps; 8 spills 0.8 KB)


@triton.jit
def _chunk_gates(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, limit_u,
                 M: tl.constexpr, CSZ: tl.constexpr):
    """Masked gates of the stream chunk starting at cs0 (positions u < limit_u), their cumsum, validity."""
    offs_u = tl.arange(0, CSZ)
    u = cs0 + offs_u
    j = u - W
    jv = (j >= 0) & (j < T - W) & (u < limit_u)
    jreal = tl.load(MASK + b * T + j, mask=jv, other=0) > 0
    jr = jv & jreal
    offs_m = tl.arange(0, M)
    g = tl.load(G + b * sg_b + j[:, None].to(tl.int64) * sg_t + h * sg_h + offs_m[None, :],
                mask=jr[:, None], other=0.0).to(tl.float32)
    return g, tl.cumsum(g, axis=0), j, jr


@triton.jit
def _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H: tl.constexpr, M: tl.constexpr, CSZ: tl.constexpr,
                BD: tl.constexpr):
    """A keys-side program (axes: stream chunk c, batch x kv head, BD columns): its gates g, their cumsum a,
    positions j, write weights s of its valid tokens, and to_end = s exp(a_end - a) (the decay to its end)."""
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    d0 = tl.program_id(2) * BD
    b = pid_bh // H
    h = pid_bh % H
    cs0 = c * CSZ
    offs_c = d0 + tl.arange(0, BD)
    g, a, j, jr = _chunk_gates(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, cs0 + CSZ, M, CSZ)
    s = tl.where(jr[:, None], 1.0 - tl.exp(g), 0.0)
    to_end = s * tl.exp(tl.sum(g, 0)[None, :] - a)
    return c, pid_bh, b, h, cs0, offs_c, g, a, j, s, to_end


@triton.jit
def _row_lanes(h, GQ: tl.constexpr, CQB: tl.constexpr, BR: tl.constexpr):
    """The BR rows of a CQB-token query block: token r // GQ, query head hq, whether the row exists."""
    r = tl.arange(0, BR)
    return r, r // GQ, h * GQ + r % GQ, r < CQB * GQ


@triton.jit
def _row_block(G, MASK, WA, WB, b, h, sg_b, sg_t, sg_h, g, a, s, cs0, off, r, tok, hq, rok, T, W,
               HQ: tl.constexpr, GQ: tl.constexpr, M: tl.constexpr, CQB: tl.constexpr, CSZ: tl.constexpr,
               LIMIT: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    """Query block at chunk offset off: tokens t, valid rows tv, the causal mask [rows, CS], the gates before
    it (a_ref), the factored weights kw (`_block_split`: the chunk's tokens before the block, and inside it
    unless `direct`), the rows' [rows, M] weights from WA (if A) and WB (if B; zeros where not loaded), their
    decays a_in from the block start, and `direct` (the block's tokens need direct weights)."""
    offs_u = tl.arange(0, CSZ)
    t = cs0 + off + tok
    tv = rok & (t < T)
    causal = (offs_u[None, :] <= (off + tok)[:, None]) & tv[:, None]
    a_ref, factored, direct = _block_split(g, off, CQB, CSZ, LIMIT)
    kw = tl.where(factored[:, None], s * tl.exp(a_ref[None, :] - a), 0.0)
    w_off = ((b * T + t).to(tl.int64) * HQ + hq)[:, None] * M + tl.arange(0, M)[None, :]
    wa = tl.zeros(w_off.shape, dtype=tl.float32)
    wb = tl.zeros(w_off.shape, dtype=tl.float32)
    if A:
        wa = tl.load(WA + w_off, mask=tv[:, None], other=0.0)
    if B:
        wb = tl.load(WB + w_off, mask=tv[:, None], other=0.0)
    a_in = _row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, t, tv & (r % GQ == 0), T, W, M)
    return t, tv, causal, a_ref, kw, wa, wb, a_in, direct


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
        ba = tl.where(causal, tl.dot(wa * e_in, tl.trans(kw), input_precision=SPREC), 0.0)
    if B:
        bb = tl.where(causal, tl.dot(wb * e_in, tl.trans(kw), input_precision=SPREC), 0.0)
    if direct:
        cum = tl.zeros([M], dtype=tl.float32)
        for jj in range(CQB):
            e_j, s_j, cum = _block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum, a_in,
                                               tok >= jj, M)
            col = offs_u[None, :] == off + jj
            if A:
                ba = tl.where(col, tl.sum(wa * e_j * s_j[None, :], 1)[:, None], ba)
            if B:
                bb = tl.where(col, tl.sum(wb * e_j * s_j[None, :], 1)[:, None], bb)
    return ba, bb


@triton.jit
def _load_rows(Y, b, t, hq, tv, sy_b, sy_t, DX: tl.constexpr, offs_c):
    """Y[b, t, hq, offs_c] of the block's rows (0 where a row is out)."""
    return tl.load(Y + (b * sy_b + t.to(tl.int64) * sy_t + hq * DX)[:, None] + offs_c[None, :], mask=tv[:, None],
                   other=0.0)


@triton.jit
def _store_keys(OUT, acc, b, j, h, so_b, so_t, so_h, offs_c, T, W):
    """OUT[b, j, h, offs_c] = acc for the chunk's positions j in the stream."""
    jv = (j >= 0) & (j < T - W)
    tl.store(OUT + (b * so_b + j.to(tl.int64) * so_t + h * so_h)[:, None] + offs_c[None, :], acc, mask=jv[:, None])


@triton.jit
def _rows_kernel(
    Q, K, V, DO, G, MASK, FIRST, BIAS, SK, SV, LSE, DELTA,
    DQ, DB, E, WK, WV, CK, CV,
    sq_b, sq_t, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, so_b, so_t,
    T, W, NCH, L, scale,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, SPREC: tl.constexpr, EXACT_DELTA: tl.constexpr, V5: tl.constexpr, LIMIT: tl.constexpr,
):
    """The rows kernel of v4 (V5 False) and v5 (V5 True). The v5 differences:
    products with a bf16 operand split as `_dot_xa` / `_dot_xb`; the slot_bias gradient stored per row in DB
    (v4: added per query head with atomics); E summed over a token's heads in the program and stored (v4:
    atomics); no state-gradient contributions (CK, CV unused; `_state_grad_v5_kernel` forms them). BT (v5): a
    power of two >= CQB, the tokens of the E product."""
    pid_bh, b, h, t0, r, tok, t, tv, hq = _query_rows(T, H, GQ, CQB, BR)
    offs_c = tl.arange(0, BD)
    offs_m = tl.arange(0, M)
    q_real = tl.load(MASK + b * T + t, mask=tv, other=0) > 0
    first = tl.load(FIRST + b)
    readable = tv & q_real & (t - W >= first)
    row = b * sq_b + t.to(tl.int64) * sq_t + hq * D
    orow = b * so_b + t.to(tl.int64) * so_t + hq * DV
    lrow, lse, delta = _row_stats(LSE, DELTA, b, t, hq, tv, T, HQ)

    c = t0 // CSZ
    cs0 = c * CSZ
    off = t0 - cs0
    offs_u = tl.arange(0, CSZ)
    g, a, j, jr = _chunk_gates(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, t0 + CQB, M, CSZ)
    causal = offs_u[None, :] <= (off + tok)[:, None]
    a_ref, factored, direct = _block_split(g, off, CQB, CSZ, LIMIT)
    kw = tl.where(jr[:, None] & factored[:, None], (1.0 - tl.exp(g)) * tl.exp(a_ref[None, :] - a), 0.0)
    a_in = _row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, t, tv & (r % GQ == 0), T, W, M)
    e_in = tl.exp(a_in)
    e_car = tl.exp(a_in + a_ref[None, :])
    krow = b * sk_b + j.to(tl.int64) * sk_t + h * sk_h
    vrow = b * sv_b + j.to(tl.int64) * sv_t + h * sv_h
    st = pid_bh.to(tl.int64) * (NCH + 1) + c

    # logits and dP, summed over column passes
    qk = tl.zeros([BR, CSZ], dtype=tl.float32)
    xc = tl.zeros([BR, M], dtype=tl.float32)
    for d0 in range(0, D, BD):
        qd = tl.load(Q + row[:, None] + d0 + offs_c[None, :], mask=tv[:, None], other=0.0)
        kd = tl.load(K + krow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        skd = tl.load(SK + st * M * D + offs_m[:, None] * D + d0 + offs_c[None, :])
        qk += tl.dot(qd, tl.trans(kd), input_precision=PREC)
        xc += _dot_x(qd.to(tl.float32), tl.trans(skd), SPREC, V5)
    ov = tl.zeros([BR, CSZ], dtype=tl.float32)
    xv = tl.zeros([BR, M], dtype=tl.float32)
    for d0 in range(0, DV, BD):
        dod = tl.load(DO + orow[:, None] + d0 + offs_c[None, :], mask=tv[:, None], other=0.0)
        vd = tl.load(V + vrow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        svd = tl.load(SV + st * M * DV + offs_m[:, None] * DV + d0 + offs_c[None, :])
        ov += tl.dot(dod, tl.trans(vd), input_precision=PREC)
        xv += _dot_x(dod.to(tl.float32), tl.trans(svd), SPREC, V5)
    x_in = tl.dot(tl.where(causal, qk, 0.0), kw, input_precision=SPREC) * e_in
    x_ov = tl.dot(tl.where(causal, ov, 0.0), kw, input_precision=SPREC) * e_in
    if direct:  # the block's own tokens: direct weights, as the forward
        cum = tl.zeros([M], dtype=tl.float32)
        for jj in range(CQB):
            e_j, s_j, cum = _block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum, a_in,
                                               tok >= jj, M)
            sel = offs_u[None, :] == off + jj
            x_in += tl.sum(tl.where(sel, qk, 0.0), 1)[:, None] * e_j * s_j[None, :]
            x_ov += tl.sum(tl.where(sel, ov, 0.0), 1)[:, None] * e_j * s_j[None, :]
    lraw = (x_in + xc * e_car) * scale
    bias = tl.load(BIAS + hq, mask=tv, other=0.0)
    p = tl.where(readable[:, None], tl.exp(lraw + bias[:, None] - lse[:, None]), 0.0)
    dp = x_ov + xv * e_car
    if EXACT_DELTA:  # DELTA holds the window share of sum P * dP: add the slot share, keep it for the window
        delta += tl.sum(p * dp, 1)
        tl.store(DELTA + lrow, delta, mask=tv)
    dl = p * (dp - delta[:, None])
    wk = dl * scale

    if V5:
        tl.store(DB + lrow, tl.sum(dl, 1), mask=tv)  # slot_bias gradient per row, summed in PyTorch
        # E per stream position: the sum over a token's G rows, as a 0/1 selection product (no atomics)
        it = tl.arange(0, BT)
        pick = ((tok[None, :] == it[:, None]) & tv[None, :]).to(tl.float32)  # [BT, BR]
        etok = _dot_xa(pick, tl.where(tv[:, None], dl * lraw + p * dp, 0.0), SPREC)  # [BT, M]
        te = t0 + it
        e_off = (pid_bh.to(tl.int64) * L + te) * M
        tl.store(E + e_off[:, None] + offs_m[None, :], etok, mask=((it < CQB) & (te < T))[:, None])
    else:
        tl.atomic_add(DB + hq, tl.sum(dl, 1), mask=tv)
        # E per stream position (sum over the G heads of a token)
        e_off = (pid_bh.to(tl.int64) * L + t) * M
        tl.atomic_add(E + e_off[:, None] + offs_m[None, :], dl * lraw + p * dp, mask=tv[:, None])
    # the row weights of the key passes
    tl.store(WK + lrow[:, None] * M + offs_m[None, :], wk, mask=tv[:, None])
    tl.store(WV + lrow[:, None] * M + offs_m[None, :], p, mask=tv[:, None])

    # dq (slot part) and (v4) the contributions to the gradient w.r.t. the state before chunk c
    bk = tl.where(causal, tl.dot(wk * e_in, tl.trans(kw), input_precision=SPREC), 0.0)
    if direct:
        cum = tl.zeros([M], dtype=tl.float32)
        for jj in range(CQB):
            e_j, s_j, cum = _block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum, a_in,
                                               tok >= jj, M)
            bk = tl.where(offs_u[None, :] == off + jj, tl.sum(wk * e_j * s_j[None, :], 1)[:, None], bk)
    wc = wk * e_car
    if V5:
        for d0 in range(0, D, BD):
            kd = tl.load(K + krow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
            skd = tl.load(SK + st * M * D + offs_m[:, None] * D + d0 + offs_c[None, :])
            dq = tl.dot(wc, skd, input_precision=SPREC) + _dot_xb(bk, kd.to(tl.float32), SPREC)
            tl.store(DQ + row[:, None] + d0 + offs_c[None, :], dq, mask=tv[:, None])
    else:
        cidx = pid_bh.to(tl.int64) * NCH + c
        for d0 in range(0, D, BD):
            qd = tl.load(Q + row[:, None] + d0 + offs_c[None, :], mask=tv[:, None], other=0.0)
            kd = tl.load(K + krow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
            skd = tl.load(SK + st * M * D + offs_m[:, None] * D + d0 + offs_c[None, :])
            dq = tl.dot(wc, skd, input_precision=SPREC) + tl.dot(bk, kd.to(tl.float32), input_precision=SPREC)
            tl.store(DQ + row[:, None] + d0 + offs_c[None, :], dq, mask=tv[:, None])
            ck = tl.dot(tl.trans(wc), qd.to(tl.float32), input_precision=SPREC)
            tl.atomic_add(CK + cidx * M * D + offs_m[:, None] * D + d0 + offs_c[None, :], ck)
        pc = p * e_car
        for d0 in range(0, DV, BD):
            dod = tl.load(DO + orow[:, None] + d0 + offs_c[None, :], mask=tv[:, None], other=0.0)
            cv = tl.dot(tl.trans(pc), dod.to(tl.float32), input_precision=SPREC)
            tl.atomic_add(CV + cidx * M * DV + offs_m[:, None] * DV + d0 + offs_c[None, :], cv)


@triton.jit
def _keys_grad_kernel(
    Y, WST, R, G, MASK, OUT,
    sy_b, sy_t, so_b, so_t, so_h, sg_b, sg_t, sg_h,
    T, W, NCH,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, DX: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SPREC: tl.constexpr,
    LIMIT: tl.constexpr,
):
    """OUT[j, cols] = sum_i to_end[j, i] R[i, cols] + sum_u (W_u kw^T)[u, j] Y_u[cols] for the chunk's tokens
    (dk with (Y, W, R) = (q, Wk, Rk); dv with (dO, Wv, Rv))."""
    c, pid_bh, b, h, cs0, offs_c, g, a, j, s, to_end = _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H, M, CSZ, BD)
    offs_m = tl.arange(0, M)
    rx = tl.load(R + (pid_bh.to(tl.int64) * NCH + c) * M * DX + offs_m[:, None] * DX + offs_c[None, :])
    acc = tl.dot(to_end, rx, input_precision=SPREC)
    r, tok, hq, rok = _row_lanes(h, GQ, CQB, BR)
    for blk in range(CSZ // CQB):
        off = blk * CQB
        t, tv, causal, a_ref, kw, wst, _, a_in, direct = _row_block(
            G, MASK, WST, WST, b, h, sg_b, sg_t, sg_h, g, a, s, cs0, off, r, tok, hq, rok, T, W, HQ, GQ, M, CQB, CSZ,
            LIMIT, True, False)
        bx, _ = _block_weights(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, kw, a_in, wst, wst, direct,
                               T, W, M, CQB, CSZ, SPREC, True, False)
        y = _load_rows(Y, b, t, hq, tv, sy_b, sy_t, DX, offs_c)
        acc += tl.dot(tl.trans(bx), y.to(tl.float32), input_precision=SPREC)
    _store_keys(OUT, acc, b, j, h, so_b, so_t, so_h, offs_c, T, W)


@triton.jit
def _keys_da_kernel(
    Q, K, V, DO, G, MASK, WK, WV, E, RK, RV, DA, XA,
    sq_b, sq_t, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, so_b, so_t,
    T, W, NCH, L,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
    SPREC: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr, LIMIT: tl.constexpr,
):
    """DA[u] = E[u] - s_u * UV[u] and XA[u] = -alpha_u * UV[u], UV[u] = <dK~_u, k_u> + <dV~_u, v_u>, for the
    slots m0 .. m0 + BM - 1 of program axis 2 (every term is per slot: the slot blocks are independent).
    SPLIT (v5): the k . Rk, v . Rv products split as `_dot_xa`."""
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
    g, a, j, jr = _chunk_gates(GB, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, cs0 + CSZ, BM, CSZ)
    krow = b * sk_b + j.to(tl.int64) * sk_t + h * sk_h
    vrow = b * sv_b + j.to(tl.int64) * sv_t + h * sv_h
    cidx = pid_bh.to(tl.int64) * NCH + c
    uv = tl.zeros([CSZ, BM], dtype=tl.float32)
    for d0 in range(0, D, BD):
        kd = tl.load(K + krow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        rkd = tl.load(RK + cidx * M * D + offs_m[:, None] * D + d0 + offs_c[None, :])
        uv += _dot_x(kd.to(tl.float32), tl.trans(rkd), SPREC, SPLIT)
    for d0 in range(0, DV, BD):
        vd = tl.load(V + vrow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        rvd = tl.load(RV + cidx * M * DV + offs_m[:, None] * DV + d0 + offs_c[None, :])
        uv += _dot_x(vd.to(tl.float32), tl.trans(rvd), SPREC, SPLIT)
    uv = uv * tl.exp(tl.sum(g, 0)[None, :] - a)
    r = tl.arange(0, BR)
    tok = r // GQ
    hq = h * GQ + r % GQ
    rok = r < CQB * GQ
    for blk in range(CSZ // CQB):
        off = blk * CQB
        t = cs0 + off + tok
        tv = rok & (t < T)
        causal = (offs_u[None, :] <= (off + tok)[:, None]) & tv[:, None]
        a_ref, factored, direct = _block_split(g, off, CQB, CSZ, LIMIT)
        row = b * sq_b + t.to(tl.int64) * sq_t + hq * D
        orow = b * so_b + t.to(tl.int64) * so_t + hq * DV
        qk = tl.zeros([BR, CSZ], dtype=tl.float32)
        for d0 in range(0, D, BD):
            qd = tl.load(Q + row[:, None] + d0 + offs_c[None, :], mask=tv[:, None], other=0.0)
            kd = tl.load(K + krow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
            qk += tl.dot(qd, tl.trans(kd), input_precision=PREC)
        ov = tl.zeros([BR, CSZ], dtype=tl.float32)
        for d0 in range(0, DV, BD):
            dod = tl.load(DO + orow[:, None] + d0 + offs_c[None, :], mask=tv[:, None], other=0.0)
            vd = tl.load(V + vrow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
            ov += tl.dot(dod, tl.trans(vd), input_precision=PREC)
        w_off = ((b * T + t).to(tl.int64) * HQ + hq)[:, None] * M + offs_m[None, :]
        wk = tl.load(WK + w_off, mask=tv[:, None], other=0.0)
        wv = tl.load(WV + w_off, mask=tv[:, None], other=0.0)
        a_in = _row_decay(GB, MASK, b, h, sg_b, sg_t, sg_h, t, tv & (r % GQ == 0), T, W, BM)
        e_in = tl.exp(a_in)
        intra = (tl.dot(tl.trans(tl.where(causal, qk, 0.0)), wk * e_in, input_precision=SPREC)
                 + tl.dot(tl.trans(tl.where(causal, ov, 0.0)), wv * e_in, input_precision=SPREC))
        uv += intra * tl.where(factored[:, None], tl.exp(a_ref[None, :] - a), 0.0)
        if direct:  # the block's own tokens
            cum = tl.zeros([BM], dtype=tl.float32)
            for jj in range(CQB):
                e_j, s_j, cum = _block_token_decay(GB, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum,
                                                   a_in, tok >= jj, BM)
                sel = offs_u[None, :] == off + jj
                row_j = tl.sum((tl.sum(tl.where(sel, qk, 0.0), 1)[:, None] * wk
                                + tl.sum(tl.where(sel, ov, 0.0), 1)[:, None] * wv) * e_j, 0)
                uv += tl.where(offs_u[:, None] == off + jj, row_j[None, :], 0.0)
    u = cs0 + offs_u
    e_off = (pid_bh.to(tl.int64) * L + u) * M
    e = tl.load(E + e_off[:, None] + offs_m[None, :], mask=(u < T)[:, None], other=0.0)
    s = tl.where(jr[:, None], 1.0 - tl.exp(g), 0.0)
    tl.store(DA + e_off[:, None] + offs_m[None, :], e - s * uv)
    tl.store(XA + e_off[:, None] + offs_m[None, :], tl.where(jr[:, None], -tl.exp(g) * uv, 0.0))


def slot_bwd_precision(prec):
    """Precision of the fp32 products of the slot backward: IEEE for fp32 inputs, else
    CONFIG["slot_bwd_precision"] (3xTF32 by default)."""
    return "ieee" if prec == "ieee" else CONFIG.get("slot_bwd_precision", "tf32x3")


def _recomputed_states(p):
    """(Sk, Sv, per-chunk decay) before each chunk, when the forward did not keep them."""
    sk, dec = slot_states(p.k, p.log_alpha, p.mask, p.W, p.nch, p.prec, return_decay=True)
    return sk, slot_states(p.v, p.log_alpha, p.mask, p.W, p.nch, p.prec), dec


def _strides(p, do):
    """The gate strides and the (q, k, v, gates, dO) strides that the rows and keys_da kernels take."""
    sg = (p.log_alpha.stride(0), p.log_alpha.stride(1), p.log_alpha.stride(2))
    return sg, (p.q.stride(0), p.q.stride(1), p.k.stride(0), p.k.stride(1), p.k.stride(2),
                p.v.stride(0), p.v.stride(1), p.v.stride(2), *sg, do.stride(0), do.stride(1))


def _log_alpha_grad(p, dA, xa):
    """d log_alpha [B, T, H, M] from the keys_da outputs [B, H, L, M] over stream positions u = j + W: the
    suffix sum of dA plus xa, shifted back by the window; padding rows get none."""
    T, W = p.T, p.W
    dga = suffix_sum(dA, 2) + xa
    dla = torch.zeros(p.B, T, p.H, p.M, dtype=torch.float32, device=dA.device)
    if T > W:
        dla[:, : T - W] = dga[:, :, W:T].permute(0, 2, 1, 3)
    return dla * p.mask.bool()[:, :, None, None]


def slot_backward_triton(p, do, lse, delta, scale, exact_delta=False, states=None):
    """Same outputs as `slot_bwd.slot_backward`: (dq, dk, dv, dlog_alpha, dslot_bias), fp32.

    With `exact_delta`, `delta` holds the window share of sum P * dP (`window_bwd.window_delta`) and is
    completed in place with the slot share, for the window backward that follows. `states`: the forward's
    (Sk, Sv, dec), else recomputed. CONFIG["slot_backward"] = "triton_v5" runs the v5 kernels below."""
    if CONFIG.get("slot_backward") == "triton_v5":
        return slot_backward_v5(p, do, lse, delta, scale, exact_delta, states)
    B, T, HQ, D, H, M, DV, G, W = p.B, p.T, p.HQ, p.D, p.H, p.M, p.DV, p.G, p.W
    n = p.nch
    L = n * CS
    dev = do.device
    f32 = torch.float32
    do = do.contiguous()
    sk, sv, dec = states if states is not None else _recomputed_states(p)
    dq = alloc(B, T, HQ, D, dtype=f32, device=dev)
    dbias = torch.zeros(HQ, dtype=f32, device=dev)
    E = torch.zeros(B, H, L, M, dtype=f32, device=dev)
    wk = alloc(B, T, HQ, M, dtype=f32, device=dev)
    wv = alloc(B, T, HQ, M, dtype=f32, device=dev)
    ck = torch.zeros(B, H, n, M, D, dtype=f32, device=dev)
    cv = torch.zeros(B, H, n, M, DV, dtype=f32, device=dev)
    BR = max(16, triton.next_power_of_2(BQ * G))
    bd_ = min(BD, D, DV)
    sprec = slot_bwd_precision(p.prec)
    sg, strides = _strides(p, do)
    limit = CONFIG["block_factor_limit"]
    meta = dict(HQ=HQ, H=H, GQ=G, D=D, DV=DV, M=M, CQB=BQ, CSZ=CS, BR=BR, BD=bd_, PREC=p.prec, SPREC=sprec,
                LIMIT=limit, num_warps=8, num_stages=1)
    _rows_kernel[(triton.cdiv(T, BQ), B * H)](
        p.q, p.k, p.v, do, p.log_alpha, p.mask, p.first, p.bias, sk, sv, lse, delta,
        dq, dbias, E, wk, wv, ck, cv, *strides, T, W, n, L, float(scale), BT=BR, EXACT_DELTA=exact_delta, V5=False,
        **meta,
    )
    launched("slot bwd rows")
    rk, rv = reverse_scan(ck, dec), reverse_scan(cv, dec)
    dk = torch.zeros(B, T, H, D, dtype=f32, device=dev)
    dv = torch.zeros(B, T, H, DV, dtype=f32, device=dev)
    gmeta = dict(HQ=HQ, H=H, GQ=G, M=M, CQB=BQ, CSZ=CS, BR=BR, BD=bd_, SPREC=sprec, LIMIT=limit,
                 num_warps=8, num_stages=1)
    for y, wst, rx, out, dx in ((p.q, wk, rk, dk, D), (do, wv, rv, dv, DV)):
        _keys_grad_kernel[(n, B * H, dx // bd_)](
            y, wst, rx, p.log_alpha, p.mask, out, y.stride(0), y.stride(1), out.stride(0), out.stride(1),
            out.stride(2), *sg, T, W, n, DX=dx, **gmeta,
        )
        launched("slot bwd keys_grad")
    dA = alloc(B, H, L, M, dtype=f32, device=dev)
    xa = alloc(B, H, L, M, dtype=f32, device=dev)
    bm = min(M, CONFIG.get("keys_da_slots") or M)  # slots per program (M=128: two programs of 64)
    _keys_da_kernel[(n, B * H, M // bm)](
        p.q, p.k, p.v, do, p.log_alpha, p.mask, wk, wv, E, rk, rv, dA, xa, *strides, T, W, n, L, BM=bm, SPLIT=False,
        **meta,
    )
    launched("slot bwd keys_da")
    return dq, dk, dv, _log_alpha_grad(p, dA, xa), dbias


# ---------------------------------------------------------------------------------------------------------------
# v5 (CONFIG["slot_backward"] = "triton_v5"): the same algebra, no atomics, merged key kernels, split precision.
#
# - `_rows_kernel` with V5: without the state-gradient contributions (CK, CV) and without atomics:
#   E is summed over a token's G heads inside the program (a 0/1 selection product) and stored; the slot_bias
#   gradient is stored per row and summed in PyTorch.
# - `_state_grad_v5_kernel`, per (chunk, kv head, BD columns): CK / CV of the chunk as one accumulated product
#   over its row blocks (plain stores; the row weights from WK / WV and the gates).
# - `_keys_v5_kernel`, per (chunk, kv head, BD columns): dk and dv together (the in-block decays built once
#   for both; `_keys_grad_kernel` ran twice and built them per launch).
# - `_keys_da_kernel` with SPLIT: the split products below.
# Products with one operand that is bf16/fp16 (exact in TF32: q, k, v, dO, 0/1 selections) take two TF32
# MMAs on a hi/lo split of the fp32 operand (`_dot_xa`, `_dot_xb`) instead of 3xTF32's three: the same
# accuracy (3xTF32's third MMA multiplies the bf16 operand's low part, which is zero). Products of two fp32
# operands keep CONFIG["slot_bwd_precision"].
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _tf32_hi(x):
    """x with the 13 low mantissa bits cleared (exact in TF32); x - _tf32_hi(x) is exact in fp32."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _dot_xb(a, b, SPREC: tl.constexpr):
    """a . b for fp32 a and an fp32 b whose values are exact in TF32 (bf16/fp16 upcasts, 0/1)."""
    if SPREC == "tf32x3":
        hi = _tf32_hi(a)
        return tl.dot(hi, b, tl.dot(a - hi, b, input_precision="tf32"), input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision=SPREC)


@triton.jit
def _dot_xa(a, b, SPREC: tl.constexpr):
    """a . b for an fp32 a whose values are exact in TF32 and fp32 b."""
    if SPREC == "tf32x3":
        hi = _tf32_hi(b)
        return tl.dot(a, hi, tl.dot(a, b - hi, input_precision="tf32"), input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision=SPREC)


@triton.jit
def _dot_x(a, b, SPREC: tl.constexpr, SPLIT: tl.constexpr):
    """a . b for an fp32 a whose values are exact in TF32 and fp32 b: as `_dot_xa` with SPLIT (v5), else one
    product in SPREC (v4)."""
    if SPLIT:
        return _dot_xa(a, b, SPREC)
    else:
        return tl.dot(a, b, input_precision=SPREC)


@triton.jit
def _state_grad_v5_kernel(
    Y, WST, G, MASK, C_OUT,
    sy_b, sy_t, sg_b, sg_t, sg_h,
    T, W, NCH,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, DX: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SPREC: tl.constexpr,
    LIMIT: tl.constexpr,
):
    """C_OUT[c][:, cols] = sum over the chunk's rows u of (W_u exp(a_u))^T Y_u[cols], a_u the chunk's summed
    log gates through u: the chunk's contribution to the gradient w.r.t. the state before it (CK with
    (q, Wk), CV with (dO, Wv)); `_rows_kernel` added it with atomics."""
    c, pid_bh, b, h, cs0, offs_c, g, a, j, s, to_end = _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H, M, CSZ, BD)
    offs_m = tl.arange(0, M)
    r, tok, hq, rok = _row_lanes(h, GQ, CQB, BR)
    acc = tl.zeros([M, BD], dtype=tl.float32)
    for blk in range(CSZ // CQB):
        t, tv, causal, a_ref, kw, wst, wb, a_in, _ = _row_block(
            G, MASK, WST, WST, b, h, sg_b, sg_t, sg_h, g, a, s, cs0, blk * CQB, r, tok, hq, rok, T, W, HQ, GQ, M, CQB,
            CSZ, LIMIT, True, False)
        y = _load_rows(Y, b, t, hq, tv, sy_b, sy_t, DX, offs_c)
        acc = acc + _dot_xb(tl.trans(wst * tl.exp(a_in + a_ref[None, :])), y.to(tl.float32), SPREC)
    tl.store(C_OUT + (pid_bh.to(tl.int64) * NCH + c) * M * DX + offs_m[:, None] * DX + offs_c[None, :], acc)


@triton.jit
def _keys_v5_kernel(
    Q, DO, WK, WV, RK, RV, G, MASK, DK, DV_,
    sq_b, sq_t, so_b, so_t, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h,
    T, W, NCH,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, SPREC: tl.constexpr,
    DO_K: tl.constexpr, DO_V: tl.constexpr, LIMIT: tl.constexpr,
):
    """Columns cols = BD * program axis 2 of dk (DO_K) and dv (DO_V) for the chunk's tokens:
    dX[j, cols] = sum_i to_end[j, i] R[i, cols] + sum_u (W_u kw^T)[u, j] Y_u[cols], (Y, W, R) = (q, Wk, Rk) for
    dk and (dO, Wv, Rv) for dv (`_keys_grad_kernel`, both in one pass over the row blocks)."""
    c, pid_bh, b, h, cs0, offs_c, g, a, j, s, to_end = _keys_chunk(G, MASK, sg_b, sg_t, sg_h, T, W, H, M, CSZ, BD)
    offs_m = tl.arange(0, M)
    cidx = pid_bh.to(tl.int64) * NCH + c
    acc_k = tl.zeros([CSZ, BD], dtype=tl.float32)
    acc_v = tl.zeros([CSZ, BD], dtype=tl.float32)
    if DO_K:
        acc_k = tl.dot(to_end, tl.load(RK + cidx * M * D + offs_m[:, None] * D + offs_c[None, :]),
                       input_precision=SPREC)
    if DO_V:
        acc_v = tl.dot(to_end, tl.load(RV + cidx * M * DV + offs_m[:, None] * DV + offs_c[None, :]),
                       input_precision=SPREC)
    r, tok, hq, rok = _row_lanes(h, GQ, CQB, BR)
    for blk in range(CSZ // CQB):
        off = blk * CQB
        t, tv, causal, a_ref, kw, wk, wv, a_in, direct = _row_block(
            G, MASK, WK, WV, b, h, sg_b, sg_t, sg_h, g, a, s, cs0, off, r, tok, hq, rok, T, W, HQ, GQ, M, CQB, CSZ,
            LIMIT, DO_K, DO_V)
        bk, bv = _block_weights(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, off, tok, causal, kw, a_in, wk, wv, direct,
                                T, W, M, CQB, CSZ, SPREC, DO_K, DO_V)
        if DO_K:
            acc_k += _dot_xb(tl.trans(bk), _load_rows(Q, b, t, hq, tv, sq_b, sq_t, D, offs_c).to(tl.float32), SPREC)
        if DO_V:
            acc_v += _dot_xb(tl.trans(bv), _load_rows(DO, b, t, hq, tv, so_b, so_t, DV, offs_c).to(tl.float32), SPREC)
    if DO_K:
        _store_keys(DK, acc_k, b, j, h, sk_b, sk_t, sk_h, offs_c, T, W)
    if DO_V:
        _store_keys(DV_, acc_v, b, j, h, sv_b, sv_t, sv_h, offs_c, T, W)


def v5_launch():
    """(row-block tokens, warps) of the v5 kernels: CONFIG["slot_bwd_v5_block"], CONFIG["slot_bwd_v5_warps"]."""
    return CONFIG.get("slot_bwd_v5_block") or BQ, CONFIG.get("slot_bwd_v5_warps") or 8


def slot_backward_v5(p, do, lse, delta, scale, exact_delta=False, states=None):
    """`slot_backward_triton` on the v5 kernels (same outputs and contract)."""
    B, T, HQ, D, H, M, DV, G, W = p.B, p.T, p.HQ, p.D, p.H, p.M, p.DV, p.G, p.W
    n = p.nch
    L = n * CS
    dev = do.device
    f32 = torch.float32
    do = do.contiguous()
    sk, sv, dec = states if states is not None else _recomputed_states(p)
    bq, warps = v5_launch()
    assert CS % bq == 0, "slot_bwd_v5_block must divide the chunk"
    BR = max(16, triton.next_power_of_2(bq * G))
    BT = max(16, triton.next_power_of_2(bq))
    bd_ = min(BD, D, DV)
    sprec = slot_bwd_precision(p.prec)
    dq = alloc(B, T, HQ, D, dtype=f32, device=dev)
    dbr = alloc(B, T, HQ, dtype=f32, device=dev)
    E = alloc(B, H, L, M, dtype=f32, device=dev)
    wk = alloc(B, T, HQ, M, dtype=f32, device=dev)
    wv = alloc(B, T, HQ, M, dtype=f32, device=dev)
    sg, strides = _strides(p, do)
    common = dict(HQ=HQ, H=H, GQ=G, M=M, CQB=bq, CSZ=CS, BR=BR, BD=bd_, SPREC=sprec,
                  LIMIT=CONFIG["block_factor_limit"], num_warps=warps, num_stages=1)
    _rows_kernel[(triton.cdiv(T, bq), B * H)](
        p.q, p.k, p.v, do, p.log_alpha, p.mask, p.first, p.bias, sk, sv, lse, delta,
        dq, dbr, E, wk, wv, None, None, *strides, T, W, n, L, float(scale),
        D=D, DV=DV, BT=BT, PREC=p.prec, EXACT_DELTA=exact_delta, V5=True, **common,
    )
    launched("slot bwd v5 rows")
    ck = alloc(B, H, n, M, D, dtype=f32, device=dev)
    cv = alloc(B, H, n, M, DV, dtype=f32, device=dev)
    for y, wst, out, dx in ((p.q, wk, ck, D), (do, wv, cv, DV)):
        _state_grad_v5_kernel[(n, B * H, dx // bd_)](
            y, wst, p.log_alpha, p.mask, out, y.stride(0), y.stride(1), *sg, T, W, n, DX=dx, **common,
        )
        launched("slot bwd v5 state_grad")
    rk, rv = reverse_scan(ck, dec), reverse_scan(cv, dec)
    dk = alloc(B, T, H, D, dtype=f32, device=dev)
    dv = alloc(B, T, H, DV, dtype=f32, device=dev)
    if T > W:
        kstr = (p.q.stride(0), p.q.stride(1), do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dk.stride(2),
                dv.stride(0), dv.stride(1), dv.stride(2), *sg)
        merged = D == DV and CONFIG.get("slot_bwd_v5_merge_keys", True)  # dk and dv in one program
        sides = [(True, True, D)] if merged else [(True, False, D), (False, True, DV)]
        for do_k, do_v, dx in sides:
            _keys_v5_kernel[(n, B * H, dx // bd_)](
                p.q, do, wk, wv, rk, rv, p.log_alpha, p.mask, dk, dv, *kstr, T, W, n,
                D=D, DV=DV, DO_K=do_k, DO_V=do_v, **common,
            )
            launched("slot bwd v5 keys")
    # rows of tokens j >= T - W are read by no query: zero (the keys kernel stores j < T - W only)
    dk[:, max(T - W, 0):] = 0
    dv[:, max(T - W, 0):] = 0
    dA = alloc(B, H, L, M, dtype=f32, device=dev)
    xa = alloc(B, H, L, M, dtype=f32, device=dev)
    bm = min(M, CONFIG.get("keys_da_slots") or M)
    _keys_da_kernel[(n, B * H, M // bm)](
        p.q, p.k, p.v, do, p.log_alpha, p.mask, wk, wv, E, rk, rv, dA, xa, *strides, T, W, n, L,
        D=D, DV=DV, PREC=p.prec, BM=bm, SPLIT=True, **common,
    )
    launched("slot bwd v5 keys_da")
    return dq, dk, dv, _log_alpha_grad(p, dA, xa), dbr.sum((0, 1))


def _profile(T=32768, repeats=5):
    """GPU time of each kernel of the v4 ("triton") and v5 slot backward at the Llama-3-8B attention shape
    (HQ=32, H=8, D=128, M=64, w=64, batch 1, bf16), by torch.profiler (NOTES plan step 0)."""
    from torch.profiler import ProfilerActivity, profile

    from .chunk_fwd import Prepared, forward
    from .window_bwd import window_delta

    B, HQ, H, D, M, W = 1, 32, 8, 128, 64, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)  # noqa: E731
    q, qr, k, kr, v = rnd(B, T, HQ, D), rnd(B, T, HQ, D), rnd(B, T, H, D), rnd(B, T, H, D), rnd(B, T, H, D)
    log_alpha = torch.nn.functional.logsigmoid(torch.randn(B, T, H, M, device="cuda", generator=gen) + 3)
    p = Prepared(q, k, v, qr, kr, log_alpha, W, None, torch.full((HQ,), -2.0, device="cuda"))
    o, lse, _, _ = forward(p, D**-0.5, True)
    do = rnd(*o.shape)
    delta = window_delta(p, do, lse, D**-0.5)
    saved = CONFIG["slot_backward"]
    try:
        for name in ("triton", "triton_v5"):
            CONFIG["slot_backward"] = name
            for _ in range(2):
                slot_backward_triton(p, do, lse, delta.clone(), D**-0.5, exact_delta=True)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(repeats):
                    slot_backward_triton(p, do, lse, delta.clone(), D**-0.5, exact_delta=True)
                torch.cuda.synchronize()
            print(f"# slot backward {name}, T={T}, {repeats} calls (totals over the calls)", flush=True)
            table = None
            for key in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
                try:
                    table = prof.key_averages().table(sort_by=key, row_limit=20)
                    break
                except Exception:  # noqa: BLE001 - the column names differ between torch versions
                    continue
            print(table if table is not None else prof.key_averages().table(row_limit=20), flush=True)
    finally:
        CONFIG["slot_backward"] = saved


if __name__ == "__main__":  # python -m nha_retrofit.kernels.slot_bwd_tl [T]  (GPU)
    import sys

    _profile(int(sys.argv[1]) if len(sys.argv) > 1 else 32768)
