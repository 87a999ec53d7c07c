"""The NHA operator written as directly as possible (docs/design.md section 2): the readable definition.

Dense in time: the slot state after every absorption step is built from all earlier tokens with explicit
[T, T, M] decay weights, and the window is a [T, T] band mask. Memory O(T^2 * M): for tests and for reading,
not for training (use `nha_chunked`) or decoding (`nha_recurrent_step`).
"""

import torch


def nha_reference(
    q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask=None, slot_bias=None
) -> torch.Tensor:
    """Native Hybrid Attention for whole sequences.

    q, q_rope: [B, T, HQ, D] (pre- and post-RoPE); k, k_rope: [B, T, H, D]; v: [B, T, H, Dv];
    log_alpha: [B, T, H, M], <= 0 (the gate of token j, used when token j is absorbed);
    window: int >= 0, or None for full causal attention; scale: logit scale;
    attention_mask: [B, T] of 0/1 (0 = padding: never written, never attended; its output is 0);
    slot_bias: [HQ] added to every slot logit of that query head.
    Returns o: [B, T, HQ, Dv] in q's dtype.
    """
    batch, length, q_heads, _ = q.shape
    kv_heads, slots = k.shape[2], log_alpha.shape[-1]
    groups = q_heads // kv_heads
    out_dtype, dtype = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v, q_rope, k_rope, log_alpha = (x.to(dtype) for x in (q, k, v, q_rope, k_rope, log_alpha))
    real = torch.ones(batch, length, dtype=torch.bool, device=q.device) if attention_mask is None else attention_mask.bool()
    window = length if window is None else window

    # Slot state after absorbing tokens 0..tau: Sk[tau, i] = sum_{j <= tau} exp(A_tau - A_j)[i] * s_j[i] * k_j.
    gate = log_alpha * real[:, :, None, None]
    write = (1 - gate.exp()) * real[:, :, None, None]
    cum = gate.cumsum(1)  # [B, T, H, M]
    t = torch.arange(length, device=q.device)
    upto = t[None, :] <= t[:, None]  # [tau, j]
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~upto[None, :, :, None, None], float("-inf")).exp()
    weights = decay * write[:, None]  # [B, tau, j, H, M]
    slot_keys = torch.einsum("bsjhm,bjhd->bshmd", weights, k)
    slot_values = torch.einsum("bsjhm,bjhd->bshmd", weights, v)
    slots_filled = real.cumsum(1) > 0  # [B, tau]: some real token absorbed by step tau

    # Query t reads the state after step t - window (none yet when t < window: slots empty, masked).
    read_step = (t - window).clamp(min=0)
    readable = (t >= window)[None, :] & slots_filled[:, read_step]  # [B, T]
    expand = lambda x: x.repeat_interleave(groups, dim=2)  # KV head h serves query heads h*G .. h*G+G-1
    slot_logits = scale * torch.einsum("bthd,bthmd->bthm", q, expand(slot_keys[:, read_step]))
    if slot_bias is not None:
        slot_logits = slot_logits + slot_bias.to(dtype)[:, None]
    slot_logits = slot_logits.masked_fill(~readable[:, :, None, None], float("-inf"))

    in_window = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)  # [t, j]
    visible = in_window[None] & real[:, None, :]  # [B, t, j]
    window_logits = scale * torch.einsum("bthd,bjhd->bthj", q_rope, expand(k_rope))
    window_logits = window_logits.masked_fill(~visible[:, :, None, :], float("-inf"))

    probs = torch.cat([slot_logits, window_logits], -1).softmax(-1).nan_to_num(0.0)
    out = torch.einsum("bthm,bthmd->bthd", probs[..., :slots], expand(slot_values[:, read_step]))
    out = out + torch.einsum("bthj,bjhd->bthd", probs[..., slots:], expand(v))
    return (out * real[:, :, None, None]).to(out_dtype)
