"""One-token NHA decode step in Triton, same contract as `nha_recurrent_step`: the state is updated in place.

One launch, split over the window like flash-decoding, so a long window is read by many programs at once. Program
(sequence x kv head, block of `window_block` window entries, `settings.DecodeSettings`):
- the softmax partials (max, sum, P.V) of the G query heads of that kv head over its entries (post-RoPE q), the
  new token standing in for the ring entry it takes over (the oldest);
- the block holding that entry also absorbs the leaving token (window 0: the new token itself) into the fp32
  slots, in place, adds the slot logits (pre-RoPE q) to its partials, and finally writes the new token's key,
  RoPE'd key, value and gates over the entry;
- the last block of a (sequence, kv head) to finish (a counter in `workspace.counters`) merges the blocks' partials
  into the output; a window of one block writes its output directly;
- the last kv head of a sequence to finish (a second counter) writes the new token's mask into its ring entry and
  moves the ring start one on: every program of the sequence reads those two, so they move only after all have.
The counters are reset by the programs that see them complete, so consecutive steps (and CUDA-graph replays) find
them at zero. Nothing is allocated but the output and, for windows longer than one block, the partials.
"""

import torch
import triton
import triton.language as tl

from ..utils.launch import cdiv, counters, launch, next_power_of_2
from ..utils.products import dot_precision
from .kernels.settings import settings_for
from .state import NHAState


@triton.jit
def _token_real(TOKEN_MASK, stride_mask, b, HAS_MASK: tl.constexpr):
    """Whether sequence b's new token is real (not padding): its attention-mask column, or always without one."""
    if HAS_MASK:
        return tl.load(TOKEN_MASK + b * stride_mask) != 0
    return b >= 0


@triton.jit
def _log_sigmoid(x):
    """log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)) in float32, log1p exact for tiny arguments (as PyTorch's)."""
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.minimum(x, 0.0) - log1p


@triton.jit
def _merge_partials(PART_ACC, PART_ML, pid, NBLK, r, offs_dv, BR: tl.constexpr, DV: tl.constexpr):
    """The NBLK blocks' partials of program row `pid` under one softmax: (sum, P.V). Read through L2 (".cg"):
    other programs wrote them."""
    m_i = tl.full([BR], float("-inf"), tl.float32)
    l_i = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, DV], tl.float32)
    for blk in range(NBLK):
        part = pid.to(tl.int64) * NBLK + blk
        m_b = tl.load(PART_ML + (part * 2) * BR + r, cache_modifier=".cg")
        l_b = tl.load(PART_ML + (part * 2 + 1) * BR + r, cache_modifier=".cg")
        acc_b = tl.load(PART_ACC + (part * BR + r[:, None]) * DV + offs_dv[None, :], cache_modifier=".cg")
        m_new = tl.maximum(m_i, m_b)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        old, add = tl.exp(m_i - m_use), tl.exp(m_b - m_use)
        l_i = l_i * old + l_b * add
        acc = acc * old[:, None] + acc_b * add[:, None]
        m_i = m_new
    return l_i, acc


@triton.jit
def _store_output(O, l_i, acc, new_real, b, h, r, offs_dv, HQ: tl.constexpr, GQ: tl.constexpr, DV: tl.constexpr):
    """o = P.V / sum for the G query heads (0 for a padding token or rows that see nothing)."""
    ok = new_real & (l_i > 0)
    out = tl.where(ok[:, None], acc / tl.where(ok, l_i, 1.0)[:, None], 0.0)
    ooff = (b * HQ + h * GQ + r).to(tl.int64) * DV
    tl.store(O + ooff[:, None] + offs_dv[None, :], out.to(O.dtype.element_ty), mask=(r < GQ)[:, None])


@triton.jit
def _decode_kernel(
    Q, QR, K, KR, V, LA, TOKEN_MASK, stride_mask,
    WK, WKR, WV, WLA, WMASK, WSTART, SK, SV, FILLED, BIAS, O, PART_ACC, PART_ML, COUNT,
    P, scale, inv_tau, NSEQ,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, GATE: tl.constexpr, RING: tl.constexpr, SINGLE: tl.constexpr,
    HQ: tl.constexpr, H: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, M: tl.constexpr,
    BR: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):
    """Program (sequence x kv head, window block), see the module docstring. SINGLE: one block covers the window
    (no partials). GATE: LA holds the gate logits f and log(alpha) = logsigmoid(f) * inv_tau. COUNT: [B * H]
    finished blocks per (sequence, kv head), then [NSEQ] finished heads per sequence."""
    pid = tl.program_id(0)
    blk = tl.program_id(1)
    b = pid // H
    h = pid % H
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    new = pid.to(tl.int64)  # the new token's row in K, KR, V, LA ([B, 1, H, X])
    new_real = _token_real(TOKEN_MASK, stride_mask, b, HAS_MASK)
    k_new = tl.load(K + new * D + offs_d)
    v_new = tl.load(V + new * DV + offs_dv)
    la_new = tl.load(LA + new * M + offs_m)
    if GATE:
        la_new = _log_sigmoid(la_new.to(tl.float32)) * inv_tau
    r = tl.arange(0, BR)
    rv = r < GQ
    hq = h * GQ + r
    qoff = (b * HQ + hq).to(tl.int64) * D
    m_i = tl.full([BR], float("-inf"), tl.float32)
    l_i = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, DV], tl.float32)
    if RING:
        pos = tl.load(WSTART + b)
        owner = pos // BN
    else:
        pos = 0
        owner = 0
    if blk == owner:
        # absorb the token leaving the window (the ring entry `pos`, which the new token takes over)
        if RING:
            entry = (b * P + pos) * H + h  # the leaving token's row in the window tensors ([B, P, H, X])
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
        q = tl.load(Q + qoff[:, None] + offs_d[None, :], mask=rv[:, None], other=0.0).to(tl.float32)
        logits = tl.dot(q, tl.trans(sk.to(tl.float32)), input_precision=PREC) * scale
        if HAS_BIAS:
            logits += tl.load(BIAS + hq, mask=rv, other=0.0).to(tl.float32)[:, None]
        logits = tl.where(filled & rv[:, None], logits, float("-inf"))
        m_i = tl.max(logits, 1)
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        p = tl.exp(logits - m_use[:, None])
        l_i = tl.sum(p, 1)
        acc = tl.dot(p, sv.to(tl.float32), input_precision=PREC)
    if RING:
        kr_new = tl.load(KR + new * D + offs_d)
        qr = tl.load(QR + qoff[:, None] + offs_d[None, :], mask=rv[:, None], other=0.0)
        j = blk * BN + tl.arange(0, BN)
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
        rescale = tl.exp(m_i - m_use)
        l_i = l_i * rescale + tl.sum(pw, 1)
        vw = tl.load(WV + tok[:, None] * DV + offs_dv[None, :], mask=jin[:, None], other=0.0)
        vw = tl.where(is_new, v_new[None, :].to(vw.dtype), vw)
        acc = acc * rescale[:, None] + tl.dot(pw.to(vw.dtype), vw, input_precision=PREC)
        m_i = m_new
    if RING:
        if blk == owner:
            tl.debug_barrier()  # every thread of this program has read the entry before it is overwritten
            entry = (b * P + pos) * H + h  # recomputed, not kept live across the window read: fewer registers
            tl.store(WK + entry * D + offs_d, k_new.to(WK.dtype.element_ty))
            tl.store(WKR + entry * D + offs_d, kr_new.to(WKR.dtype.element_ty))
            tl.store(WV + entry * DV + offs_dv, v_new.to(WV.dtype.element_ty))
            tl.store(WLA + entry * M + offs_m, la_new.to(WLA.dtype.element_ty))
    if SINGLE:
        _store_output(O, l_i, acc, new_real, b, h, r, offs_dv, HQ, GQ, DV)
        head_done = True
    else:
        nblk = tl.num_programs(1)
        part = pid.to(tl.int64) * nblk + blk
        tl.store(PART_ACC + (part * BR + r[:, None]) * DV + offs_dv[None, :], acc)
        tl.store(PART_ML + (part * 2) * BR + r, m_i)
        tl.store(PART_ML + (part * 2 + 1) * BR + r, l_i)
        tl.debug_barrier()  # all of this program's stores and reads come before its count (a release)
        head_done = tl.atomic_add(COUNT + pid, 1, sem="acq_rel") == nblk - 1
        if head_done:  # the last block of this (sequence, kv head): the others' partials are visible
            l_i, acc = _merge_partials(PART_ACC, PART_ML, pid, nblk, r, offs_dv, BR, DV)
            _store_output(O, l_i, acc, new_real, b, h, r, offs_dv, HQ, GQ, DV)
            tl.store(COUNT + pid, 0)
    if RING:
        if head_done:
            tl.debug_barrier()
            if tl.atomic_add(COUNT + NSEQ * H + b, 1, sem="acq_rel") == H - 1:  # the sequence's last head
                tl.store(WMASK + b * P + pos, new_real.to(tl.int8))
                tl.store(WSTART + b, (pos + 1) % P)
                tl.store(COUNT + NSEQ * H + b, 0)


def nha_recurrent_step_triton(
    q, k, v, q_rope, k_rope, log_alpha, window, scale, state=None, attention_mask=None, slot_bias=None,
    gate_normalizer=None,
):
    """Same contract as `nha_recurrent_step` for a finite window: one token per sequence -> (o [B, 1, HQ, Dv],
    `state.for_decoding(window)` updated in place). With `gate_normalizer`, `log_alpha` holds the gate logits f and
    the kernel takes log(alpha) = logsigmoid(f) / gate_normalizer itself; the slot bias is read in its own dtype:
    no elementwise launches besides the step."""
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
    settings = settings_for(q.device).decode
    out = torch.empty(batch, 1, q_heads, value_dim, dtype=q.dtype, device=q.device)
    mask_args = (out, 0) if token_mask is None else (token_mask, token_mask.stride(0))
    groups = q_heads // kv_heads
    rows = max(16, next_power_of_2(groups))
    blocks = max(cdiv(window, settings.window_block), 1)
    if blocks == 1:  # no partials: the one block writes the output
        part_acc = part_ml = out
    else:
        part_acc = torch.empty(batch * kv_heads * blocks * rows * value_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch * kv_heads * blocks * 2 * rows, dtype=torch.float32, device=q.device)
    launch(
        _decode_kernel, (batch * kv_heads, blocks),
        q.contiguous(), q_rope.contiguous(), k.contiguous(), k_rope.contiguous(), v.contiguous(),
        log_alpha.contiguous(), *mask_args,
        state.window_keys, state.window_keys_rope, state.window_values, state.window_log_alpha,
        state.window_mask.view(torch.int8), state.window_start, state.slot_keys, state.slot_values,
        state.slots_filled.view(torch.int8), out if slot_bias is None else slot_bias.contiguous(), out,
        part_acc, part_ml, counters(q.device, batch * (kv_heads + 1)),
        window, float(scale), 1.0 / (gate_normalizer or 1.0), batch, HAS_MASK=token_mask is not None,
        HAS_BIAS=slot_bias is not None, GATE=gate_normalizer is not None, RING=window > 0, SINGLE=blocks == 1,
        HQ=q_heads, H=kv_heads, GQ=groups, D=head_dim, DV=value_dim, M=slots, BR=rows, BN=settings.window_block,
        PREC=dot_precision(q.dtype), num_warps=settings.warps,
    )
    return out, state

