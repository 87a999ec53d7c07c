"""One-token NHA decode step in Triton, same contract as `nha_recurrent_step`: the state is updated in place.

One program per (sequence, kv head): it absorbs the window's oldest entry (the token leaving; window 0: the new
token itself) into the fp32 slots held in registers and writes them back, reads slots (pre-RoPE q) and window
(post-RoPE q, the new token in place of the leaving one) under one online softmax for the G query heads of that
kv head, and finally writes the new token's key, RoPE'd key, value and gates over that entry. A second, tiny
launch then writes the entry's mask and moves the ring start: those are shared by all heads of a sequence, so no
program of the first launch may change them while others still read them. Nothing is allocated but the output,
so the step can be captured in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from ..modeling.nha_state import NHAState
from .chunk_fwd import alloc, launched


@triton.jit
def _decode_kernel(
    Q, QR, K, KR, V, LA, TOKEN_MASK, stride_mask,
    WK, WKR, WV, WLA, WMASK, WSTART, SK, SV, FILLED, BIAS, O,
    P, scale,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, RING: tl.constexpr,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    BR: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    new = pid.to(tl.int64)  # the new token's row in K, KR, V, LA ([B, 1, H, X])
    if HAS_MASK:
        new_real = tl.load(TOKEN_MASK + b * stride_mask) != 0
    else:
        new_real = pid >= 0
    k_new = tl.load(K + new * D + offs_d)
    v_new = tl.load(V + new * DV + offs_dv)
    la_new = tl.load(LA + new * M + offs_m)

    # absorb the token leaving the window (the ring entry `pos`, which the new token takes over)
    if RING:
        pos = tl.load(WSTART + b)
        entry = (b * P + pos) * H + h
        leave_real = tl.load(WMASK + b * P + pos) != 0
        la = tl.load(WLA + entry * M + offs_m).to(tl.float32)
        k_leave = tl.load(WK + entry * D + offs_d).to(tl.float32)
        v_leave = tl.load(WV + entry * DV + offs_dv).to(tl.float32)
    else:
        leave_real = new_real
        la = la_new.to(tl.float32)
        k_leave = k_new.to(tl.float32)
        v_leave = v_new.to(tl.float32)
    alpha = tl.where(leave_real, tl.exp(la), 1.0)
    slot_k = SK + new * M * D + offs_m[:, None] * D + offs_d[None, :]
    slot_v = SV + new * M * DV + offs_m[:, None] * DV + offs_dv[None, :]
    sk = alpha[:, None] * tl.load(slot_k) + (1.0 - alpha)[:, None] * k_leave[None, :]
    sv = alpha[:, None] * tl.load(slot_v) + (1.0 - alpha)[:, None] * v_leave[None, :]
    tl.store(slot_k, sk)
    tl.store(slot_v, sv)
    filled = (tl.load(FILLED + b) != 0) | leave_real
    tl.store(FILLED + b, filled.to(tl.int8))  # every head of the sequence stores the same value

    r = tl.arange(0, BR)
    rv = r < GQ
    hq = h * GQ + r
    qoff = (b * HQ + hq).to(tl.int64) * D
    q = tl.load(Q + qoff[:, None] + offs_d[None, :], mask=rv[:, None], other=0.0).to(tl.float32)
    logits = tl.dot(q, tl.trans(sk.to(tl.float32)), input_precision=PREC) * scale
    if HAS_BIAS:
        logits += tl.load(BIAS + hq, mask=rv, other=0.0)[:, None]
    logits = tl.where(filled & rv[:, None], logits, float("-inf"))
    m_i = tl.max(logits, 1)
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    p = tl.exp(logits - m_use[:, None])
    l_i = tl.sum(p, 1)
    acc = tl.dot(p, sv.to(tl.float32), input_precision=PREC)
    if RING:
        kr_new = tl.load(KR + new * D + offs_d)
        qr = tl.load(QR + qoff[:, None] + offs_d[None, :], mask=rv[:, None], other=0.0)
        offs_n = tl.arange(0, BN)
        for n0 in range(0, P, BN):
            j = n0 + offs_n
            jin = j < P
            is_new = (j == pos)[:, None]
            tok = (b * P + j).to(tl.int64) * H + h
            kr = tl.load(WKR + tok[:, None] * D + offs_d[None, :], mask=jin[:, None], other=0.0)
            kr = tl.where(is_new, kr_new[None, :].to(kr.dtype), kr)
            jreal = tl.load(WMASK + b * P + j, mask=jin, other=0) != 0
            jreal = tl.where(j == pos, new_real, jreal)
            s = tl.dot(qr, tl.trans(kr).to(qr.dtype), input_precision=PREC) * scale
            s = tl.where((jin & jreal)[None, :] & rv[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            pw = tl.exp(s - m_use[:, None])
            scale_old = tl.exp(m_i - m_use)
            l_i = l_i * scale_old + tl.sum(pw, 1)
            vw = tl.load(WV + tok[:, None] * DV + offs_dv[None, :], mask=jin[:, None], other=0.0)
            vw = tl.where(is_new, v_new[None, :].to(vw.dtype), vw)
            acc = acc * scale_old[:, None] + tl.dot(pw.to(vw.dtype), vw, input_precision=PREC)
            m_i = m_new
    ok = new_real & (l_i > 0)
    out = tl.where(ok[:, None], acc / tl.where(ok, l_i, 1.0)[:, None], 0.0)
    tl.store(O + qoff[:, None] + offs_dv[None, :], out.to(O.dtype.element_ty), mask=rv[:, None])
    if RING:
        tl.debug_barrier()  # every thread of this program has read the entry before it is overwritten
        tl.store(WK + entry * D + offs_d, k_new.to(WK.dtype.element_ty))
        tl.store(WKR + entry * D + offs_d, kr_new.to(WKR.dtype.element_ty))
        tl.store(WV + entry * DV + offs_dv, v_new.to(WV.dtype.element_ty))
        tl.store(WLA + entry * M + offs_m, la_new.to(WLA.dtype.element_ty))


@triton.jit
def _advance_ring_kernel(TOKEN_MASK, stride_mask, WMASK, WSTART, P, HAS_MASK: tl.constexpr):
    """Per sequence: the new token's mask into the ring entry it took over, and the ring start one entry on."""
    b = tl.program_id(0)
    pos = tl.load(WSTART + b)
    if HAS_MASK:
        real = tl.load(TOKEN_MASK + b * stride_mask) != 0
    else:
        real = b >= 0
    tl.debug_barrier()  # every thread has read the start before it moves
    tl.store(WMASK + b * P + pos, real.to(tl.int8))
    tl.store(WSTART + b, (pos + 1) % P)


def nha_recurrent_step_triton(
    q, k, v, q_rope, k_rope, log_alpha, window, scale, state=None, attention_mask=None, slot_bias=None
):
    """Same contract as `nha_recurrent_step` for a finite window: one token per sequence -> (o [B, 1, HQ, Dv],
    `state.for_decoding(window)` updated in place)."""
    batch, steps, q_heads, head_dim = q.shape
    if steps != 1:
        raise ValueError(f"nha_recurrent_step takes one token per sequence, got {steps}")
    if window is None:
        raise ValueError("the Triton decode step needs a finite window (window None grows the state)")
    kv_heads, slots, value_dim = k.shape[2], log_alpha.shape[-1], v.shape[-1]
    if state is None:
        state = NHAState.empty(batch, kv_heads, slots, head_dim, value_dim, k.dtype, k.device)
    state = state.for_decoding(window)
    token_mask = None if attention_mask is None else attention_mask[:, -1]
    if token_mask is not None and token_mask.dtype == torch.bool:
        token_mask = token_mask.view(torch.int8)
    out = alloc(batch, 1, q_heads, value_dim, dtype=q.dtype, device=q.device)
    mask_args = (out, 0) if token_mask is None else (token_mask, token_mask.stride(0))
    window_mask = state.window_mask.view(torch.int8)
    groups = q_heads // kv_heads
    exact = q.dtype == torch.float32 or state.slot_keys.dtype == torch.float64
    _decode_kernel[(batch * kv_heads,)](
        q.contiguous(), q_rope.contiguous(), k.contiguous(), k_rope.contiguous(), v.contiguous(),
        log_alpha.contiguous(), *mask_args,
        state.window_keys, state.window_keys_rope, state.window_values, state.window_log_alpha, window_mask,
        state.window_start, state.slot_keys, state.slot_values, state.slots_filled.view(torch.int8),
        out if slot_bias is None else slot_bias.float().contiguous(), out,
        window, float(scale),
        HAS_MASK=token_mask is not None, HAS_BIAS=slot_bias is not None, RING=window > 0,
        HQ=q_heads, H=kv_heads, GQ=groups, D=head_dim, DV=value_dim, M=slots,
        BR=max(16, triton.next_power_of_2(groups)), BN=64, PREC="ieee" if exact else "tf32",
        num_warps=4,
    )
    launched("decode")
    if window > 0:
        _advance_ring_kernel[(batch,)](*mask_args, window_mask, state.window_start, window,
                                       HAS_MASK=token_mask is not None, num_warps=1)
        launched("advance ring")
    return out, state
