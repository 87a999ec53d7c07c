"""Prefill that returns its state under the Triton CPU interpreter and its out-of-bounds checker, against the PyTorch
`nha_chunked`: a first prefill (no state carried; without a mask, the kernels' maskless form, and with left padding)
compared on its output and every field of its final state; then a prefill with a carried state
(`nha_chunked_triton(..., initial_state=...)`) on its output and final slot states; with the key and the value
states in one set of launches and in separate ones (`CONFIG["merge_kv_states"]`), in the segment-local form of 2-chunk
segments (the fused kernel adds each segment's carry) and scanned whole (`CONFIG["state_segment"]`).

Fresh random fp32 inputs; the carried state comes from a PyTorch prefill of the first part; first parts longer and
shorter than the window; windows shorter than and as long as the chunk; outputs NaN-poisoned.

Usage: TRITON_INTERPRET=1 PYTHONPATH=. python tests/kernels/interp_carried_state.py   (prints OK and exits 0)
"""

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


def state_errors(got, want):
    """Relative error of every tensor of the NHAState `got` against `want` (masks and ring starts: 0 or inf)."""
    from dataclasses import fields

    errors = {}
    for field in fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        assert a.shape == b.shape and a.dtype == b.dtype, (field.name, a.shape, b.shape, a.dtype, b.dtype)
        exact = not a.is_floating_point()
        errors[field.name] = (0.0 if torch.equal(a, b) else float("inf")) if exact else rel(a, b)
    return errors


def main():
    from nha_retrofit.kernels import chunk_fwd, config
    from nha_retrofit.ops.nha.chunk import nha_chunked_triton
    from nha_retrofit.ops.nha.chunk_torch import nha_chunked

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    chunk_fwd.POISON = True
    for merge, segment in ((True, 2), (False, 2), (True, None)):
        config.CONFIG.update(merge_kv_states=merge, state_segment=segment)
        for first, second, window in ((77, 90, 20), (130, 41, 64), (12, 70, 20)):  # (12: nothing absorbed yet)
            x = make_inputs(2, first + second, 4, 2, 64, 32, dtype=torch.float32, seed=seed)
            head = [x[n][:, :first] for n in NAMES]
            tail = [x[n][:, first:] for n in NAMES]
            for mask in (None, padding_mask(2, first, "left", seed=seed % 16)):
                want, state = nha_chunked(*head, window, x["scale"], mask, x["slot_bias"], output_final_state=True)
                with bounds_checked():
                    got, got_state = nha_chunked_triton(*head, window, x["scale"], mask, x["slot_bias"],
                                                        output_final_state=True)
                errors = {"o": rel(got, want), **state_errors(got_state, state)}
                print(f"merge_kv_states={merge}, state_segment={segment} (first prefill of {first}, w={window}, "
                      f"{'no mask' if mask is None else 'left padding'}):",
                      " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
                assert max(errors.values()) <= 1e-5, errors
            want, want_state = nha_chunked(*tail, window, x["scale"], None, x["slot_bias"], initial_state=state,
                                           output_final_state=True)
            with bounds_checked():
                got, got_state = nha_chunked_triton(*tail, window, x["scale"], None, x["slot_bias"],
                                                    initial_state=state, output_final_state=True)
            errors = {"o": rel(got, want), "slot_keys": rel(got_state.slot_keys, want_state.slot_keys),
                      "slot_values": rel(got_state.slot_values, want_state.slot_values)}
            print(f"merge_kv_states={merge}, state_segment={segment} ({first} + {second}, w={window}):",
                  " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
            assert max(errors.values()) <= 1e-5, errors
    print("OK")


if __name__ == "__main__":
    main()
