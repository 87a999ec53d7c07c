"""The rounding residual of a training forward's output, so the backward gets the fp32 output back from o.

The backward needs delta = sum P * dP exactly; rowsum(dO * O) of the bf16 output is ~2e-3 off, which the slot_bias
gradient (a cancellation) does not survive. So a training forward on bf16/fp16 inputs forms its output from
unrounded weights in fp32 and stores, beside o, the difference of the fp32 output's and o's bit patterns shifted to
int8 (half of o's spacing is 2^15 bf16 or 2^12 fp16 units in the last place of fp32): o with it is the fp32 output
to 2^-15 of o (bf16), at one byte per element.
"""

import triton
import triton.language as tl


@triton.jit
def residual_shift(o):
    """Bits the int8 residual of `o` (bf16/fp16 as stored) drops from the fp32 bit patterns' difference."""
    return 8 if o.dtype == tl.bfloat16 else 5


@triton.jit
def store_rounded(O, ORES, o_off, cols, out, tv):
    """o[:, cols] = out rounded to o's dtype and, unless ORES is None, its int8 rounding residual."""
    rounded = out.to(O.dtype.element_ty)
    tl.store(O + o_off[:, None] + cols[None, :], rounded, mask=tv[:, None])
    if ORES is not None:  # the fp32 bit patterns' difference (same sign: monotonic), shifted, the tie's +128 clamped
        units = out.to(tl.int32, bitcast=True) - rounded.to(tl.float32).to(tl.int32, bitcast=True)
        residual = tl.minimum(tl.maximum(units >> residual_shift(rounded), -127), 127)
        tl.store(ORES + o_off[:, None] + cols[None, :], residual.to(tl.int8), mask=tv[:, None])


@triton.jit
def with_residual(o, residual):
    """The fp32 output from `o` as stored and its int8 residual as `store_rounded` stored it."""
    out = o.to(tl.float32).to(tl.int32, bitcast=True) + (residual.to(tl.int32) << residual_shift(o))
    return out.to(tl.float32, bitcast=True)
