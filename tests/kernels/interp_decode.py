"""The in-place decode step (`decode.nha_recurrent_step_triton`) under the Triton CPU interpreter and its
out-of-bounds checker, against the PyTorch step (`nha_recurrent_step`) on the same prefilled state, token by
token until the window ring has wrapped: every output, the slots, the window entries (oldest first), the ring
start and the filled flags; the state tensors stay the same ones from the first step on.

Fresh random fp32 inputs; windows 0 (absorbed at once), 1, 5, 64 (one 64-entry block), 70 (two) and 150 (three,
the last partial); GQA 9/3, 4/4 and 16/2; left padding and no mask; outputs NaN-poisoned. Half the cases give the
step the gate logits f (wide: |f| up to ~15) and tau instead of log(alpha), and a bfloat16 slot bias, as the model
does: the kernel's logsigmoid must match PyTorch's.

Usage: TRITON_INTERPRET=1 PYTHONPATH=. python tests/kernels/interp_decode.py   (prints OK and exits 0)
"""

import copy
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from interp_bounds import bounds_checked  # noqa: E402
from interp_support import rel  # noqa: E402
from nha_oracle import make_inputs, padding_mask  # noqa: E402

NAMES = ("q", "k", "v", "q_rope", "k_rope", "log_alpha")
# (window, query heads, kv heads, slots, prompt, masked, gate logits)
CASES = [(0, 9, 3, 16, 7, True, True), (1, 4, 4, 32, 3, True, False), (5, 16, 2, 16, 9, False, True),
         (64, 9, 3, 32, 20, True, False), (70, 4, 4, 16, 2, True, True), (150, 16, 2, 16, 40, True, False)]
TAU = 8.0


def main():
    from nha_retrofit.kernels import chunk_fwd
    from nha_retrofit.kernels.decode import nha_recurrent_step_triton
    from nha_retrofit.ops.nha.chunk_torch import nha_chunked
    from nha_retrofit.ops.nha.gates import gate_log_alpha
    from nha_retrofit.ops.nha.recurrent_torch import nha_recurrent_step

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    chunk_fwd.POISON = True
    for window, q_heads, kv_heads, slots, prompt, masked, gate in CASES:
        steps = max(window, 1) + 23  # past a full turn of the ring (many for the short windows)
        x = make_inputs(3, prompt + steps, q_heads, kv_heads, 64, slots, dtype=torch.float32, seed=seed)
        mask = padding_mask(3, prompt + steps, "left", seed=window) if masked else None
        common = dict(window=window, scale=x["scale"], slot_bias=x["slot_bias"])
        gate_logits = 5 * torch.randn(x["log_alpha"].shape, generator=torch.Generator().manual_seed(seed))
        if gate:  # the decode steps take the logits and tau; the prefill the gate's log(alpha) of the same logits
            x["log_alpha"] = gate_log_alpha(gate_logits, TAU)
            common["slot_bias"] = common["slot_bias"].bfloat16()
        _, state = nha_chunked(*[x[n][:, :prompt] for n in NAMES], attention_mask=None if mask is None
                               else mask[:, :prompt], output_final_state=True, **common)
        mine, ref = copy.deepcopy(state), copy.deepcopy(state)
        worst, pointers = 0.0, None
        for t in range(prompt, prompt + steps):
            token = [x[n][:, t : t + 1] for n in NAMES]
            step_mask = None if mask is None else mask[:, : t + 1]
            if gate:
                token[-1] = gate_logits[:, t : t + 1]
            step = dict(common, attention_mask=step_mask, gate_normalizer=TAU if gate else None)
            with bounds_checked():
                got, mine = nha_recurrent_step_triton(*token, state=mine, **step)
            want, ref = nha_recurrent_step(*[x[n][:, t : t + 1] for n in NAMES], state=ref,
                                           **dict(step, gate_normalizer=None))
            ordered, ref_ordered = mine.chronological(), ref.chronological()
            errors = [rel(got, want), rel(mine.slot_keys, ref.slot_keys), rel(mine.slot_values, ref.slot_values)]
            errors += [rel(getattr(ordered, n), getattr(ref_ordered, n))
                       for n in ("window_keys", "window_keys_rope", "window_values", "window_log_alpha")
                       if getattr(ref, n).numel()]
            assert torch.equal(ordered.window_mask, ref_ordered.window_mask), t
            assert torch.equal(mine.window_start, ref.window_start), t
            assert torch.equal(mine.slots_filled, ref.slots_filled), t
            worst = max(worst, *errors)
            pointers = pointers or [p.data_ptr() for p in mine.tensors()]
            assert pointers == [p.data_ptr() for p in mine.tensors()], "the state was reallocated"
        print(f"w={window} heads {q_heads}/{kv_heads} M={slots} prompt {prompt} + {steps} steps "
              f"{'left-padded' if masked else 'no mask'}{', gate logits' if gate else ''}: worst rel error {worst:.1e}")
        assert worst <= 1e-5, worst
    print("OK")


if __name__ == "__main__":
    main()
