"""Triton backward of the sliding-window half of NHA, flash style, fed the JOINT log-sum-exp L (slots and
window under one softmax) and delta = sum P * dP = rowsum(dO * O): p = exp(s - L), ds = p * (dO . v - delta).

Two kernels: `_dq_kernel` per query block (rows = 16 tokens x G query heads of one kv head) and
`_dkv_kernel` per key block, looping over the query blocks that see it (keys j are seen by t in j .. j+W-1).
delta must be exact (sum P * dP as the backward forms P and dP; rowsum(dO * O) of the rounded bf16 output is
~2e-3 off, which the slot_bias gradient, a cancellation, does not survive). Two ways:
- after a training forward with slots and a window (its output is exact: `residual.py`), `window_dq` runs first
  and its kernel forms delta = rowsum(dO * O) for every kernel after it;
- else `window_delta` runs `_dq_kernel` in a delta mode first (the window share; the slot backward adds the
  slot share).
"""

import torch
import triton
import triton.language as tl

from ...utils.launch import cdiv, launch, next_power_of_2
from .chunk_inputs import batch_strides
from .residual import with_residual
from .rows import query_rows, real, row_stats, token_strides


@triton.jit
def _dq_kernel(
    QR, KR, V, DO, O, ORES, LSE, DELTA, MASK, DQR,
    sq_b, sk_b, sv_b, so_b, T, W, scale,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    CQB: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, DELTA_ONLY: tl.constexpr,
):
    """dq_rope of the window part; with DELTA_ONLY, instead DELTA[row] = sum_j p_j (dO . v_j) (its window
    share of an exact delta = sum P * dP; the slot backward adds the slot share). With O (the forward's output,
    ORES its int8 rounding residual or None for fp32: `residual.with_residual`), first DELTA[row] = rowsum(dO * O),
    the whole delta."""
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = token_strides(HQ, H, D, DV)  # (dq_rope, dk_rope, dv: as q, k, v)
    pid_bh, b, h, t0, r, tok, t, tv, hq = query_rows(T, H, GQ, CQB, BR)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    row = b * sq_b + t.to(tl.int64) * sq_t + hq * D
    orow = b * so_b + t.to(tl.int64) * so_t + hq * DV
    lrow, lse, delta = row_stats(LSE, DELTA if O is None else None, b, t, hq, tv, T, HQ)
    qr = tl.load(QR + row[:, None] + offs_d[None, :], mask=tv[:, None], other=0.0)
    do = tl.load(DO + orow[:, None] + offs_dv[None, :], mask=tv[:, None], other=0.0)
    if O is not None:  # its loads go out with q_rope's and dO's (0.035 ms less per 32K step than column passes
        # before them)
        out = tl.load(O + orow[:, None] + offs_dv[None, :], mask=tv[:, None], other=0.0)
        if ORES is not None:
            out = with_residual(out, tl.load(ORES + orow[:, None] + offs_dv[None, :], mask=tv[:, None], other=0))
        delta = tl.sum(do.to(tl.float32) * out.to(tl.float32), 1)
        tl.store(DELTA + lrow, delta, mask=tv)
    dq = tl.zeros([BR, D], dtype=tl.float32)
    dsum = tl.zeros([BR], dtype=tl.float32)
    lo = tl.maximum(t0 - W + 1, 0)
    hi = tl.minimum(t0 + CQB, T)
    offs_n = tl.arange(0, BN)
    for n0 in range(lo, hi, BN):
        j = n0 + offs_n
        jin = j < hi
        kr = tl.load(KR + b * sk_b + j[:, None].to(tl.int64) * sk_t + h * sk_h + offs_d[None, :],
                     mask=jin[:, None], other=0.0)
        vv = tl.load(V + b * sv_b + j[:, None].to(tl.int64) * sv_t + h * sv_h + offs_dv[None, :],
                     mask=jin[:, None], other=0.0)
        s = tl.dot(qr, tl.trans(kr), input_precision=PREC) * scale
        valid = (j[None, :] <= t[:, None]) & (j[None, :] > t[:, None] - W) & real(MASK, b, T, j, jin)[None, :]
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(vv), input_precision=PREC)
        if DELTA_ONLY:
            dsum += tl.sum(p * dp, 1)
        else:
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(kr.dtype), kr, input_precision=PREC)
    if DELTA_ONLY:
        tl.store(DELTA + lrow, dsum, mask=tv)
    else:
        tl.store(DQR + row[:, None] + offs_d[None, :], (dq * scale).to(DQR.dtype.element_ty), mask=tv[:, None])


@triton.jit
def _dkv_kernel(
    QR, KR, V, DO, LSE, DELTA, MASK, DKR, DV_,
    sq_b, sk_b, sv_b, so_b, T, W, scale,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    CQB: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):
    """dk_rope and dv of the window part for a block of BN keys, over the query blocks that see them."""
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = token_strides(HQ, H, D, DV)  # (dq_rope, dk_rope, dv: as q, k, v)
    pid_k = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    j0 = pid_k * BN
    j = j0 + tl.arange(0, BN)
    jin = j < T
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    krow = b * sk_b + j.to(tl.int64) * sk_t + h * sk_h
    vrow = b * sv_b + j.to(tl.int64) * sv_t + h * sv_h
    kr = tl.load(KR + krow[:, None] + offs_d[None, :], mask=jin[:, None], other=0.0)
    vv = tl.load(V + vrow[:, None] + offs_dv[None, :], mask=jin[:, None], other=0.0)
    key_real = real(MASK, b, T, j, jin)
    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, DV], dtype=tl.float32)
    r = tl.arange(0, BR)
    rt = r // GQ
    hq = h * GQ + r % GQ
    rok = r < CQB * GQ
    lo = (j0 // CQB) * CQB
    hi = tl.minimum(j0 + BN - 1 + W, T)
    for t0 in range(lo, hi, CQB):
        t = t0 + rt
        tv = rok & (t < T)
        row = b * sq_b + t.to(tl.int64) * sq_t + hq * D
        qr = tl.load(QR + row[:, None] + offs_d[None, :], mask=tv[:, None], other=0.0)
        orow = b * so_b + t.to(tl.int64) * so_t + hq * DV
        do = tl.load(DO + orow[:, None] + offs_dv[None, :], mask=tv[:, None], other=0.0)
        lrow, lse, delta = row_stats(LSE, DELTA, b, t, hq, tv, T, HQ)
        s = tl.dot(qr, tl.trans(kr), input_precision=PREC) * scale
        valid = (j[None, :] <= t[:, None]) & (j[None, :] > t[:, None] - W) & key_real[None, :] & tv[:, None]
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC)
        dp = tl.dot(do, tl.trans(vv), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(qr.dtype), qr, input_precision=PREC)
    tl.store(DKR + krow[:, None] + offs_d[None, :], (dk * scale).to(DKR.dtype.element_ty), mask=jin[:, None])
    tl.store(DV_ + vrow[:, None] + offs_dv[None, :], dv.to(DV_.dtype.element_ty), mask=jin[:, None])


def _launch(p, do, scale, keys):
    """(batch strides and scalars, launch settings) shared by the window kernels, for BN = `keys` (keys per tile of
    the dq kernel's loop, keys per program of the dkv kernel)."""
    settings = p.settings.window_backward
    cq = settings.block_tokens
    BR = max(16, next_power_of_2(cq * p.G))
    q, k, v, _, o = batch_strides(p, do)  # (no gates here)
    args = (q, k, v, o, p.T, p.W, float(scale))
    meta = dict(HQ=p.HQ, H=p.H, GQ=p.G, D=p.D, DV=p.DV, CQB=cq, BR=BR, BN=keys, PREC=p.prec,
                num_warps=4 if BR <= 64 else 8, num_stages=settings.stages)
    return args, meta


def _dq_keys(p):
    """Keys per tile of the dq (and delta) kernel's loop: fewer up to a 64-token window (a 16-token block's 79 keys
    at w = 64 in 5 tiles of 16: 80 keys computed, against 96 in 3 tiles of 32)."""
    settings = p.settings.window_backward
    return settings.dq_keys_short if p.W <= 64 else settings.dq_keys_long


def _dkv_keys(p):
    """Keys per program of the dkv kernel: a program loads the (keys + w) / 16 query blocks its keys see."""
    settings = p.settings.window_backward
    return settings.dkv_keys_short if p.W <= 64 else settings.dkv_keys_long


def window_delta(p, do, lse, scale):
    """The window share of delta = sum P * dP per row: [B, T, HQ] fp32 (0 without a window)."""
    if p.W == 0:
        return torch.zeros(p.B, p.T, p.HQ, dtype=torch.float32, device=do.device)
    delta = torch.empty(p.B, p.T, p.HQ, dtype=torch.float32, device=do.device)  # every row is written
    args, meta = _launch(p, do, scale, _dq_keys(p))
    launch(_dq_kernel, (cdiv(p.T, meta["CQB"]), p.B * p.H), p.q_rope, p.k_rope, p.v, do, None, None, lse, delta,
           p.mask, delta, *args, DELTA_ONLY=True, **meta)
    return delta


def window_dq(p, do, lse, delta, scale, output=None):
    """dq_rope of the window half, in the inputs' dtype (stored once, rounded in the kernel). With `output`, the
    forward's (o, its int8 rounding residual or None), the kernel first writes delta = rowsum(dO * O) into `delta`
    (which may be uninitialized); else `delta` must be complete."""
    dqr = torch.empty(p.B, p.T, p.HQ, p.D, dtype=p.q_rope.dtype, device=do.device)
    args, meta = _launch(p, do, scale, _dq_keys(p))
    launch(_dq_kernel, (cdiv(p.T, meta["CQB"]), p.B * p.H), p.q_rope, p.k_rope, p.v, do, *(output or (None, None)),
           lse, delta, p.mask, dqr, *args, DELTA_ONLY=False, **meta)
    return dqr


def window_dkv(p, do, lse, delta, scale):
    """(dk_rope in the inputs' dtype, dv in fp32 (the slot part's is added to it)) of the window half."""
    B, T, H, D, DV = p.B, p.T, p.H, p.D, p.DV
    dkr = torch.empty(B, T, H, D, dtype=p.k_rope.dtype, device=do.device)
    dv = torch.empty(B, T, H, DV, dtype=torch.float32, device=do.device)
    args, meta = _launch(p, do, scale, _dkv_keys(p))
    launch(_dkv_kernel, (cdiv(T, meta["BN"]), B * H), p.q_rope, p.k_rope, p.v, do, lse, delta, p.mask, dkr, dv,
           *args, **meta)
    return dkr, dv
