"""NHA one token at a time: the decode step behind the NHA cache (plain PyTorch).

The new token joins the window; the token that falls out of the window is absorbed into the slots
(Sk = alpha * Sk + (1 - alpha) * k, likewise Sv) with the gate computed from that token; then the query reads
slots (pre-RoPE) and window (post-RoPE) under one softmax. Window 0: the token is absorbed at once.
"""

import torch

from .nha_state import NHAState


def nha_recurrent_step(
    q, k, v, q_rope, k_rope, log_alpha, window, scale, state=None, attention_mask=None, slot_bias=None
):
    """One token per sequence. Shapes as `nha_reference` with T = 1; returns (o [B, 1, HQ, Dv], new state).

    `window=None` never absorbs (the state then holds every token: ordinary causal attention).
    """
    batch, steps, q_heads, _ = q.shape
    if steps != 1:
        raise ValueError(f"nha_recurrent_step takes one token per sequence, got {steps}")
    kv_heads, slots = k.shape[2], log_alpha.shape[-1]
    groups = q_heads // kv_heads
    if state is None:
        state = NHAState.empty(batch, kv_heads, slots, k.shape[-1], v.shape[-1], k.dtype, k.device)
    token_mask = (
        torch.ones(batch, 1, dtype=torch.bool, device=q.device)
        if attention_mask is None
        else attention_mask[:, -1:].bool()
    )
    window_keys = torch.cat([state.window_keys, k.to(state.window_keys.dtype)], 1)
    window_keys_rope = torch.cat([state.window_keys_rope, k_rope.to(state.window_keys.dtype)], 1)
    window_values = torch.cat([state.window_values, v.to(state.window_values.dtype)], 1)
    window_log_alpha = torch.cat([state.window_log_alpha, log_alpha.to(state.window_log_alpha.dtype)], 1)
    window_mask = torch.cat([state.window_mask, token_mask], 1)

    slot_keys, slot_values, filled = state.slot_keys, state.slot_values, state.slots_filled
    leaving = 0 if window is None else max(window_mask.shape[1] - window, 0)
    for j in range(leaving):
        real = window_mask[:, j, None, None, None]  # padding writes nothing and does not decay the slots
        alpha = (window_log_alpha[:, j, :, :, None] * real).exp()  # [B, H, M, 1]
        slot_keys = alpha * slot_keys + (1 - alpha) * window_keys[:, j, :, None, :].to(slot_keys.dtype)
        slot_values = alpha * slot_values + (1 - alpha) * window_values[:, j, :, None, :].to(slot_values.dtype)
        filled = filled | window_mask[:, j]
    window_keys, window_keys_rope, window_values, window_log_alpha, window_mask = (
        x[:, leaving:] for x in (window_keys, window_keys_rope, window_values, window_log_alpha, window_mask)
    )

    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    query = q[:, 0].to(compute_dtype).unflatten(1, (kv_heads, groups))  # [B, H, G, D]
    query_rope = q_rope[:, 0].to(compute_dtype).unflatten(1, (kv_heads, groups))
    slot_logits = scale * torch.einsum("bhgd,bhmd->bhgm", query, slot_keys.to(compute_dtype))
    if slot_bias is not None:
        slot_logits = slot_logits + slot_bias.to(compute_dtype).view(kv_heads, groups, 1)
    slot_logits = slot_logits.masked_fill(~filled[:, None, None, None], float("-inf"))
    window_logits = scale * torch.einsum("bhgd,bjhd->bhgj", query_rope, window_keys_rope.to(compute_dtype))
    window_logits = window_logits.masked_fill(~window_mask[:, None, None, :], float("-inf"))

    probs = torch.cat([slot_logits, window_logits], -1).softmax(-1).nan_to_num(0.0)  # nothing visible -> 0
    out = torch.einsum("bhgm,bhmd->bhgd", probs[..., :slots], slot_values.to(compute_dtype))
    out = out + torch.einsum("bhgj,bjhd->bhgd", probs[..., slots:], window_values.to(compute_dtype))
    out = (out.flatten(1, 2) * token_mask[:, :, None]).unsqueeze(1).to(q.dtype)
    new_state = NHAState(
        slot_keys, slot_values, filled, window_keys, window_keys_rope, window_values, window_log_alpha, window_mask
    )
    return out, new_state
