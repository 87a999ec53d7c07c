"""The stored read in Triton, split over the cache like flash-decoding (same contract as `naive_stored_attention`).

Two launches:
- partials: program (sequence x kv head, split of the positions) reads its split's keys and values tile by tile in
  their stored dtype (float8 ones become the query's dtype in registers, their scales multiply the scores and the
  probabilities), and keeps an online softmax of the kv head's G query heads: (max, sum, P.V) per split;
- combine: program (sequence x kv head) merges its splits' partials under one softmax and writes the output.

So a float8 cache is read as float8, one byte per element, where dequantizing it first writes and reads a
model-dtype copy. The splits are sized so that about two programs per multiprocessor run at batch 1; large batches
get one split per (sequence, kv head).
"""

import functools

import torch
import triton
import triton.language as tl

from ..utils.launch import cdiv, launch, next_power_of_2
from ..utils.products import dot_precision

BLOCK_N = 64  # positions per tile
MIN_SPLIT_TILES = 4  # a split reads at least this many tiles: shorter ones cost more in partials than they save


@triton.jit
def _partials_kernel(
    Q, K, V, KS, VS, REAL, PART_ACC, PART_ML,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_sb, stride_sh,
    stride_rb, L, SPLIT_LEN, NSPLIT, scale,
    H: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr,
    SCALED: tl.constexpr, PREC: tl.constexpr,
):
    pid, split = tl.program_id(0), tl.program_id(1)
    b, h = (pid // H).to(tl.int64), pid % H
    r, offs_d, offs_dv = tl.arange(0, BG), tl.arange(0, D), tl.arange(0, DV)
    q = tl.load(Q + b * stride_qb + (h * G + r)[:, None] * stride_qh + offs_d[None, :], mask=(r < G)[:, None],
                other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    s_base = b * stride_sb + h * stride_sh
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, L)
    m_i = tl.full([BG], -1e30, tl.float32)  # finite: a tile with no real position leaves the sums unchanged
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, DV], tl.float32)
    for n0 in range(start, end, BN):
        n = n0 + tl.arange(0, BN)
        inside = n < end
        k = tl.load(k_base + n[:, None].to(tl.int64) * stride_kl + offs_d[None, :], mask=inside[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC)
        if SCALED:
            scores *= tl.load(KS + s_base + n, mask=inside, other=0.0)[None, :]
        real = inside & (tl.load(REAL + b * stride_rb + n, mask=inside, other=0) != 0)
        scores = tl.where(real[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None].to(tl.int64) * stride_vl + offs_dv[None, :], mask=inside[:, None], other=0.0)
        if SCALED:
            p *= tl.load(VS + s_base + n, mask=inside, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
        m_i = m_new
    part = pid.to(tl.int64) * NSPLIT + split
    tl.store(PART_ML + (part * 2) * BG + r, m_i)
    tl.store(PART_ML + (part * 2 + 1) * BG + r, l_i)
    tl.store(PART_ACC + (part * BG + r[:, None]) * DV + offs_dv[None, :], acc)


@triton.jit
def _combine_kernel(PART_ACC, PART_ML, O, NSPLIT, H: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
                    DV: tl.constexpr):
    pid = tl.program_id(0)
    r, offs_dv = tl.arange(0, BG), tl.arange(0, DV)
    first = pid.to(tl.int64) * NSPLIT
    m_all = tl.full([BG], -1e30, tl.float32)
    for split in range(NSPLIT):
        m_all = tl.maximum(m_all, tl.load(PART_ML + ((first + split) * 2) * BG + r))
    l_all = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, DV], tl.float32)
    for split in range(NSPLIT):
        part = first + split
        weight = tl.exp(tl.load(PART_ML + (part * 2) * BG + r) - m_all)
        l_all += tl.load(PART_ML + (part * 2 + 1) * BG + r) * weight
        acc += tl.load(PART_ACC + (part * BG + r[:, None]) * DV + offs_dv[None, :]) * weight[:, None]
    b, h = (pid // H).to(tl.int64), pid % H
    rows = (b * H + h) * G + r
    tl.store(O + rows[:, None] * DV + offs_dv[None, :], (acc / l_all[:, None]).to(O.dtype.element_ty),
             mask=(r < G)[:, None])


def query_rows(groups: int) -> int:
    """Rows of a program's query tile: the kv head's G query heads, padded (tl.dot takes at least 16 rows)."""
    return max(16, next_power_of_2(groups))


@functools.cache
def _programs_wanted(device) -> int:
    """About two programs per multiprocessor (the CPU interpreter: a few)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def split_kv_stored_attention(query, keys, values, real, scale, key_scales=None, value_scales=None):
    """query [B, 1, HQ, D] against keys [B, H, L, D] and values [B, H, L, Dv] (the model's dtype, or float8 with
    float32 `key_scales` / `value_scales` [B, H, L]; each tensor's last dimension contiguous) at the positions whose
    `real` [B, L] flag is set: [B, 1, HQ, Dv] in the query's dtype. D and Dv are powers of two of at least 16."""
    batch, _, q_heads, head_dim = query.shape
    kv_heads, length, value_dim = keys.shape[1], keys.shape[2], values.shape[-1]
    groups = q_heads // kv_heads
    q = query.reshape(batch, q_heads, head_dim)
    if q.stride(-1) != 1:
        q = q.contiguous()
    scaled = key_scales is not None
    if scaled and (key_scales.stride() != value_scales.stride() or key_scales.stride(-1) != 1):
        key_scales, value_scales = key_scales.contiguous(), value_scales.contiguous()
    programs = batch * kv_heads
    splits = max(1, min(cdiv(_programs_wanted(query.device), programs), cdiv(length, MIN_SPLIT_TILES * BLOCK_N)))
    split_len = cdiv(cdiv(length, splits), BLOCK_N) * BLOCK_N
    splits = cdiv(length, split_len)
    rows = query_rows(groups)
    part_acc = torch.empty(programs * splits, rows, value_dim, dtype=torch.float32, device=query.device)
    part_ml = torch.empty(programs * splits, 2, rows, dtype=torch.float32, device=query.device)
    out = torch.empty(batch, 1, q_heads, value_dim, dtype=query.dtype, device=query.device)
    flags = real.view(torch.uint8) if real.dtype == torch.bool else real
    scale_tensors = (key_scales, value_scales) if scaled else (flags, flags)  # (unread placeholders when unscaled)
    scale_strides = key_scales.stride()[:2] if scaled else (0, 0)
    launch(_partials_kernel, (programs, splits), q, keys, values, *scale_tensors, flags, part_acc, part_ml,
           q.stride(0), q.stride(1), *keys.stride()[:3], *values.stride()[:3], *scale_strides, flags.stride(0),
           length, split_len, splits, float(scale),
           H=kv_heads, G=groups, BG=rows, D=head_dim, DV=value_dim, BN=BLOCK_N, SCALED=scaled,
           PREC=dot_precision(query.dtype), num_warps=4, num_stages=2)
    launch(_combine_kernel, (programs,), part_acc, part_ml, out, splits,
           H=kv_heads, G=groups, BG=rows, DV=value_dim, num_warps=4, num_stages=1)
    return out
