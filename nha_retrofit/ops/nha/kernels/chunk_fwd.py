"""Triton forward of the NHA operator: the slot states (`chunk_states.py`), then one fused window + slot-read kernel.

Notation (docs/design.md section 2); CS tokens per slot-state chunk (`Prepared.cs`). Query u reads the slots after
absorbing tokens j = 0 .. u - W (W = window), plus the window keys u - W + 1 .. u, under one softmax. Writing
j = u' - W, the slot part is an inclusive gated-slot read over a "shifted" stream u' (token u' - W), so the chunk
states sit at stream positions c * CS, i.e. after absorbing tokens j < c * CS - W.

`_fwd_kernel`, per (query block of `settings.forward_block` tokens, batch x kv head), with all G query heads of the
kv head as rows (`rows.py`): the M slot logits (the carried chunk state plus the chunk's own tokens before the row,
weighted as `slot_weights.py` describes), then flash-style online softmax over the sliding window (keys
max(0, t-W+1) .. t) merged under the same softmax, the slot and window value reads, and o with the joint
log-sum-exp L (natural log; +inf for rows with nothing visible, so a backward gets exp(s - L) = 0 there). The slot
part takes q, k and the state in 64-column passes and the value read in two column halves of the accumulator, so
fewer [rows x 128] fp32 tiles are live at once; it forms its products before the rows' decays and the window after
the slot part, for the same reason.
"""

import torch
import triton
import triton.language as tl

from ...utils.launch import cdiv, constant, launch, next_power_of_2
from ...utils.products import dot_f32, dot_hilo, dot_xb, product_precision
from .chunk_states import STATE_PRECISION, kv_states, local_kv_states
from .chunk_inputs import batch_strides
from .residual import store_rounded
from .rows import prefetch_rows, real, token_strides
from .settings import forward_block, state_segment
from .slot_weights import (block_split, block_token_decay, carried_block_split, chunk_cumsum, chunk_products, row_decay,
                           state_tile)

# The slot tiles are at least this wide (padding slots masked): with 16 or 32 slots, D = 64 and 3-4 query heads per
# kv head, Triton 3.6 miscompiled the kernel on the H200 (an out-of-bounds shared-memory read in a slot product).
MIN_SLOT_TILE = 64
# A forward without a backward rounds the value state and the slot weights of the P.V read to bf16 for one MMA, as
# flash attention's P.V, and the key state of q . Sk likewise (q is exact in bf16). A backward needs the logits
# near fp32-exact (the log_alpha gradient is a cancellation), so a training forward keeps the state precision.
INFERENCE_PRECISION = "bf16"


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
        valid = (j[None, :] <= t[:, None]) & (j[None, :] > t[:, None] - W) & real(MASK, b, T, j, jin)[None, :]
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
def _weights_values(w, v, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """w . v for fp32 weights w and the input values v: w rounded to v's dtype, or with SPLIT split into hi + lo
    (`dot_hilo`), so a training forward's fp32 output is the exact sum P . V that the backward's delta needs."""
    if SPLIT:
        return dot_hilo(w, v)
    else:
        return tl.dot(w.to(v.dtype), v, input_precision=PREC)


@triton.jit
def _read_values(acc, pc, wm, SV, st, CARRY, ct, dcum, VP, jr, cols, M: tl.constexpr, MT: tl.constexpr,
                 DV: tl.constexpr, PREC: tl.constexpr, RPREC: tl.constexpr, SPLIT: tl.constexpr):
    """acc[:, cols] + pc . Sv[:, cols] (the value state before the chunk, `state_tile`) + wm . v[:, cols] (the
    chunk's tokens)."""
    acc += dot_f32(pc, state_tile(SV, st, CARRY, ct, dcum, tl.arange(0, MT), cols, M, DV), RPREC)
    vj = tl.load(VP + cols[None, :], mask=jr[:, None], other=0.0)
    return acc + _weights_values(wm, vj, PREC, SPLIT)


@triton.jit
def _column_halves(x, BR: tl.constexpr, BDS: tl.constexpr):
    """The two [BR, BDS] column halves of a [BR, 2 BDS] tile (tl.join of them, permuted back, rebuilds it)."""
    return tl.split(tl.permute(tl.reshape(x, [BR, 2, BDS]), [0, 2, 1]))


@triton.jit
def _fwd_kernel(
    Q, K, V, QR, KR, G, MASK, FIRST, FILLED0, BIAS, SK, SV, CK, CV, DCUM, O, ORES, LSE, LOGITS,
    sq_b, sk_b, sv_b, sg_b, so_b,
    T, W, NCH, NSEG, scale,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    MT: tl.constexpr, CQB: tl.constexpr, CSZ: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SLOTS: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr,
    RPREC: tl.constexpr, BDS: tl.constexpr, KSEG: tl.constexpr, PREFETCH: tl.constexpr,
):
    """o and the joint log-sum-exp of a block of query rows (module docstring). LSE None: a forward without a backward
    (nothing stored). LOGITS (or None): the scaled slot logits before the bias, [B, T, HQ, M] fp32, for the slot
    backward's rows kernel. ORES (or None; a training forward on bf16/fp16 inputs): the weights' products with the
    input values split (`_weights_values`) and o's rounding residual stored (`residual.py`). CK (CV, DCUM, NSEG,
    KSEG; or None): SK, SV are segment-local (`chunk_states.local_kv_states`), CK and CV the states before each
    segment of KSEG chunks. PREFETCH: L2 prefetches before the slot part, 1 the window's keys and values (read after
    it), 2 also the chunk's value and key states. SPREC: the precision of the fp32 slot products (`ops/utils/products.py`);
    RPREC: of the reads of the states, q . Sk and P . Sv, and of the chunk tokens' weights (SPREC, or bf16 without a
    backward)."""
    SPLIT: tl.constexpr = ORES is not None
    sq_t, sk_t, sk_h, sv_t, sv_h, so_t = token_strides(HQ, H, D, DV)
    sg_t, sg_h = H * M, M
    # the rows of `rows.query_rows`, inline: the helper's order of the index arithmetic changes this kernel's SASS
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
    active = real(MASK, b, T, t, tv)
    row_off = b * sq_b + t.to(tl.int64) * sq_t + hq * D  # q, q_rope share strides

    m_i = tl.full([BR], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BR], dtype=tl.float32)
    acc = tl.zeros([BR, DV], dtype=tl.float32)

    if HAS_SLOTS:
        c = t0 // CSZ
        cs0 = c * CSZ
        off = t0 - cs0
        offs_u = tl.arange(0, CSZ)
        u = cs0 + offs_u
        j = u - W
        ul = off + tok  # row's stream position inside the chunk
        jv = (j >= 0) & (j < T - W) & (offs_u < off + CQB)
        jr = real(MASK, b, T, j, jv)
        offs_m = tl.arange(0, MT)  # MT >= M: the padding slots have zero gates and states and -inf logits
        slots = offs_m < M
        g = tl.load(G + b * sg_b + j[:, None].to(tl.int64) * sg_t + h * sg_h + offs_m[None, :],
                    mask=jr[:, None] & slots[None, :], other=0.0)
        a = chunk_cumsum(g, CSZ)  # [CS, MT], from the chunk start, inclusive
        g = g.to(tl.float32)
        causal = offs_u[None, :] <= ul[:, None]  # [BR, CS]
        st = pid_bh.to(tl.int64) * (NCH + 1) + c
        ct = pid_bh.to(tl.int64) * (NSEG + 1) + c // KSEG
        if PREFETCH > 1:  # the value state, read after the softmax, and the key state's later column passes
            state_rows = tl.minimum(offs_m, M - 1)
            prefetch_rows(SV, st * M * DV + state_rows * DV, DV)
            prefetch_rows(SK, st * M * D + state_rows * D, D)
        if PREFETCH > 0 and HAS_WINDOW:  # the window's keys and values, read after the slot part
            jw = tl.minimum(tl.maximum(t0 - W + 1, 0) + tl.arange(0, 128), T - 1).to(tl.int64)
            prefetch_rows(KR, b * sk_b + jw * sk_t + h * sk_h, D)
            prefetch_rows(V, b * sv_b + jw * sv_t + h * sv_h, DV)
        dcum = tl.zeros([MT], dtype=tl.float32)
        if CK is not None:
            dcum = tl.load(DCUM + (pid_bh.to(tl.int64) * NCH + c) * M + offs_m, mask=slots, other=0.0)
        krow = b * sk_b + j.to(tl.int64) * sk_t + h * sk_h
        if CQB == CSZ:  # the block is the chunk: nothing before it, its end is the cumsum's last row
            a_ref = tl.zeros([MT], dtype=tl.float32)
            _, factored, direct = carried_block_split(a, a_ref, 0, CQB, CSZ)
        else:
            a_ref, factored, direct = block_split(g, off, CQB, CSZ)
        # the products first: the decays' tiles are not live through them (the same products as the slot backward's
        # rows kernel, so its logits match this L)
        qk, x_car = chunk_products(Q, row_off, K, krow, SK, st, CK, ct, dcum, tv, jr, tl.arange(0, BDS), D, BDS, M,
                                   MT, BR, CSZ, PREC, RPREC)
        kw = tl.where(jr[:, None] & factored[:, None], (1.0 - tl.exp(g)) * tl.exp(a_ref[None, :] - a), 0.0)
        a_in = row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, t0, tok, tv & (gh == 0), T, W, CQB, M, MT, False)
        e_in = tl.exp(a_in)  # <= 1 for rows of this block
        e_car = e_in * tl.exp(a_ref)[None, :]  # both factors <= 1: one exponential per slot, not per row and slot
        qk = tl.where(causal, qk, 0.0)
        if RPREC == "bf16":  # the chunk tokens' key weights rounded to bf16, as the key state (qk split)
            x_in = dot_xb(qk, kw, SPREC) * e_in
        else:
            x_in = dot_f32(qk, kw, SPREC) * e_in
        if direct:
            cum = tl.zeros([MT], dtype=tl.float32)
            for jj in range(CQB):
                e_j, s_j, cum = block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum,
                                                  a_in, tok >= jj, M, MT)
                x_in += tl.sum(tl.where(offs_u[None, :] == off + jj, qk, 0.0), 1)[:, None] * e_j * s_j[None, :]
        logits = (x_in + x_car * e_car) * scale
        if LOGITS is not None:
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
        wm = tl.where(causal, dot_f32(p * e_in, tl.trans(kw), RPREC), 0.0)
        if direct:
            cum = tl.zeros([MT], dtype=tl.float32)
            for jj in range(CQB):
                e_j, s_j, cum = block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, cs0 + off + jj - W, T, W, cum,
                                                  a_in, tok >= jj, M, MT)
                wm = tl.where(offs_u[None, :] == off + jj, tl.sum(p * e_j * s_j[None, :], 1)[:, None], wm)
        vp = V + b * sv_b + j[:, None].to(tl.int64) * sv_t + h * sv_h
        if DV == 2 * BDS:  # the value read in two column halves of acc
            halves = _column_halves(acc, BR, BDS)
            cols = tl.arange(0, BDS)
            acc0 = _read_values(halves[0], pc, wm, SV, st, CV, ct, dcum, vp, jr, cols, M, MT, DV, PREC, RPREC, SPLIT)
            acc1 = _read_values(halves[1], pc, wm, SV, st, CV, ct, dcum, vp, jr, BDS + cols, M, MT, DV, PREC, RPREC,
                                SPLIT)
            acc = tl.reshape(tl.permute(tl.join(acc0, acc1), [0, 2, 1]), [BR, DV])
        else:
            acc = _read_values(acc, pc, wm, SV, st, CV, ct, dcum, vp, jr, offs_dv, M, MT, DV, PREC, RPREC, SPLIT)

    if HAS_WINDOW:  # after the slot part: its tiles are not live while the slot part runs
        m_i, l_i, acc = _window_rows(QR, KR, V, MASK, b, h, t, tv, row_off, t0, T, W, scale, m_i, l_i, acc,
                                     sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, D, DV, CQB, BN, PREC, SPLIT)

    ok = active & (l_i > 0)
    l_safe = tl.where(ok, l_i, 1.0)
    out = tl.where(ok[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(ok, m_i + tl.log(l_safe), float("inf"))
    if LSE is not None:  # before o: 0.01-0.03 ms less per 32K training step
        tl.store(LSE + (b * T + t).to(tl.int64) * HQ + hq, lse, mask=tv)
    o_off = b * so_b + t.to(tl.int64) * so_t + hq * DV
    if SPLIT and DV == 2 * BDS:  # o and its residual by column halves (fewer live registers)
        halves = _column_halves(out, BR, BDS)
        cols = tl.arange(0, BDS)
        store_rounded(O, ORES, o_off, cols, halves[0], tv)
        store_rounded(O, ORES, o_off, BDS + cols, halves[1], tv)
    else:
        store_rounded(O, ORES, o_off, offs_dv, out, tv)


def _forward_prefetch(p, segment):
    """The fused kernel's PREFETCH (`_fwd_kernel`): the training setting in a training forward, the inference one
    where the states are segment-local (shorter forwards lost time with it), else none; none where the inputs are
    not `prefetchable`."""
    if not p.prefetchable:
        return 0
    if p.training:
        return p.settings.forward.train_prefetch
    return p.settings.forward.inference_prefetch if segment else 0


def forward(p, scale, has_slots, initial_keys=None, initial_values=None, filled0=None):
    """(o [B, T, HQ, DV], lse [B, T, HQ] fp32 or None without a backward, the states, o's residual or None).

    A training forward with slots keeps what the slot backward reuses, states = (Sk, Sv, dec, logits): the slot
    states before each chunk, the chunk decays and the scaled slot logits before the bias [B, T, HQ, M] fp32; and on
    bf16/fp16 inputs with a window, o's int8 rounding residual (`residual.py`), from which the window backward takes
    delta. A forward without a backward keeps long sequences' states segment-local and returns (Ck, Cv, None, None),
    the states before each segment. Either way [:, :, -1] of the first two is the final state (states None without
    slots)."""
    B, T, HQ, D, H, M, DV, G = p.B, p.T, p.HQ, p.D, p.H, p.M, p.DV, p.G
    device = p.q.device
    training = p.training
    o = torch.empty(B, T, HQ, DV, dtype=p.q.dtype, device=device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=device) if training else None
    if filled0 is None:
        filled0 = constant((B,), 0, torch.int32, device)
    segment = state_segment(p.nch, p.settings) if has_slots and not training else None
    ck = cv = dcum = logits = residual = None
    if segment:
        sk, sv, ck, cv, dcum = local_kv_states(p, segment, initial_keys, initial_values)
    elif has_slots:
        sk, sv, dec = kv_states(p, initial_keys, initial_values)
    else:
        sk = sv = torch.empty(1, dtype=torch.float32, device=device)
    if has_slots and training:
        logits = torch.empty(B, T, HQ, M, dtype=torch.float32, device=device)
        if p.W > 0 and o.dtype != torch.float32:
            residual = torch.empty(B, T, HQ, DV, dtype=torch.int8, device=device)
    cq = forward_block(G, p.cs, p.settings)
    BR = max(16, next_power_of_2(cq * G))
    state_prec = product_precision(STATE_PRECISION, p.q.dtype)
    read_prec = state_prec if training else product_precision(INFERENCE_PRECISION, p.q.dtype)
    launch(
        _fwd_kernel, (cdiv(T, cq), B * H),
        p.q, p.k, p.v, p.q_rope, p.k_rope, p.log_alpha, p.mask, p.first, filled0.to(torch.int32).contiguous(),
        p.bias, sk, sv, ck, cv, dcum, o, residual, lse, logits, *batch_strides(p, o),
        T, p.W, p.nch, cdiv(p.nch, segment or 1), float(scale),
        HQ=HQ, H=H, GQ=G, D=D, DV=DV, M=M, MT=max(M, MIN_SLOT_TILE), CQB=cq, CSZ=p.cs, BR=BR, BN=64 if BR <= 64 else 32,
        HAS_WINDOW=p.W > 0, HAS_SLOTS=has_slots, PREC=p.prec, SPREC=state_prec, RPREC=read_prec,
        BDS=min(64, D), KSEG=segment or 1, PREFETCH=_forward_prefetch(p, segment),
        num_warps=4 if BR * max(D, DV) < 32 * 128 else p.settings.forward.warps, num_stages=p.settings.forward.stages,
    )
    if not has_slots:
        return o, lse, None, residual
    return o, lse, (ck, cv, None, None) if segment else (sk, sv, dec, logits), residual
