"""Triton helpers shared by the chunked kernels: the gate sums and decays that weight a chunk's tokens in the slots.

Stream position u holds token j = u - W (the window W shifts the slot stream), chunks hold CS stream positions. With
a the chunk's inclusive prefix sums of the log gates, token j reaches the state read at row u with weight
exp(a_u - a_j) s_j, s_j = 1 - alpha_j. Inside a chunk these weights are factored around the start of each query
block (`block_split`): tokens before the block take exp(a_u - a_ref) exp(a_ref - a_j), both <= 1, and so do the
block's own tokens unless the block decays a slot by more than BLOCK_FACTOR_LIMIT nats; then they take direct
weights exp(a_u - a_j) s_j, one rank-1 update per token (`block_token_decay`), so no decay can overflow.
"""

import triton
import triton.language as tl

from ...utils.products import dot_xa
from .rows import real

# nats: a query block whose own tokens decay a slot by at most this takes them in the factored product (exp(40) is
# far from fp32 overflow); a block that resets a slot harder walks them with direct weights
BLOCK_FACTOR_LIMIT = tl.constexpr(40.0)


@triton.jit
def prefix_sums(g, incl):
    """incl [R, K] (0/1) . g [K, MT] with the gates g as loaded (the inputs' dtype): the gate sums each row selects
    (the prefix sums of a chunk or of a query block) as one matrix product, exact products summed in fp32, instead
    of tl.cumsum's shuffle tree (~10% of the fused forward's warp samples). Only for tiles of 64 slots or more: with
    32 the H200 got the key kernels' gradients wrong at 64-token chunks (Triton 3.6; right under the interpreter)."""
    if g.dtype == tl.float32:
        return tl.dot(incl.to(tl.float32), g, input_precision="ieee")
    return tl.dot(incl.to(g.dtype), g)


@triton.jit
def chunk_cumsum(g, CSZ: tl.constexpr):
    """The chunk's inclusive prefix sums of its gates g [CS, MT] (as loaded), fp32: `prefix_sums` for tiles of at
    least 64 slots, else tl.cumsum."""
    if g.shape[1] < 64:
        a = tl.cumsum(g.to(tl.float32), axis=0)
    else:
        offs = tl.arange(0, CSZ)
        a = prefix_sums(g, offs[None, :] <= offs[:, None])
    return a


@triton.jit
def chunk_gates(G, MASK, b, h, sg_b, sg_t, sg_h, cs0, T, W, limit_u, M: tl.constexpr, CSZ: tl.constexpr):
    """The stream chunk from cs0 (positions u < limit_u): its masked gates (fp32), their cumsum, the tokens' positions
    j and which are real."""
    offs_u = tl.arange(0, CSZ)
    u = cs0 + offs_u
    j = u - W
    jv = (j >= 0) & (j < T - W) & (u < limit_u)
    jr = real(MASK, b, T, j, jv)
    offs_m = tl.arange(0, M)
    g = tl.load(G + b * sg_b + j[:, None].to(tl.int64) * sg_t + h * sg_h + offs_m[None, :], mask=jr[:, None],
                other=0.0)
    return g.to(tl.float32), chunk_cumsum(g, CSZ), j, jr


@triton.jit
def row_decay(G, MASK, b, h, sg_b, sg_t, sg_h, t0, tok, first_head, T, W, CQB: tl.constexpr, M: tl.constexpr,
              MT: tl.constexpr, BY_SCAN: tl.constexpr):
    """Per row (token t0 + tok of the query block from t0, one of its heads): the summed log gates of the stream
    positions from the block's start to the row's token inclusive. [rows, MT]: M slots, zero in the padding
    columns of a wider slot tile MT >= M.
    One product of the block's gates [CQB, MT] with the rows' token masks (`prefix_sums`, tiles of 64 slots or more);
    BY_SCAN or narrower tiles: tl.cumsum over the rows, each token's gates loaded into its `first_head` row (the key
    kernels, where the product's tiles spill)."""
    SCAN: tl.constexpr = BY_SCAN | (MT < 64)
    offs_m = tl.arange(0, MT)
    if SCAN:
        j = t0 + tok - W
        jv = first_head & (j >= 0) & (j < T - W)
    else:
        BK: tl.constexpr = 16 if CQB < 16 else CQB  # a matrix product's inner size is at least 16
        i = tl.arange(0, BK)
        j = t0 + i - W
        jv = (i < CQB) & (j >= 0) & (j < T - W)
    jr = real(MASK, b, T, j, jv)
    g = tl.load(G + b * sg_b + j[:, None].to(tl.int64) * sg_t + h * sg_h + offs_m[None, :],
                mask=jr[:, None] & (offs_m < M)[None, :], other=0.0)
    if SCAN:
        a_in = tl.cumsum(g.to(tl.float32), axis=0)
    else:
        a_in = prefix_sums(g, i[None, :] <= tok[:, None])
    return a_in


@triton.jit
def block_split(g, off, CQB: tl.constexpr, CSZ: tl.constexpr):
    """How the chunk's tokens enter the query block at chunk offset off (g: the chunk's masked gates [CS, M]).
    Returns a_ref (the summed gates before the block, [M]); `factored` [CS]: the tokens whose slot weights take the
    factored form exp(a_u - a_ref) * exp(a_ref - a_j); `direct`: whether the block's own tokens need direct weights
    (module docstring)."""
    offs_u = tl.arange(0, CSZ)
    before = offs_u < off
    inside = (offs_u >= off) & (offs_u < off + CQB)
    a_ref = tl.sum(tl.where(before[:, None], g, 0.0), 0)
    decay = tl.max(tl.sum(tl.where(inside[:, None], -g, 0.0), 0), 0)
    return a_ref, tl.where(decay <= BLOCK_FACTOR_LIMIT, before | inside, before), decay > BLOCK_FACTOR_LIMIT


@triton.jit
def cumsum_row(a, u, CSZ: tl.constexpr):
    """Row u of the chunk's gate cumsum a [CS, M] (zeros for u = -1: nothing before the chunk's first token)."""
    return tl.sum(tl.where(tl.arange(0, CSZ)[:, None] == u, a, 0.0), 0)


@triton.jit
def block_split_bounds(a_ref, a_last, off, CQB: tl.constexpr, CSZ: tl.constexpr):
    """`block_split`'s (factored, direct) from the chunk's summed gates before the block, a_ref, and through its
    last token, a_last ([M] each)."""
    offs_u = tl.arange(0, CSZ)
    before = offs_u < off
    inside = (offs_u >= off) & (offs_u < off + CQB)
    decay = tl.max(a_ref - a_last, 0)
    return tl.where(decay <= BLOCK_FACTOR_LIMIT, before | inside, before), decay > BLOCK_FACTOR_LIMIT


@triton.jit
def carried_block_split(a, a_ref, off, CQB: tl.constexpr, CSZ: tl.constexpr):
    """`block_split` of the block at chunk offset off from the gates' cumsum a, given a_ref, the chunk's gates before
    it (in a loop over the chunk's blocks the previous block's end, carried; zeros for the first): one row of a per
    block instead of two sums of the gates, each a reduction across the warps. Returns (a_last, factored, direct),
    a_last this block's end: the next block's a_ref."""
    a_last = cumsum_row(a, off + CQB - 1, CSZ)
    factored, direct = block_split_bounds(a_ref, a_last, off, CQB, CSZ)
    return a_last, factored, direct


@triton.jit
def block_split_cumsum(a, off, CQB: tl.constexpr, CSZ: tl.constexpr):
    """`block_split` from the gates' cumsum a [CS, M] (two rows of it) instead of the gates."""
    a_ref = cumsum_row(a, off - 1, CSZ)
    _, factored, direct = carried_block_split(a, a_ref, off, CQB, CSZ)
    return a_ref, factored, direct


@triton.jit
def block_token_decay(G, MASK, b, h, sg_b, sg_t, sg_h, j, T, W, cum, a_in, seen, M: tl.constexpr, MT: tl.constexpr):
    """Token j of the query block: its decays to the rows that see it, exp(a_u - a_j) = exp(a_in - cum)
    [rows, MT] (cum: the block's summed log gates up to j, updated), and its write weight s_j [MT] (M slots,
    zero gates in the padding of a slot tile MT >= M)."""
    offs_m = tl.arange(0, MT)
    ok = (j >= 0) & (j < T - W)
    if MASK is not None:
        ok = ok & (tl.load(MASK + b * T + tl.minimum(tl.maximum(j, 0), T - 1)) > 0)
    jc = tl.where(ok, j, 0).to(tl.int64)  # a valid address either way (no scalar masks: the interpreter lacks them)
    g = tl.where(ok, tl.load(G + b * sg_b + jc * sg_t + h * sg_h + offs_m, mask=offs_m < M, other=0.0).to(tl.float32),
                 0.0)
    cum = cum + g
    return tl.where(seen[:, None], tl.exp(a_in - cum[None, :]), 0.0), 1.0 - tl.exp(g), cum


@triton.jit
def state_tile(S, st, CARRY, ct, dcum, offs_m, cols, M: tl.constexpr, DX: tl.constexpr):
    """Columns `cols` of the slot state before a chunk, [MT, len(cols)] (rows offs_m, zero past slot M): row st of S,
    or in the segment-local form (CARRY not None: `chunk_states.local_slot_states`) S's local state there plus the
    carry into the chunk's segment, row ct of CARRY, times the decay since the segment's start, dcum [MT]."""
    slots = (offs_m < M)[:, None]
    tile = tl.load(S + st * M * DX + offs_m[:, None] * DX + cols[None, :], mask=slots, other=0.0)
    if CARRY is not None:
        tile += dcum[:, None] * tl.load(CARRY + ct * M * DX + offs_m[:, None] * DX + cols[None, :], mask=slots,
                                        other=0.0)
    return tile


@triton.jit
def chunk_products(X, xrow, Y, yrow, S, st, CARRY, ct, dcum, tv, jr, offs_c, DX: tl.constexpr, BD: tl.constexpr,
                   M: tl.constexpr, MT: tl.constexpr, BR: tl.constexpr, CSZ: tl.constexpr, PREC: tl.constexpr,
                   SPREC: tl.constexpr):
    """The block rows of X (q or dO) against the chunk's tokens of Y (k or v) and against the state before the chunk
    (`state_tile` of S, CARRY), over column passes: ([rows, CS], [rows, MT]) fp32, zero past slot M."""
    offs_m = tl.arange(0, MT)
    xy = tl.zeros([BR, CSZ], dtype=tl.float32)
    xs = tl.zeros([BR, MT], dtype=tl.float32)
    for d0 in range(0, DX, BD):
        xd = tl.load(X + xrow[:, None] + d0 + offs_c[None, :], mask=tv[:, None], other=0.0)
        yd = tl.load(Y + yrow[:, None] + d0 + offs_c[None, :], mask=jr[:, None], other=0.0)
        sd = state_tile(S, st, CARRY, ct, dcum, offs_m, d0 + offs_c, M, DX)
        xy += tl.dot(xd, tl.trans(yd), input_precision=PREC)
        xs += dot_xa(xd.to(tl.float32), tl.trans(sd), SPREC)
    return xy, xs
