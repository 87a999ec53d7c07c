"""The stored read, dense: every stored key and value dequantized, one softmax over the real positions."""

import torch


def naive_stored_attention(query, keys, values, real, scale, key_scales=None, value_scales=None):
    """query [B, 1, HQ, D] against keys [B, H, L, D] and values [B, H, L, Dv] (HQ a multiple of H; query head i reads
    kv head i // (HQ / H)) at the positions whose `real` [B, L] flag is set: [B, 1, HQ, Dv], in the query's dtype.
    Float8 keys and values come with their float32 scales [B, H, L] (stored = value / scale)."""
    dtype = query.dtype
    keys = keys.to(dtype) if key_scales is None else keys.to(dtype) * key_scales.to(dtype).unsqueeze(-1)
    values = values.to(dtype) if value_scales is None else values.to(dtype) * value_scales.to(dtype).unsqueeze(-1)
    groups = query.shape[2] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = torch.einsum("bhd,bhld->bhl", query[:, 0], keys) * scale
    probs = scores.masked_fill(~real[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bhl,bhld->bhd", probs, values).unsqueeze(1)
