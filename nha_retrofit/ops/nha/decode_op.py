"""The Triton decode step as a torch.library custom op, `torch.ops.nha_retrofit.decode_step`, so that torch.compile
traces a decode step through it (rather than breaking its graph at a Triton launch) and can fuse the work around it.

The op updates the state tensors it is given in place (declared as mutated) and returns the output; its fake
implementation gives the output's shape and dtype without running anything, which is all tracing needs.
`nha_decode_step` keeps `nha_recurrent_step_triton`'s contract for the dispatcher.
"""

import torch

from .state import NHAState

STATE_ARGUMENTS = ("slot_keys", "slot_values", "slots_filled", "window_keys", "window_keys_rope", "window_values",
                   "window_log_alpha", "window_mask", "window_start")


@torch.library.custom_op("nha_retrofit::decode_step", mutates_args=STATE_ARGUMENTS)
def decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rope: torch.Tensor, k_rope: torch.Tensor,
    log_alpha: torch.Tensor, slot_keys: torch.Tensor, slot_values: torch.Tensor, slots_filled: torch.Tensor,
    window_keys: torch.Tensor, window_keys_rope: torch.Tensor, window_values: torch.Tensor,
    window_log_alpha: torch.Tensor, window_mask: torch.Tensor, window_start: torch.Tensor | None,
    attention_mask: torch.Tensor | None, slot_bias: torch.Tensor | None, window: int, scale: float,
    gate_normalizer: float | None,
) -> torch.Tensor:
    """`nha_recurrent_step_triton` on a state already in its decoding form (`NHAState.for_decoding(window)`)."""
    from .fused_recurrent import nha_recurrent_step_triton

    state = NHAState(slot_keys, slot_values, slots_filled, window_keys, window_keys_rope, window_values,
                     window_log_alpha, window_mask, window_start)
    out, _ = nha_recurrent_step_triton(q, k, v, q_rope, k_rope, log_alpha, window, scale, state=state,
                                       attention_mask=attention_mask, slot_bias=slot_bias,
                                       gate_normalizer=gate_normalizer)
    return out


@decode_step.register_fake
def _decode_step_shape(q, k, v, q_rope, k_rope, log_alpha, slot_keys, slot_values, slots_filled, window_keys,
                       window_keys_rope, window_values, window_log_alpha, window_mask, window_start, attention_mask,
                       slot_bias, window, scale, gate_normalizer):
    return q.new_empty(q.shape[0], 1, q.shape[2], v.shape[-1])


def nha_decode_step(q, k, v, q_rope, k_rope, log_alpha, window, scale, state=None, attention_mask=None,
                    slot_bias=None, gate_normalizer=None):
    """`nha_recurrent_step_triton`'s contract through the custom op: (o [B, 1, HQ, Dv], the state, updated in
    place in its decoding form)."""
    if window is None:
        raise ValueError("the Triton decode step needs a finite window (window None grows the state)")
    batch, _, _, head_dim = q.shape
    if state is None:
        state = NHAState.empty(batch, k.shape[2], log_alpha.shape[-1], head_dim, v.shape[-1], k.dtype, k.device)
    state = state.for_decoding(window)
    out = decode_step(q, k, v, q_rope, k_rope, log_alpha, *state.tensors(), attention_mask, slot_bias, window,
                      float(scale), gate_normalizer)
    return out, state
