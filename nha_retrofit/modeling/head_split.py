"""The head split of an NHA layer with full KV heads: its projections divided into the NHA heads' and the full
heads' (`split_heads`), and the two outputs put back in the layer's head order (`merge_heads`). Plain functions of
tensors, so that the fused decode step compiles each into one kernel (`fused_step.py`)."""

import torch


def split_heads(index, q, k, v, q_rope, k_rope, gate_logits, slot_bias):
    """((q, k, v, q_rope, k_rope, gate logits, slot bias) of the NHA heads, (q_rope, k_rope, v) of the full heads);
    `index` is the layer's (NHA KV heads, their query heads, full KV heads, their query heads, order) on the device.
    Heads are dimension 2 ([B, T, heads, D]); slot biases are per query head."""
    nha_heads, nha_query_heads, full_heads, full_query_heads, _ = index
    nha = (q.index_select(2, nha_query_heads), k.index_select(2, nha_heads), v.index_select(2, nha_heads),
           q_rope.index_select(2, nha_query_heads), k_rope.index_select(2, nha_heads),
           gate_logits.index_select(2, nha_heads), slot_bias.index_select(0, nha_query_heads))
    full = (q_rope.index_select(2, full_query_heads), k_rope.index_select(2, full_heads), v.index_select(2, full_heads))
    return nha, full


def merge_heads(order, nha_out, full_out):
    """[B, T, HQ, D]: the NHA heads' and the full heads' outputs in the layer's query-head order."""
    return torch.cat([nha_out, full_out.to(nha_out.dtype)], 2).index_select(2, order)
