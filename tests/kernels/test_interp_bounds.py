"""Every Triton kernel of the training path (fused forward, state scans, window and slot backward) run by the
Triton CPU interpreter under the out-of-bounds checker of `interp_bounds.py`: each tensor argument sits in a
private buffer with guard zones, and every active address of every load, store and atomic must fall inside
its tensor. The interpreter alone reads and writes stray addresses silently; on the GPU they are an illegal
memory access (H200 run of v4: the (T=1000, 4/4 heads, D=128, M=128, w=64) combination).

Needs Triton (skipped without it; no GPU needed). Runs in a subprocess, since TRITON_INTERPRET must be set
before the kernels are defined. The shape is that class, small: one kv head per query head (8-token row
blocks half empty in the slot backward), D=128 in two column passes, M=128 slots, T not a multiple of the
64-token chunk, left padding, window 64 (the stream shifted by a whole chunk).
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from interp_support import require_interpreter_triton, run_interp_script  # noqa: E402

require_interpreter_triton()


@pytest.mark.parametrize("shape", [(70, 1, 1, 128, 128, 64, 2)], ids=lambda s: "T{}_g{}-{}_D{}_M{}_w{}_b{}".format(*s))
def test_training_kernels_stay_in_bounds_under_interpreter(shape):
    run_interp_script("interp_bounds.py", *shape, expect="in bounds")


def test_two_level_chunk_scans_match_under_interpreter():
    run_interp_script("interp_chunk_scan.py", expect="OK")


def test_prefill_with_carried_state_matches_under_interpreter():
    run_interp_script("interp_carried_state.py", expect="OK")


def test_in_place_decode_step_matches_under_interpreter():
    run_interp_script("interp_decode.py", expect="OK")


def test_calls_beyond_int32_offsets_run_in_batch_slices_under_interpreter():
    run_interp_script("interp_batch_slices.py", expect="OK")


def test_forwards_without_gradients_take_the_inference_chunk_under_interpreter():
    run_interp_script("interp_chunk_routing.py", expect="OK")
