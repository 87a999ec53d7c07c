"""Test helpers for Triton kernels run by the CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py on
machines without CUDA, before any kernel is defined). They follow the interpreter internals of Triton >= 3.9.

- `bounds_checked()`: the interpreter reads and writes raw host addresses, so an access past a tensor lands in
  whatever memory is there and goes unnoticed (on a GPU it is an illegal memory access, or silent corruption).
  Inside it, every launch runs each tensor argument on a private copy of its storage with guard zones on both sides,
  and every load, store and atomic checks that each of its active (unmasked) addresses lies inside one of the
  launch's tensors; the first violation raises `OutOfBounds` naming the kernel, the program and the offsets.
- `gpu_numerics()`: the stock interpreter stores bf16 as raw uint16 bits and multiplies those bits as integers in
  `tl.dot`, converts fp32 -> bf16 by truncation, and ignores `input_precision`. Inside it, fp32 -> bf16 casts round
  to nearest even (as `cvt.rn.bf16.f32`), `tl.dot` decodes bf16 operands to fp32 (products of two bf16 are exact in
  fp32 accumulation, as the MMA), and fp32 operands of a "tf32" dot are rounded to TF32, of a "tf32x3" dot split
  into hi + lo (hi.hi + hi.lo + lo.hi, as Triton emits it); "ieee" stays exact. So a bf16 run sees the GPU's input
  roundings (the accumulation order inside an MMA still differs).
- importing it under the interpreter makes `tl.associative_scan` with a combine function take one combine call per
  step on whole slices (Triton's calls it once per element from Python: minutes per chained-scan launch).
"""

import contextlib
import os

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter as _interp


class OutOfBounds(AssertionError):
    pass


_STATE = {"ranges": None, "kernel": None, "hits": []}


def _extent(t):
    """[start, end) in bytes of a tensor view (the elements it can address)."""
    if t.numel() == 0:
        return None
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _check(ptrs, mask, nbytes, what):
    ranges = _STATE["ranges"]
    if ranges is None:
        return
    p = np.asarray(ptrs, dtype=np.uint64).reshape(-1)
    m = np.ones(p.shape, dtype=bool) if mask is None else np.broadcast_to(np.asarray(mask), np.shape(ptrs)).reshape(-1)
    p = p[m.astype(bool)]
    if p.size == 0:
        return
    ok = np.zeros(p.shape, dtype=bool)
    for lo, hi, _ in ranges:
        ok |= (p >= np.uint64(lo)) & (p + np.uint64(nbytes) <= np.uint64(hi))
    if ok.all():
        return
    bad = p[~ok]
    # describe the nearest argument below each bad address
    lines = []
    for addr in bad[:6]:
        below = [(int(addr) - lo, name, lo, hi) for lo, hi, name in ranges if lo <= int(addr)]
        if below:
            d, name, lo, hi = min(below)
            lines.append(f"{name}+{d // nbytes} elements (size {(hi - lo) // nbytes})")
        else:
            lines.append(f"{int(addr):#x} below every argument")
    b = _interp.interpreter_builder
    msg = (f"{what} out of bounds in {_STATE['kernel']} program {tuple(b.grid_idx)}: {bad.size} addresses, "
           f"e.g. {'; '.join(lines)}")
    _STATE["hits"].append(msg)
    raise OutOfBounds(msg)


def _nbytes(handle):
    return np.dtype(_interp._get_np_dtype(handle.get_element_ty())).itemsize


@contextlib.contextmanager
def bounds_checked():
    """Patch the interpreter for the duration: every kernel launch is bounds-checked. Yields the list of
    violation messages (the first one also raises)."""
    B = _interp.InterpreterBuilder
    G = _interp.GridExecutor
    saved = {n: getattr(B, n) for n in ("create_masked_load", "create_masked_store", "create_atomic_rmw",
                                         "create_atomic_cas")}
    saved_call = G.__call__

    # the trailing cache / eviction arguments differ between Triton versions (3.6: cache_modifier,
    # eviction_policy[, is_volatile]; 3.9: cache_policy[, is_volatile]): passed through as they come
    def masked_load(self, ptrs, mask, other, *rest):
        _check(ptrs.data, mask.data, _nbytes(ptrs), "load")
        return saved["create_masked_load"](self, ptrs, mask, other, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        _check(ptrs.data, mask.data, _nbytes(ptrs), "store")
        return saved["create_masked_store"](self, ptrs, value, mask, *rest)

    def atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        _check(ptr.data, mask.data, _nbytes(ptr), "atomic")
        return saved["create_atomic_rmw"](self, rmwOp, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        _check(ptr.data, None, _nbytes(ptr), "atomic_cas")
        return saved["create_atomic_cas"](self, ptr, cmp, val, sem, scope)

    def call(self, *args, **kwargs):
        # every tensor argument runs on a private copy of its storage with guard zones on both sides, so an
        # access that strays from its tensor into a neighbour's memory lands in a guard (outside every range)
        names = list(self.arg_names)
        copies, ranges = {}, []

        def guarded(a, name):
            st = a.untyped_storage()
            key = st.data_ptr()
            if key not in copies:
                n = st.nbytes()
                guard = (max(n, 1 << 16) + 15) // 16 * 16
                big = torch.empty(guard + n + guard, dtype=torch.uint8)
                big.fill_(0xFF)  # NaN for floats, -1 for ints
                big[guard:guard + n].copy_(torch.empty(0, dtype=torch.uint8).set_(st))
                copies[key] = (st, big, guard, n)
            st0, big, guard, n = copies[key]
            esz = a.element_size()
            view = big.view(a.dtype).as_strided(a.shape, a.stride(), guard // esz + a.storage_offset())
            e = _extent(view)
            if e is not None:
                ranges.append((e[0], e[1], name))
            return view

        new_args = []
        for i, a in enumerate(args):
            u = _interp._unwrap_tensor(a)
            if isinstance(u, torch.Tensor):
                new_args.append(guarded(u, names[i] if i < len(names) else f"arg{i}"))
            else:
                new_args.append(a)
        new_kwargs = {k: guarded(v, k) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        prev = _STATE["ranges"], _STATE["kernel"]
        _STATE["ranges"], _STATE["kernel"] = ranges, self.fn.__name__
        try:
            result = saved_call(self, *new_args, **new_kwargs)
        finally:
            _STATE["ranges"], _STATE["kernel"] = prev
        for st, big, guard, n in copies.values():
            if not (bool((big[:guard] == 0xFF).all()) and bool((big[guard + n:] == 0xFF).all())):
                msg = f"guard zone written in {self.fn.__name__}"
                _STATE["hits"].append(msg)
                raise OutOfBounds(msg)
            torch.empty(0, dtype=torch.uint8).set_(st).copy_(big[guard:guard + n])
        return result

    B.create_masked_load, B.create_masked_store = masked_load, masked_store
    B.create_atomic_rmw, B.create_atomic_cas = atomic_rmw, atomic_cas
    G.__call__ = call
    _STATE["hits"] = []
    try:
        yield _STATE["hits"]
    finally:
        for n, f in saved.items():
            setattr(B, n, f)
        G.__call__ = saved_call


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


def _scan_by_slices(self, input):
    """`tl.associative_scan` with a combine function under the interpreter: the same sequential scan along the axis,
    one combine call per step on whole slices. Triton's (`ScanOps.generic_scan`) calls it once per element from
    Python, which made the chained state scans' [16, 512] blocks take minutes per launch."""
    import numpy as np

    datas = [arg.handle.data for arg in input]
    outs = [np.empty_like(d) for d in datas]
    index = [slice(None)] * datas[0].ndim
    acc = None
    for i in range(datas[0].shape[self.axis]):
        index[self.axis] = slice(i, i + 1)
        step = [d[tuple(index)] for d in datas]
        if acc is not None:
            combined = self.combine_fn.fn(*(self.to_tensor(a, arg.dtype) for a, arg in zip(acc, input)),
                                          *(self.to_tensor(x, arg.dtype) for x, arg in zip(step, input)))
            step = [c.handle.data for c in (combined if isinstance(combined, tuple) else (combined,))]
        for out, x in zip(outs, step):
            out[tuple(index)] = x
        acc = step
    return [self.to_tensor(out, arg.dtype) for out, arg in zip(outs, input)]


if os.environ.get("TRITON_INTERPRET") == "1":
    _interp.ScanOps.generic_scan = _scan_by_slices
