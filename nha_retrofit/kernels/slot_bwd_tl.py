"""Triton backward of the slot half of NHA (the same algebra as `slot_bwd.py`, which documents it).

OPT-IN (`chunk_fwd.CONFIG["triton_slot_backward"] = True`): checked against the PyTorch slot backward with
the Triton interpreter on CPU (float32), NOT yet run on a GPU (the session's device time ran out).

- `_rows_kernel`, per (16-token query block, kv head), rows = 16 tokens x G heads, as the forward: recomputes
  the slot logits and dP = dO . Sv_u, forms dl = P (dP - delta), and writes dq (slot part), the slot_bias
  gradient (atomics), E[u] = sum_g (dl * l + P * dP), the row weights Wk = scale dl exp(a_u - a_ref),
  Wv = P exp(a_u - a_ref) for the key pass, and adds the chunk's state-gradient contributions
  (scale dl exp(a_u))^T q and (P exp(a_u))^T dO into per-chunk buffers (atomics; 4 blocks per chunk).
- `_rev_scan_kernel` (slot_bwd.py): state gradients after each chunk.
- `_keys_kernel`, per (64-token stream chunk, kv head): dk, dv of the chunk's tokens and
  d/dA = E - s (<dK~, k> + <dV~, v>), plus the alpha term; a reverse cumulative sum in PyTorch finishes
  dlog_alpha.
"""

import torch
import triton
import triton.language as tl

from .chunk_fwd import CQ, CS, EXP_CLAMP, slot_precision, slot_states
from .slot_bwd import reverse_scan


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
def _rows_kernel(
    Q, K, V, DO, G, MASK, FIRST, BIAS, SK, SV, LSE, DELTA,
    DQ, DB, E, WK, WV, CK, CV,
    sq_b, sq_t, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, so_b, so_t,
    T, W, NCH, L, scale,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr,
    CLAMP: tl.constexpr,
):
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
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    offs_m = tl.arange(0, M)
    q_real = tl.load(MASK + b * T + t, mask=tv, other=0) > 0
    first = tl.load(FIRST + b)
    readable = tv & q_real & (t - W >= first)
    row = b * sq_b + t.to(tl.int64) * sq_t + hq * D
    q = tl.load(Q + row[:, None] + offs_d[None, :], mask=tv[:, None], other=0.0)
    orow = b * so_b + t.to(tl.int64) * so_t + hq * DV
    do = tl.load(DO + orow[:, None] + offs_dv[None, :], mask=tv[:, None], other=0.0)
    lrow = (b * T + t).to(tl.int64) * HQ + hq
    lse = tl.load(LSE + lrow, mask=tv, other=float("inf"))
    delta = tl.load(DELTA + lrow, mask=tv, other=0.0)

    c = t0 // CSZ
    cs0 = c * CSZ
    off = t0 - cs0
    offs_u = tl.arange(0, CSZ)
    g, a, j, jr = _chunk_gates(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, t0 + CQB, M, CSZ)
    ul = off + tok
    causal = offs_u[None, :] <= ul[:, None]
    a_ref = tl.sum(tl.where(offs_u[:, None] < off, g, 0.0), 0)
    a_row = tl.dot(causal.to(tl.float32), g, input_precision="ieee")
    kw = tl.where(jr[:, None], (1.0 - tl.exp(g)) * tl.exp(tl.minimum(a_ref[None, :] - a, CLAMP)), 0.0)
    e_in = tl.exp(a_row - a_ref[None, :])
    e_car = tl.exp(a_row)
    kj = tl.load(K + b * sk_b + j[:, None].to(tl.int64) * sk_t + h * sk_h + offs_d[None, :],
                 mask=jr[:, None], other=0.0)
    vj = tl.load(V + b * sv_b + j[:, None].to(tl.int64) * sv_t + h * sv_h + offs_dv[None, :],
                 mask=jr[:, None], other=0.0)
    st = pid_bh.to(tl.int64) * (NCH + 1) + c
    sk = tl.load(SK + st * M * D + offs_m[:, None] * D + offs_d[None, :])
    sv = tl.load(SV + st * M * DV + offs_m[:, None] * DV + offs_dv[None, :])

    qk = tl.where(causal, tl.dot(q, tl.trans(kj), input_precision=PREC), 0.0)
    lraw = (tl.dot(qk, kw, input_precision=SPREC) * e_in
            + tl.dot(q.to(tl.float32), tl.trans(sk), input_precision=SPREC) * e_car) * scale
    bias = tl.load(BIAS + hq, mask=tv, other=0.0)
    p = tl.where(readable[:, None], tl.exp(lraw + bias[:, None] - lse[:, None]), 0.0)
    ov = tl.where(causal, tl.dot(do, tl.trans(vj), input_precision=PREC), 0.0)
    dp = (tl.dot(ov, kw, input_precision=SPREC) * e_in
          + tl.dot(do.to(tl.float32), tl.trans(sv), input_precision=SPREC) * e_car)
    dl = p * (dp - delta[:, None])
    wk = dl * scale

    # dq (slot part)
    bk = tl.where(causal, tl.dot(wk * e_in, tl.trans(kw), input_precision=SPREC), 0.0)
    dq = tl.dot(wk * e_car, sk, input_precision=SPREC) + tl.dot(bk, kj.to(tl.float32), input_precision=SPREC)
    tl.store(DQ + row[:, None] + offs_d[None, :], dq, mask=tv[:, None])
    # slot_bias
    tl.atomic_add(DB + hq, tl.sum(dl, 1), mask=tv)
    # E per stream position (sum over the G heads of a token) and the row weights of the key pass
    offs_c = tl.arange(0, CQB)
    expand = (tok[None, :] == offs_c[:, None]) & tv[None, :]  # [CQ, BR]
    e_tok = tl.dot(expand.to(tl.float32), dl * lraw + p * dp, input_precision="ieee")
    uc = t0 + offs_c
    e_off = (pid_bh.to(tl.int64) * L + uc) * M
    tl.store(E + e_off[:, None] + offs_m[None, :], e_tok, mask=(uc < T)[:, None])
    w_off = lrow * M
    tl.store(WK + w_off[:, None] + offs_m[None, :], wk * e_in, mask=tv[:, None])
    tl.store(WV + w_off[:, None] + offs_m[None, :], p * e_in, mask=tv[:, None])
    # contributions to the gradient w.r.t. the state before chunk c
    ck = tl.dot(tl.trans(wk * e_car), q.to(tl.float32), input_precision=SPREC)
    cv = tl.dot(tl.trans(p * e_car), do.to(tl.float32), input_precision=SPREC)
    cidx = pid_bh.to(tl.int64) * NCH + c
    tl.atomic_add(CK + cidx * M * D + offs_m[:, None] * D + offs_d[None, :], ck)
    tl.atomic_add(CV + cidx * M * DV + offs_m[:, None] * DV + offs_dv[None, :], cv)


@triton.jit
def _keys_kernel(
    Q, K, V, DO, G, MASK, WK, WV, E, RK, RV,
    DK, DVO, DA, XA,
    sq_b, sq_t, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, so_b, so_t,
    T, W, NCH, L,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr,
    CLAMP: tl.constexpr,
):
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    cs0 = c * CSZ
    offs_u = tl.arange(0, CSZ)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    offs_m = tl.arange(0, M)
    g, a, j, jr = _chunk_gates(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, cs0 + CSZ, M, CSZ)
    a_last = tl.sum(g, 0)
    s = tl.where(jr[:, None], 1.0 - tl.exp(g), 0.0)
    kj = tl.load(K + b * sk_b + j[:, None].to(tl.int64) * sk_t + h * sk_h + offs_d[None, :],
                 mask=jr[:, None], other=0.0)
    vj = tl.load(V + b * sv_b + j[:, None].to(tl.int64) * sv_t + h * sv_h + offs_dv[None, :],
                 mask=jr[:, None], other=0.0)
    cidx = pid_bh.to(tl.int64) * NCH + c
    rk = tl.load(RK + cidx * M * D + offs_m[:, None] * D + offs_d[None, :])
    rv = tl.load(RV + cidx * M * DV + offs_m[:, None] * DV + offs_dv[None, :])
    to_end = s * tl.exp(a_last[None, :] - a)
    dk = tl.dot(to_end, rk, input_precision=SPREC)
    dv = tl.dot(to_end, rv, input_precision=SPREC)
    uv = (tl.dot(kj.to(tl.float32), tl.trans(rk), input_precision=SPREC)
          + tl.dot(vj.to(tl.float32), tl.trans(rv), input_precision=SPREC)) * tl.exp(a_last[None, :] - a)
    r = tl.arange(0, BR)
    tok = r // GQ
    hq = h * GQ + r % GQ
    rok = r < CQB * GQ
    for blk in range(CSZ // CQB):
        t = cs0 + blk * CQB + tok
        tv = rok & (t < T)
        off = blk * CQB
        ul = off + tok
        causal = (offs_u[None, :] <= ul[:, None]) & tv[:, None]
        a_ref = tl.sum(tl.where(offs_u[:, None] < off, g, 0.0), 0)
        # the forward's intra factors of this block: only tokens up to the block's end
        kw = tl.where((offs_u < off + CQB)[:, None], s * tl.exp(tl.minimum(a_ref[None, :] - a, CLAMP)), 0.0)
        eneg = tl.exp(tl.minimum(a_ref[None, :] - a, CLAMP))
        row = b * sq_b + t.to(tl.int64) * sq_t + hq * D
        q = tl.load(Q + row[:, None] + offs_d[None, :], mask=tv[:, None], other=0.0)
        orow = b * so_b + t.to(tl.int64) * so_t + hq * DV
        do = tl.load(DO + orow[:, None] + offs_dv[None, :], mask=tv[:, None], other=0.0)
        w_off = ((b * T + t).to(tl.int64) * HQ + hq) * M
        wk = tl.load(WK + w_off[:, None] + offs_m[None, :], mask=tv[:, None], other=0.0)
        wv = tl.load(WV + w_off[:, None] + offs_m[None, :], mask=tv[:, None], other=0.0)
        bk = tl.where(causal, tl.dot(wk, tl.trans(kw), input_precision=SPREC), 0.0)  # [BR, CS]
        bv = tl.where(causal, tl.dot(wv, tl.trans(kw), input_precision=SPREC), 0.0)
        dk += tl.dot(tl.trans(bk), q.to(tl.float32), input_precision=SPREC)
        dv += tl.dot(tl.trans(bv), do.to(tl.float32), input_precision=SPREC)
        qk = tl.where(causal, tl.dot(q, tl.trans(kj), input_precision=PREC), 0.0)
        ov = tl.where(causal, tl.dot(do, tl.trans(vj), input_precision=PREC), 0.0)
        uv += (tl.dot(tl.trans(qk), wk, input_precision=SPREC)
               + tl.dot(tl.trans(ov), wv, input_precision=SPREC)) * tl.where(
                   (offs_u < off + CQB)[:, None], eneg, 0.0)
    u = cs0 + offs_u
    e_off = (pid_bh.to(tl.int64) * L + u) * M
    e = tl.load(E + e_off[:, None] + offs_m[None, :])
    tl.store(DA + e_off[:, None] + offs_m[None, :], e - s * uv)
    tl.store(XA + e_off[:, None] + offs_m[None, :], tl.where(jr[:, None], -tl.exp(g) * uv, 0.0))
    krow = b * sk_b + j.to(tl.int64) * sk_t + h * sk_h
    vrow = b * sv_b + j.to(tl.int64) * sv_t + h * sv_h
    jv = (j >= 0) & (j < T - W)
    tl.store(DK + krow[:, None] + offs_d[None, :], dk, mask=jv[:, None])
    tl.store(DVO + vrow[:, None] + offs_dv[None, :], dv, mask=jv[:, None])


def slot_backward_triton(p, do, lse, delta, scale):
    """Same outputs as `slot_bwd.slot_backward`: (dq, dk, dv, dlog_alpha, dslot_bias), fp32."""
    B, T, HQ, D, H, M, DV, G, W = p.B, p.T, p.HQ, p.D, p.H, p.M, p.DV, p.G, p.W
    n = p.nch
    L = n * CS
    dev = do.device
    f32 = torch.float32
    do = do.contiguous()
    sk, dec = slot_states(p.k, p.log_alpha, p.mask, W, n, p.prec, return_decay=True)
    sv = slot_states(p.v, p.log_alpha, p.mask, W, n, p.prec)
    dq = torch.zeros(B, T, HQ, D, dtype=f32, device=dev)
    dbias = torch.zeros(HQ, dtype=f32, device=dev)
    E = torch.zeros(B, H, L, M, dtype=f32, device=dev)
    wk = torch.zeros(B, T, HQ, M, dtype=f32, device=dev)
    wv = torch.zeros(B, T, HQ, M, dtype=f32, device=dev)
    ck = torch.zeros(B, H, n, M, D, dtype=f32, device=dev)
    cv = torch.zeros(B, H, n, M, DV, dtype=f32, device=dev)
    BR = max(16, triton.next_power_of_2(CQ * G))
    sprec = slot_precision(p.prec)
    strides = (p.q.stride(0), p.q.stride(1), p.k.stride(0), p.k.stride(1), p.k.stride(2),
               p.v.stride(0), p.v.stride(1), p.v.stride(2),
               p.log_alpha.stride(0), p.log_alpha.stride(1), p.log_alpha.stride(2), do.stride(0), do.stride(1))
    meta = dict(HQ=HQ, H=H, GQ=G, D=D, DV=DV, M=M, CQB=CQ, CSZ=CS, BR=BR, PREC=p.prec, SPREC=sprec,
                CLAMP=EXP_CLAMP, num_warps=8 if BR * D >= 64 * 128 else 4)
    _rows_kernel[(triton.cdiv(T, CQ), B * H)](
        p.q, p.k, p.v, do, p.log_alpha, p.mask, p.first, p.bias, sk, sv, lse, delta,
        dq, dbias, E, wk, wv, ck, cv, *strides, T, W, n, L, float(scale), **meta,
    )
    rk, rv = reverse_scan(ck, dec), reverse_scan(cv, dec)
    dk = torch.zeros(B, T, H, D, dtype=f32, device=dev)
    dv = torch.zeros(B, T, H, DV, dtype=f32, device=dev)
    dA = torch.zeros(B, H, L, M, dtype=f32, device=dev)
    xa = torch.zeros(B, H, L, M, dtype=f32, device=dev)
    _keys_kernel[(n, B * H)](
        p.q, p.k, p.v, do, p.log_alpha, p.mask, wk, wv, E, rk, rv, dk, dv, dA, xa,
        *strides, T, W, n, L, **meta,
    )
    dga = dA.flip(2).cumsum(2).flip(2) + xa  # [B, H, L, M] over stream positions u = j + W
    dla = torch.zeros(B, T, H, M, dtype=f32, device=dev)
    if T > W:
        dla[:, : T - W] = dga[:, :, W:T].permute(0, 2, 1, 3)
    dla = dla * p.mask.bool()[:, :, None, None]
    return dq, dk, dv, dla, dbias
