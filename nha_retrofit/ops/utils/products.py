"""Matrix products of fp32 operands at a chosen precision (Triton helpers for kernels).

The slot states and the decay-weighted slot weights are fp32, and the slot logits must be near fp32-exact (the
backward's P = exp(l - L) has to match the forward's L; plain TF32 broke the log_alpha gradient).
SPREC names how an fp32 x fp32 product is formed:
- "ieee": exact fp32 (fp32 inputs);
- "tf32": one TF32 MMA (10 mantissa bits per operand);
- "tf32x3": hi.hi + hi.lo + lo.hi with TF32 hi/lo splits (Triton's own), ~fp32 accuracy;
- "bf16x3": the same with bf16 hi/lo splits: three bf16 MMAs (twice the tensor-core rate of TF32, operands half
  the registers), about 2^-16 relative per product instead of ~2^-21;
- "bf16": one bf16 MMA of both operands rounded (2^-9 relative per operand, as flash attention's P . V).
A product with one operand exact in the split format (bf16/fp16 inputs upcast to fp32 and 0/1 selections for
TF32; bf16 inputs for bf16, see `product_precision`) needs only two MMAs: `dot_xa` / `dot_xb` split just the
other operand (the third MMA would multiply the exact operand's zero low part: the same accuracy).
"""

import torch
import triton
import triton.language as tl


def dot_precision(dtype):
    """input_precision of tl.dot on two input tiles of `dtype`: exact fp32 for fp32 inputs, else bf16/fp16 MMAs
    (exact products, fp32 accumulation; "tf32" only matters for fp32 operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def product_precision(name, dtype):
    """The SPREC for fp32 products of a kernel whose inputs are `dtype`: "ieee" for fp32 inputs, else `name`,
    except that for fp16 inputs "bf16x3" falls back to "tf32x3" (fp16 values are exact in TF32, not in bf16) and
    "bf16" to "tf32"."""
    if dtype == torch.float32:
        return "ieee"
    if dtype != torch.bfloat16:
        return {"bf16x3": "tf32x3", "bf16": "tf32"}.get(name, name)
    return name


@triton.jit
def _tf32_hi(x):
    """x with the 13 low mantissa bits cleared (exact in TF32); x - _tf32_hi(x) is exact in fp32."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_split(x):
    """(hi, lo) bf16 with hi + lo = x to about 2^-16 relative."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def dot_f32(a, b, SPREC: tl.constexpr):
    """a . b for fp32 a and b at SPREC (module docstring)."""
    if SPREC == "bf16x3":
        ah, al = _bf16_split(a)
        bh, bl = _bf16_split(b)
        return tl.dot(ah, bh, tl.dot(al, bh, tl.dot(ah, bl)))
    elif SPREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision=SPREC)


@triton.jit
def dot_hilo(a, b):
    """a . b for fp32 a and a bf16/fp16 b: a split into hi + lo in b's dtype, two MMAs, so the product does not
    carry a's rounding to b's dtype (about 2^-16 relative instead of 2^-9 for bf16)."""
    hi = a.to(b.dtype)
    return tl.dot(hi, b, tl.dot((a - hi.to(tl.float32)).to(b.dtype), b))


@triton.jit
def dot_xb(a, b, SPREC: tl.constexpr):
    """a . b for fp32 a and an fp32 b whose values are exact in the split format of SPREC."""
    if SPREC == "tf32x3":
        hi = _tf32_hi(a)
        return tl.dot(hi, b, tl.dot(a - hi, b, input_precision="tf32"), input_precision="tf32")
    elif SPREC == "bf16x3":
        return dot_hilo(a, b.to(tl.bfloat16))
    else:
        return dot_f32(a, b, SPREC)


@triton.jit
def dot_xa(a, b, SPREC: tl.constexpr):
    """a . b for an fp32 a whose values are exact in the split format of SPREC and fp32 b."""
    if SPREC == "tf32x3":
        hi = _tf32_hi(b)
        return tl.dot(a, hi, tl.dot(a, b - hi, input_precision="tf32"), input_precision="tf32")
    elif SPREC == "bf16x3":
        aa = a.to(tl.bfloat16)
        bh, bl = _bf16_split(b)
        return tl.dot(aa, bh, tl.dot(aa, bl))
    else:
        return dot_f32(a, b, SPREC)
