"""Out-of-bounds checker for Triton kernels run by the CPU interpreter (TRITON_INTERPRET=1).

The interpreter reads and writes raw host addresses: an access past a tensor lands in whatever memory is
there and goes unnoticed (on a GPU it is an illegal memory access, or silent corruption). Inside
`bounds_checked()`, every launch records the byte extent of each tensor argument, and every load, store and
atomic checks that each of its active (unmasked) addresses lies inside one of them; the first violation
raises `OutOfBounds` naming the kernel, the program id and the offending element offsets.

Developer tool and test helper; needs Triton (`pytest.importorskip("triton")` before importing it).
"""

import contextlib

import numpy as np
import torch
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


def run_operator(T, HQ, H, D, M, window, batch=2, side="left", decay=1.0, seed=0, variant=None):
    """nha_attention forward + backward (float32, CPU tensors, every Triton kernel of the training path) under
    `bounds_checked`; returns the output and gradients. Needs TRITON_INTERPRET=1 before Triton is imported.
    `variant`: a config.CONFIG_VARIANTS name (default: $NHA_VARIANT, else the defaults)."""
    import os

    from interp_support import NAMES, kernels_grad
    from nha_oracle import make_inputs, padding_mask

    inputs = make_inputs(batch, T, HQ, H, D, M, dtype=torch.float32, seed=seed, decay=decay)
    mask = padding_mask(batch, T, side)
    d_o = torch.randn(batch, T, HQ, D, generator=torch.Generator().manual_seed(seed))
    return kernels_grad({n: inputs[n] for n in NAMES}, window, inputs["scale"], mask, d_o,
                        variant or os.environ.get("NHA_VARIANT"), hooks=[bounds_checked()])


if __name__ == "__main__":  # [NHA_VARIANT=name] python tests/kernels/interp_bounds.py T HQ H D M WINDOW [BATCH]
    import os
    import sys
    import time

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    args = [None if a == "None" else int(a) for a in sys.argv[1:]]
    start = time.time()
    out, grads = run_operator(*args)
    finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    print(f"in bounds: {sys.argv[1:]} variant {os.environ.get('NHA_VARIANT') or 'defaults'} "
          f"({time.time() - start:.1f} s), finite: {finite}")
    sys.exit(0 if finite else 1)
