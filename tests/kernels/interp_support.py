"""Which Triton interpreters the CPU interpreter tests run on.

The hooks of `interp_bounds.py` and `interp_numerics.py` follow the interpreter internals of Triton >= 3.9
(InterpreterBuilder methods, TensorHandle, GridExecutor). Triton 3.6 (the H200 machine's version) differs there,
and its interpreter itself fails on recent numpy (2.4 here) before any hook runs (`int()` of a one-element array in
`range(NCH)`: "only 0-dimensional arrays can be converted to Python scalars"), so on < 3.9 the interpreter
tests skip with this reason instead of failing; on >= 3.9 nothing is skipped.
"""

import pytest


def require_interpreter_triton():
    triton = pytest.importorskip("triton")
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}: the interpreter hooks follow Triton >= 3.9's interpreter "
                    "(3.6's builder signatures differ and its interpreter fails on recent numpy: int() of "
                    "one-element arrays); run the interpreter tests with Triton >= 3.9 (e.g. on the CPU machine)",
                    allow_module_level=True)
