"""The training-path kernels in bf16 on real-like inputs (`real_like.py`: aligned large q/k, long-memory gates with a
few resetting slots, slot_bias -4) under the Triton CPU interpreter with GPU-like bf16 / TF32 numerics
(`interp_numerics.py`), against the float64 reference: the CPU counterpart of
`test_kernel_chunk.py::test_real_like_inputs_match_float64_reference`, ~20 s.

Needs Triton (skipped without it; no GPU needed). Runs in a subprocess: TRITON_INTERPRET must be set before the
kernels are defined. Shape: the converted SmolLM2's class (3 query heads per kv head, D=64, M=64, w=64), T=130
(three stream chunks, the last partial), left padding.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from interp_support import require_interpreter_triton, run_interp_script  # noqa: E402

require_interpreter_triton()


@pytest.mark.parametrize("shape", [(130, 3, 1, 64, 64, 64, 2)], ids=lambda s: "T{}_g{}-{}_D{}_M{}_w{}_b{}".format(*s))
def test_bf16_kernels_on_real_like_inputs_under_interpreter(shape):
    run_interp_script("interp_real_like.py", *shape, "bfloat16", expect="OK")
