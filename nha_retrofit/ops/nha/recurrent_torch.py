"""NHA one token at a time: the decode step behind the NHA cache (plain PyTorch).

The new token joins the window; the token that falls out of the window is absorbed into the slots
(Sk = alpha * Sk + (1 - alpha) * k, likewise Sv) with the gate computed from that token; then the query reads
slots (pre-RoPE) and window (post-RoPE) under one softmax. Window 0: the token is absorbed at once.

With a finite window the state is updated in place: the new token overwrites the ring entry of the token
leaving (`NHAState`), after that token was absorbed. The window scores do not depend on the entries' order.
"""

import torch

from .gates import gate_log_alpha
from .state import WINDOW_FIELDS, NHAState


def nha_recurrent_step(
    q, k, v, q_rope, k_rope, log_alpha, window, scale, state=None, attention_mask=None, slot_bias=None,
    gate_normalizer=None,
):
    """One token per sequence. Shapes as `nha_reference` with T = 1; returns (o [B, 1, HQ, Dv], state).
    With `gate_normalizer` (tau), `log_alpha` holds the gate logits f instead: log(alpha) = logsigmoid(f) / tau.

    A finite window updates `state.for_decoding(window)` in place and returns it (the argument itself, unless
    its window first needed room). `window=None` never absorbs: the state grows by the token (ordinary causal
    attention).
    """
    batch, steps, q_heads, _ = q.shape
    if steps != 1:
        raise ValueError(f"nha_recurrent_step takes one token per sequence, got {steps}")
    kv_heads, slots = k.shape[2], log_alpha.shape[-1]
    if gate_normalizer is not None:
        log_alpha = gate_log_alpha(log_alpha, gate_normalizer)
    if state is None:
        state = NHAState.empty(batch, kv_heads, slots, k.shape[-1], v.shape[-1], k.dtype, k.device)
    token_mask = (
        torch.ones(batch, dtype=torch.bool, device=q.device)
        if attention_mask is None
        else attention_mask[:, -1].bool()
    )
    token = (k[:, 0], k_rope[:, 0], v[:, 0], log_alpha[:, 0], token_mask)  # in WINDOW_FIELDS order
    if window is None:
        ordered = state.chronological()
        state = NHAState(state.slot_keys, state.slot_values, state.slots_filled, **{
            name: torch.cat([getattr(ordered, name), new[:, None].to(getattr(ordered, name).dtype)], 1)
            for name, new in zip(WINDOW_FIELDS, token)
        })
    else:
        state = state.for_decoding(window)
        if window == 0:
            _absorb(state, k[:, 0], v[:, 0], log_alpha[:, 0], token_mask)
        else:
            rows, entry = torch.arange(batch, device=q.device), state.window_start
            _absorb(state, state.window_keys[rows, entry], state.window_values[rows, entry],
                    state.window_log_alpha[rows, entry], state.window_mask[rows, entry])
            for name, new in zip(WINDOW_FIELDS, token):
                getattr(state, name)[rows, entry] = new.to(getattr(state, name).dtype)
            state.window_start.copy_((entry + 1) % window)
    return _read(state, q, q_rope, scale, slot_bias, token_mask), state


def _absorb(state, keys, values, log_alpha, real):
    """Write one token per sequence (keys [B, H, D], values [B, H, Dv], log_alpha [B, H, M]) into the slots, in
    place; padding (`real` False) writes nothing and does not decay them."""
    alpha = (log_alpha.to(state.slot_keys.dtype) * real[:, None, None]).exp()[..., None]  # [B, H, M, 1]
    state.slot_keys.mul_(alpha).add_((1 - alpha) * keys[:, :, None, :].to(state.slot_keys.dtype))
    state.slot_values.mul_(alpha).add_((1 - alpha) * values[:, :, None, :].to(state.slot_values.dtype))
    state.slots_filled |= real


def _read(state, q, q_rope, scale, slot_bias, token_mask):
    """The token's query over slots and window entries under one softmax: o [B, 1, HQ, Dv]."""
    batch, _, q_heads, _ = q.shape
    kv_heads, slots = state.slot_keys.shape[1], state.slot_keys.shape[2]
    groups = q_heads // kv_heads
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    query = q[:, 0].to(compute_dtype).unflatten(1, (kv_heads, groups))  # [B, H, G, D]
    query_rope = q_rope[:, 0].to(compute_dtype).unflatten(1, (kv_heads, groups))
    slot_logits = scale * torch.einsum("bhgd,bhmd->bhgm", query, state.slot_keys.to(compute_dtype))
    if slot_bias is not None:
        slot_logits = slot_logits + slot_bias.to(compute_dtype).view(kv_heads, groups, 1)
    slot_logits = slot_logits.masked_fill(~state.slots_filled[:, None, None, None], float("-inf"))
    window_logits = scale * torch.einsum("bhgd,bjhd->bhgj", query_rope, state.window_keys_rope.to(compute_dtype))
    window_logits = window_logits.masked_fill(~state.window_mask[:, None, None, :], float("-inf"))

    probs = torch.cat([slot_logits, window_logits], -1).softmax(-1).nan_to_num(0.0)  # nothing visible -> 0
    out = torch.einsum("bhgm,bhmd->bhgd", probs[..., :slots], state.slot_values.to(compute_dtype))
    out = out + torch.einsum("bhgj,bjhd->bhgd", probs[..., slots:], state.window_values.to(compute_dtype))
    return (out.flatten(1, 2) * token_mask[:, None, None]).unsqueeze(1).to(q.dtype)
