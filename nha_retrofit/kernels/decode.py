"""One-token NHA decode step in Triton, same contract as `nha_recurrent_step` (NHAState layout kept).

The new token joins the window (a concatenation in PyTorch); one program per (sequence, kv head) then absorbs
the token(s) leaving the window into the fp32 slots (held in registers), writes the new slots, and reads slots
(pre-RoPE q) and window (post-RoPE q) under one online softmax for the G query heads of that kv head.
"""

import torch
import triton
import triton.language as tl

from ..modeling.nha_state import NHAState
from .chunk_fwd import alloc, launched


@triton.jit
def _decode_kernel(
    Q, QR, WK, WKR, WV, WLA, WMASK, SK, SV, FILLED, BIAS, NSK, NSV, O,
    P1, LEAVE, scale,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    BR: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    sbase = pid.to(tl.int64)
    sk = tl.load(SK + sbase * M * D + offs_m[:, None] * D + offs_d[None, :])
    sv = tl.load(SV + sbase * M * DV + offs_m[:, None] * DV + offs_dv[None, :])
    filled = tl.load(FILLED + b) > 0
    for l in range(LEAVE):
        real = tl.load(WMASK + b * P1 + l) > 0
        tok = (b * P1 + l).to(tl.int64) * H + h
        la = tl.load(WLA + tok * M + offs_m).to(tl.float32)
        alpha = tl.where(real, tl.exp(la), 1.0)
        kk = tl.load(WK + tok * D + offs_d).to(tl.float32)
        vv = tl.load(WV + tok * DV + offs_dv).to(tl.float32)
        sk = alpha[:, None] * sk + (1.0 - alpha)[:, None] * kk[None, :]
        sv = alpha[:, None] * sv + (1.0 - alpha)[:, None] * vv[None, :]
        filled = filled | real
    tl.store(NSK + sbase * M * D + offs_m[:, None] * D + offs_d[None, :], sk)
    tl.store(NSV + sbase * M * DV + offs_m[:, None] * DV + offs_dv[None, :], sv)

    r = tl.arange(0, BR)
    rv = r < GQ
    hq = h * GQ + r
    qoff = (b * HQ + hq).to(tl.int64) * D
    q = tl.load(Q + qoff[:, None] + offs_d[None, :], mask=rv[:, None], other=0.0).to(tl.float32)
    bias = tl.load(BIAS + hq, mask=rv, other=0.0)
    logits = tl.dot(q, tl.trans(sk), input_precision=PREC) * scale + bias[:, None]
    logits = tl.where(filled & rv[:, None], logits, float("-inf"))
    m_i = tl.max(logits, 1)
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    p = tl.exp(logits - m_use[:, None])
    l_i = tl.sum(p, 1)
    acc = tl.dot(p, sv, input_precision=PREC)
    qr = tl.load(QR + qoff[:, None] + offs_d[None, :], mask=rv[:, None], other=0.0)
    offs_n = tl.arange(0, BN)
    for n0 in range(LEAVE, P1, BN):
        j = n0 + offs_n
        jin = j < P1
        tok = (b * P1 + j).to(tl.int64) * H + h
        kr = tl.load(WKR + tok[:, None] * D + offs_d[None, :], mask=jin[:, None], other=0.0)
        jreal = tl.load(WMASK + b * P1 + j, mask=jin, other=0) > 0
        s = tl.dot(qr, tl.trans(kr).to(qr.dtype), input_precision=PREC) * scale
        s = tl.where((jin & jreal)[None, :] & rv[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        pw = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(pw, 1)
        vw = tl.load(WV + tok[:, None] * DV + offs_dv[None, :], mask=jin[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(pw.to(vw.dtype), vw, input_precision=PREC)
        m_i = m_new
    cur_real = tl.load(WMASK + b * P1 + P1 - 1) > 0
    ok = cur_real & (l_i > 0)
    out = tl.where(ok[:, None], acc / tl.where(ok, l_i, 1.0)[:, None], 0.0)
    tl.store(O + qoff[:, None] + offs_dv[None, :], out.to(O.dtype.element_ty), mask=rv[:, None])


def nha_recurrent_step_triton(
    q, k, v, q_rope, k_rope, log_alpha, window, scale, state=None, attention_mask=None, slot_bias=None
):
    """Same contract as `nha_recurrent_step`: one token per sequence -> (o [B, 1, HQ, Dv], new NHAState)."""
    batch, steps, q_heads, head_dim = q.shape
    if steps != 1:
        raise ValueError(f"nha_recurrent_step takes one token per sequence, got {steps}")
    kv_heads, slots, value_dim = k.shape[2], log_alpha.shape[-1], v.shape[-1]
    groups = q_heads // kv_heads
    if state is None:
        state = NHAState.empty(batch, kv_heads, slots, head_dim, value_dim, k.dtype, k.device)
    token_mask = (torch.ones(batch, 1, dtype=torch.bool, device=q.device) if attention_mask is None
                  else attention_mask[:, -1:].bool())
    wdt = state.window_keys.dtype
    wk = torch.cat([state.window_keys, k.to(wdt)], 1)
    wkr = torch.cat([state.window_keys_rope, k_rope.to(wdt)], 1)
    wv = torch.cat([state.window_values, v.to(state.window_values.dtype)], 1)
    wla = torch.cat([state.window_log_alpha, log_alpha.to(state.window_log_alpha.dtype)], 1)
    wmask = torch.cat([state.window_mask.bool(), token_mask], 1)
    p1 = wmask.shape[1]
    leaving = 0 if window is None else max(p1 - window, 0)
    sk, sv = state.slot_keys.contiguous(), state.slot_values.contiguous()
    new_sk = alloc(*sk.shape, dtype=sk.dtype, device=sk.device)
    new_sv = alloc(*sv.shape, dtype=sv.dtype, device=sv.device)
    out = alloc(batch, 1, q_heads, value_dim, dtype=q.dtype, device=q.device)
    bias = (torch.zeros(q_heads, dtype=torch.float32, device=q.device) if slot_bias is None
            else slot_bias.float().contiguous())
    BR = max(16, triton.next_power_of_2(groups))
    prec = "ieee" if q.dtype in (torch.float32, torch.float64) or sk.dtype == torch.float64 else "tf32"
    _decode_kernel[(batch * kv_heads,)](
        q.contiguous(), q_rope.contiguous(), wk, wkr, wv, wla, wmask.to(torch.int8), sk, sv,
        state.slots_filled.to(torch.int8), bias, new_sk, new_sv, out,
        p1, leaving, float(scale),
        HQ=q_heads, H=kv_heads, GQ=groups, D=head_dim, DV=value_dim, M=slots, BR=BR, BN=64, PREC=prec,
        num_warps=4,
    )
    launched("decode")
    filled = state.slots_filled | wmask[:, :leaving].any(1) if leaving > 0 else state.slots_filled
    new_state = NHAState(
        new_sk, new_sv, filled, wk[:, leaving:], wkr[:, leaving:], wv[:, leaving:], wla[:, leaving:],
        wmask[:, leaving:],
    )
    return out, new_state
