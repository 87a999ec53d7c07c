"""CONFIG variants of the kernels under the Triton CPU interpreter against float64 (`interp_variant.py`): fp32
under the out-of-bounds checker (every tensor <= 1e-5), bf16 with GPU-like numerics at the defaults' error
level. Covers the slot backward (defaults and its launch variants) on odd shapes: T not a multiple of
the 64-token chunk, GQA 3:1 and 1:1, D=64 and 128, M=32/64/128, left and right padding, strong decay, real-like
inputs, windows shifting the slot stream by a whole chunk or a few tokens.

Needs Triton >= 3.9 (skipped otherwise, `interp_support.py`; no GPU needed). Each case runs in a subprocess
(TRITON_INTERPRET must be set before the kernels are defined), ~10-30 s on 2 CPU cores.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from interp_support import require_interpreter_triton, run_interp_script  # noqa: E402

require_interpreter_triton()

# (variant, (T, HQ, H, D, M, window, batch, dtype, decay, inputs, padding side))
CASES = [
    ("defaults", (100, 6, 2, 64, 32, 64, 2, "float32", 8.0, "random", "left")),
    ("defaults", (70, 1, 1, 128, 128, 64, 2, "float32", 1.0, "random", "left")),
    ("defaults", (90, 3, 1, 64, 64, 5, 1, "bfloat16", 1.0, "real_like", "right")),
    ("slot_bwd_block8", (90, 4, 2, 64, 32, 3, 2, "float32", 1.0, "random", "left")),
    # decay 2: factored and direct query blocks (CONFIG["block_factor_limit"]) mixed in one run
    ("defaults", (130, 4, 2, 64, 64, 64, 1, "float32", 2.0, "random", "left")),
    # no attention mask: the kernels' maskless specialization (MASK None), and an all-ones mask loaded as before
    ("defaults", (100, 4, 2, 64, 64, 30, 2, "float32", 1.0, "random", "none")),
    ("defaults", (130, 8, 2, 128, 64, 40, 1, "bfloat16", 2.0, "real_like", "none")),
    ("ones_mask", (100, 4, 2, 64, 64, 30, 2, "float32", 1.0, "random", "none")),
    # delta from a window pass plus the slot share (the default before session 21: now rowsum(dO * O) of the
    # training forward's fp32-accurate output)
    ("delta_pass", (63, 9, 3, 64, 32, 1, 1, "bfloat16", 1.0, "random", "left")),
    ("defaults", (50, 4, 2, 64, 32, 64, 2, "float32", 1.0, "random", "left")),  # window >= T: no slot half
    ("slot_bwd_split_keys", (130, 4, 2, 64, 64, 5, 1, "float32", 2.0, "random", "right")),
    ("fwd_window_first", (90, 3, 1, 64, 32, 5, 2, "float32", 1.0, "random", "right")),
    ("defaults", (90, 6, 2, 64, 64, 5, 2, "float16", 1.0, "random", "left")),
    ("slot_bwd_rows32", (100, 8, 2, 64, 32, 40, 2, "float32", 2.0, "random", "left")),
    ("window_bwd_block32", (100, 8, 2, 64, 32, 40, 2, "float32", 2.0, "random", "left")),
    ("separate_kv_states", (100, 8, 2, 64, 64, 40, 2, "float32", 2.0, "random", "left")),
    ("recompute_states", (100, 4, 2, 64, 64, 30, 2, "float32", 2.0, "random", "left")),  # the pre-session-11 default
    ("recompute_logits", (130, 4, 2, 64, 64, 64, 1, "float32", 2.0, "random", "left")),  # the pre-session-17 default
    # 64-token chunks in training (the defaults train with 32), mixed blocks
    ("train_chunk64", (130, 8, 2, 64, 64, 20, 2, "float32", 2.0, "random", "left")),
    ("train_chunk64", (90, 3, 1, 64, 32, 5, 1, "bfloat16", 8.0, "real_like", "right")),
    ("keys_da_rows_block", (130, 4, 2, 64, 64, 64, 1, "float32", 2.0, "random", "left")),
    # the keys and keys_da kernels as one (the default since session 14): D = 128 in one program, mixed blocks;
    # the two kernels they replace, bf16 under strong decay
    ("defaults", (100, 8, 2, 128, 64, 40, 2, "float32", 2.0, "random", "left")),
    ("keys_separate", (90, 3, 1, 64, 32, 5, 1, "bfloat16", 8.0, "real_like", "right")),
    ("defaults", (150, 6, 2, 64, 64, 20, 2, "float32", 1.0, "random", "left")),
    ("defaults", (90, 3, 1, 64, 32, 5, 1, "bfloat16", 8.0, "real_like", "right")),
    ("defaults", (90, 4, 2, 64, 32, 5, 2, "bfloat16", 2.0, "real_like", "right")),
    ("defaults", (90, 8, 2, 64, 64, 70, 1, "bfloat16", 1.0, "real_like", "right")),
    # dq, dk, dv's own products in bf16x3 (CONFIG["slot_bwd_grad_precision"]; the default before session 31)
    ("bwd_grads_bf16x3", (130, 8, 2, 128, 64, 40, 1, "bfloat16", 2.0, "real_like", "none")),
    # the merged key kernel's block split from one carried cumsum row per block (the default since session 33):
    # fp32 bounds-checked over four 8-token blocks per chunk; the two sums per block it replaced, bf16 under decay 8
    ("slot_bwd_block8", (70, 8, 2, 64, 64, 5, 1, "float32", 2.0, "random", "left")),
    # and the rows kernel's split from two rows of the cumsum (the default since session 33): the two sums it replaced
    ("no_keys_carry_split+no_rows_cumsum_split", (130, 4, 2, 64, 64, 20, 1, "bfloat16", 8.0, "random", "left")),
    # the fused forward's block split from the cumsum's last row where its query block is the whole chunk (the
    # default since session 33), fp32 without a mask; the split it replaced, bf16 with right padding
    ("defaults", (100, 4, 1, 128, 128, 33, 1, "float32", 2.0, "random", "none")),
    ("no_fwd_whole_chunk_split", (90, 8, 2, 64, 64, 70, 1, "bfloat16", 1.0, "real_like", "right")),
    # the carried decay as exp(a_in) exp(a_ref) in the forward and the rows kernel (the default since session 34),
    # with 16-token forward blocks (a query block that is the whole chunk has a_ref = 0): fp32 bounds-checked, bf16
    # under decay 8 (factors far below 1); the single exponential it replaced, bf16 with right padding
    ("fwd_block16", (70, 8, 2, 64, 64, 5, 1, "float32", 2.0, "random", "left")),
    ("fwd_block16", (130, 4, 2, 64, 64, 20, 1, "bfloat16", 8.0, "random", "left")),
    ("no_factored_carry_decay", (90, 3, 1, 64, 32, 5, 2, "bfloat16", 2.0, "real_like", "right")),
    # the merged key kernel's value-side weights formed after its key side's products (the default since session 34;
    # the defaults' cases above check it): the two sides together, bf16 under decay 8
    ("keys_sides_together", (90, 4, 2, 64, 32, 5, 2, "bfloat16", 8.0, "real_like", "right")),
    # the fused forward's slot products before its rows' decays (the default since session 35; the fwd_block16 cases
    # above check it with a_ref not zero and direct blocks): the decays first, bf16 with right padding
    ("fwd_decays_early", (90, 3, 1, 64, 32, 5, 2, "bfloat16", 2.0, "real_like", "right")),
    # the state_grad kernel's row decays from the chunk's start (the default since session 35; the defaults' cases
    # check it at 64 and 128 slots, below 64 it keeps the block split): the block split, bf16 with right padding
    ("state_grad_block_decay", (90, 4, 2, 64, 64, 5, 1, "bfloat16", 2.0, "real_like", "right")),
    # the merged key kernel's gates after each chunk token as one product (the default since session 36; the
    # defaults' cases check it): the sum over the chunk's tokens, fp32 bounds-checked
    ("keys_rest_sum", (70, 8, 2, 64, 64, 5, 1, "float32", 2.0, "random", "left")),
    # the merged key kernel's row decays loaded from the rows kernel's (a variant since session 36): 3 query heads per
    # kv head (rows past the block's tokens), right padding and direct blocks (decay 8), fp32 bounds-checked
    ("shared_row_decays", (90, 6, 2, 64, 64, 5, 2, "float32", 8.0, "random", "right")),
    # ... from the state_grad kernel (a variant since session 37): the same case; below 64 slots (the block split's
    # decays), bf16 under decay 8
    ("grad_row_decays", (90, 6, 2, 64, 64, 5, 2, "float32", 8.0, "random", "right")),
    ("grad_row_decays+state_grad_block_decay", (90, 4, 2, 64, 32, 5, 2, "bfloat16", 8.0, "real_like", "right")),
    # the training states whole by two walks over segments (`walked_slot_states`, the default since session 40 where
    # the "auto" rule takes segments: from 8K tokens on, so 4-chunk ones here), their one-step-ahead loads on and
    # off: fp32 bounds-checked with left padding, bf16 real-like with right padding
    ("state_segment4", (170, 4, 2, 64, 64, 20, 2, "float32", 2.0, "random", "left")),
    ("state_segment4+no_segment_prefetch", (150, 8, 2, 128, 64, 5, 1, "bfloat16", 1.0, "real_like", "right")),
]


@pytest.mark.parametrize("variant,case", CASES,
                         ids=[f"{v}-T{c[0]}_g{c[1]}-{c[2]}_D{c[3]}_M{c[4]}_w{c[5]}_{c[7]}_decay{c[8]:g}_{c[9]}"
                              for v, c in CASES])
def test_variant_matches_float64_under_interpreter(variant, case):
    run_interp_script("interp_variant.py", variant, *case, expect="OK (in bounds)")

