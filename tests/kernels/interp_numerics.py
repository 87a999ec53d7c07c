"""GPU-like numerics for the Triton CPU interpreter (TRITON_INTERPRET=1): bf16 and TF32 as the GPU rounds them.

The stock interpreter (Triton 3.9) stores bf16 as raw uint16 bits and multiplies those bits as integers in
`tl.dot` (garbage), converts fp32 -> bf16 by truncation instead of round-to-nearest-even, and ignores
`input_precision` (every fp32 product is exact fp32). Inside `gpu_numerics()`:
- fp32 -> bf16 casts round to nearest even (as `cvt.rn.bf16.f32`);
- `tl.dot` decodes bf16 operands to fp32 (products of two bf16 are exact in fp32 accumulation, as the MMA);
- fp32 operands of a dot with input_precision "tf32" are rounded to TF32 (10 explicit mantissa bits, nearest
  even), and with "tf32x3" split into hi = tf32(x) and lo = tf32(x - hi), the product formed as
  hi.hi + hi.lo + lo.hi (the three MMAs Triton emits); "ieee" stays exact fp32.

So a bf16 run of the kernels under the interpreter sees the same input roundings as the H200 (accumulation
order inside an MMA still differs: fp32 sums in another order). Developer tool and test helper; needs Triton.
"""

import contextlib

import numpy as np
import triton.language as tl
from triton.runtime import interpreter as _interp


def _bf16_bits_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16_bits(x):
    """Round to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, np.uint32(0x7FC0), rounded).astype(np.uint16)


def _tf32(x):
    """fp32 rounded to TF32 (10 explicit mantissa bits), nearest even; inf/NaN kept."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    r = ((u + np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), r, x)


def _operand(handle):
    data = handle.data
    if handle.dtype.scalar == tl.bfloat16:
        return _bf16_bits_to_f32(data), True
    return data, handle.dtype.scalar != tl.float32


def _precision_name(input_precision):
    if input_precision is None:
        return "tf32"
    name = getattr(input_precision, "name", str(input_precision)).lower()
    return name.replace("inputprecision.", "")


@contextlib.contextmanager
def gpu_numerics():
    B = _interp.InterpreterBuilder
    saved_dot, saved_cast = B.create_dot, B.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, a_low = _operand(a)
        b_data, b_low = _operand(b)
        acc = d.data.dtype
        if a_low or b_low or acc != np.float32:
            if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
                out = np.matmul(a_data.astype(np.float32), b_data.astype(np.float32), dtype=np.float32)
                return _interp.TensorHandle(out.astype(acc) + d.data, d.dtype.scalar)
            return saved_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        prec = _precision_name(input_precision)
        if prec == "ieee":
            out = np.matmul(a_data, b_data, dtype=np.float32)
        elif prec in ("tf32x3", "tf32_x3"):
            ah, bh = _tf32(a_data), _tf32(b_data)
            al, bl = _tf32(a_data - ah), _tf32(b_data - bh)
            out = (np.matmul(ah, bl, dtype=np.float32) + np.matmul(al, bh, dtype=np.float32)) + np.matmul(
                ah, bh, dtype=np.float32)
        else:  # tf32
            out = np.matmul(_tf32(a_data), _tf32(b_data), dtype=np.float32)
        return _interp.TensorHandle(out + d.data, d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if s == tl.float32 and t == tl.bfloat16:
            return _interp.TensorHandle(_f32_to_bf16_bits(src.data), t)
        if s == tl.bfloat16 and t == tl.float32:
            return _interp.TensorHandle(_bf16_bits_to_f32(src.data), t)
        return saved_cast(self, src, dst_type)

    B.create_dot, B.cast_impl = create_dot, cast_impl
    try:
        yield
    finally:
        B.create_dot, B.cast_impl = saved_dot, saved_cast
