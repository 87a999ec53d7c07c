"""Triton helpers shared by the chunked kernels: the layout of their operands and of their row blocks.

Every operand is a contiguous [B, T, heads, dim] tensor (`chunk_inputs.Prepared` makes the inputs so, the wrappers
allocate the outputs so). A row block holds the G query heads of one kv head for a block of tokens, token-major:
row r is token r // G, query head h * G + r % G, so key and value tiles load once per kv head (GQA without
expanding them).
"""

import triton
import triton.language as tl


@triton.jit
def token_strides(HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr):
    """Token and head strides of the contiguous operands: q (token only), k, v, o (token only); the gates'
    [B, T, H, M] are H * M and M. Constants, not launch arguments: each argument costs host time in Triton's
    launcher. The batch strides depend on T and stay arguments (`chunk_inputs.batch_strides`): derived in the kernels
    they would be values held in registers, where arguments sit in the constant bank."""
    return HQ * D, H * D, D, H * DV, DV, HQ * DV


@triton.jit
def real(MASK, b, T, j, valid):
    """valid & whether tokens j of sequence b are real under the attention mask MASK [B, T] (int32). MASK None (no
    mask: every token real) is a constexpr, so that specialization loads nothing."""
    if MASK is None:  # (one return after the branches: Triton compiles the code after a returning branch too)
        is_real = valid
    else:
        is_real = valid & (tl.load(MASK + b * T + j, mask=valid, other=0) > 0)
    return is_real


@triton.jit
def query_rows(T, H: tl.constexpr, GQ: tl.constexpr, CQB: tl.constexpr, BR: tl.constexpr):
    """The rows of a query-block program (axis 0: the block of CQB tokens from t0, axis 1: batch x kv head): BR rows
    (module docstring), tv the real ones. Returns (pid_bh, b, h, t0, r, tok, t, tv, hq), tok = r // GQ the token
    inside the block."""
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
    return pid_bh, b, h, t0, r, tok, t, tv, hq


@triton.jit
def row_lanes(h, GQ: tl.constexpr, CQB: tl.constexpr, BR: tl.constexpr):
    """The BR rows of a CQB-token query block: row r, its token r // GQ, its query head, whether it exists."""
    r = tl.arange(0, BR)
    return r, r // GQ, h * GQ + r % GQ, r < CQB * GQ


@triton.jit
def row_stats(LSE, DELTA, b, t, hq, tv, T, HQ: tl.constexpr):
    """Index lrow of the rows in [B, T, HQ] statistics, and their log-sum-exp and delta (zeros for DELTA None)."""
    lrow = (b * T + t).to(tl.int64) * HQ + hq
    lse = tl.load(LSE + lrow, mask=tv, other=float("inf"))
    if DELTA is None:
        delta = tl.zeros_like(lse)
    else:
        delta = tl.load(DELTA + lrow, mask=tv, other=0.0)
    return lrow, lse, delta


@triton.jit
def load_rows(Y, b, t, hq, tv, sy_b, sy_t, DX: tl.constexpr, offs_c):
    """Y[b, t, hq, offs_c] of a block's rows (0 where a row is out)."""
    return tl.load(Y + (b * sy_b + t.to(tl.int64) * sy_t + hq * DX)[:, None] + offs_c[None, :], mask=tv[:, None],
                   other=0.0)


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines at ptrs to be brought into L2 (PTX prefetch.global.L2): no register is held and
    nothing waits, so a later load of them waits on L2 instead of DRAM. The fused forward runs one program per
    multiprocessor (255 registers), whose loads otherwise expose DRAM latency one after another."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(X, row_off, DX: tl.constexpr):
    """prefetch_l2 of the rows of DX elements of X at the element offsets row_off (DX x X's element size a power of
    two of at least 128 bytes: `chunk_inputs.Prepared.prefetchable`)."""
    PER_LINE: tl.constexpr = 1024 // X.dtype.element_ty.primitive_bitwidth
    prefetch_l2(X + (row_off[:, None] + tl.arange(0, DX // PER_LINE)[None, :] * PER_LINE))
