"""NHA in chunked form: plain PyTorch, differentiable, memory O(T * (window + chunk)) instead of O(T^2).

Notation (docs/design.md section 2). Token j is *absorbed* into the slots when it leaves the window: query t reads
the slots after tokens 0..t-w were absorbed, plus the window t-w+1..t, under one softmax. So the slot part is
an inclusive gated-slot read over an "absorption stream" of the first L-w tokens, queried by q shifted by w:
query t reads the state after absorption step tau = t - w.

The slot read is computed chunk by chunk: inside a chunk, the contribution of each absorbed token j to the
state at tau is exp(a_tau - a_j) * s_j (a = chunk-local cumulative log gate), materialised as a
[chunk, chunk, M] tensor so that every exponent is <= 0 (stable); between chunks, one small state
recurrence. The window part is banded: each query chunk sees C + w - 1 keys.

A cached prefix (the state's window tokens) is prepended to the new tokens as keys without queries, so the
same code serves training, prefill and prefill-after-prefix.
"""

import torch
import torch.nn.functional as F

from .state import NHAState


def nha_chunked(
    q,
    k,
    v,
    q_rope,
    k_rope,
    log_alpha,
    window,
    scale,
    attention_mask=None,
    slot_bias=None,
    initial_state: NHAState | None = None,
    output_final_state: bool = False,
    chunk_size: int = 16,
):
    """Same contract as `nha_reference`, plus an optional carried state.

    Shapes: q, q_rope [B, T, HQ, D]; k, k_rope [B, T, H, D]; v [B, T, H, Dv]; log_alpha [B, T, H, M] (<= 0);
    attention_mask [B, T] (1 = token, 0 = padding); slot_bias [HQ]. Returns o [B, T, HQ, Dv] in q's dtype,
    and the final NHAState when `output_final_state`.
    """
    batch, new_len, q_heads, _ = q.shape
    kv_heads, slots = k.shape[2], log_alpha.shape[-1]
    groups = q_heads // kv_heads
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    mask = (
        torch.ones(batch, new_len, dtype=torch.bool, device=q.device)
        if attention_mask is None
        else attention_mask[:, -new_len:].bool()
    )
    if initial_state is None:
        initial_state = NHAState.empty(batch, kv_heads, slots, k.shape[-1], v.shape[-1], k.dtype, k.device)
    else:  # a decoded state keeps its window as a ring; prefill reads it oldest first
        initial_state = initial_state.chronological()

    # The whole stream: carried window tokens first, then the new ones (token-major, as given).
    prefix = initial_state.window_length
    stream_k = torch.cat([initial_state.window_keys.to(k.dtype), k], 1)
    stream_k_rope = torch.cat([initial_state.window_keys_rope.to(k.dtype), k_rope], 1)
    stream_v = torch.cat([initial_state.window_values.to(v.dtype), v], 1)
    stream_gates = torch.cat([initial_state.window_log_alpha, log_alpha.to(initial_state.window_log_alpha.dtype)], 1)
    mask = torch.cat([initial_state.window_mask, mask], 1)
    total = prefix + new_len
    window = total if window is None else window

    def kv_heads_first(x):  # [B, L, H, X] -> [B, H, L, X]
        return x.to(compute_dtype).transpose(1, 2)

    def query_heads_first(x):  # [B, T, HQ, D] -> [B, H, L, G, D]; the prefix positions ask nothing
        x = x.to(compute_dtype).unflatten(2, (kv_heads, groups)).permute(0, 2, 1, 3, 4)
        return F.pad(x, (0, 0, 0, 0, prefix, 0))

    queries, queries_rope = query_heads_first(q), query_heads_first(q_rope)
    keys, keys_rope, values, gates = map(kv_heads_first, (stream_k, stream_k_rope, stream_v, stream_gates))
    bias = (
        torch.zeros(kv_heads, 1, groups, 1, dtype=compute_dtype, device=q.device)
        if slot_bias is None
        else slot_bias.to(compute_dtype).view(kv_heads, 1, groups, 1)
    )

    # Slot part. Queries t < window read the carried slots; t >= window read after absorption step t - window.
    absorbed = max(total - window, 0)
    early = total - absorbed
    abs_mask = mask[:, None, :absorbed]  # [B, 1, N]
    abs_gates = gates[:, :, :absorbed] * abs_mask[..., None]
    write = (1 - abs_gates.exp()) * abs_mask[..., None]
    chunks = _SlotChunks(keys[:, :, :absorbed], values[:, :, :absorbed], abs_gates, write, chunk_size)
    slot_keys0 = initial_state.slot_keys.to(compute_dtype)
    slot_values0 = initial_state.slot_values.to(compute_dtype)
    late_logits, final_keys = chunks.read_logits(queries[:, :, early:], slot_keys0)
    early_logits = torch.einsum("bhtgd,bhmd->bhtgm", queries[:, :, :early], slot_keys0)
    slot_logits = scale * torch.cat([early_logits, late_logits], 2) + bias
    filled = initial_state.slots_filled[:, None] | (abs_mask[:, 0].cumsum(-1) > 0)  # [B, N]
    filled = torch.cat([initial_state.slots_filled[:, None].expand(-1, early), filled], 1)
    slot_logits = slot_logits.masked_fill(~filled[:, None, :, None, None], float("-inf"))

    # Window part, banded: query t sees keys t-w+1..t (w clipped to the stream length).
    band = min(window, total)
    window_logits, band_values = _band_logits(queries_rope, keys_rope, values, mask, band, chunk_size, scale)

    probs_slots, probs_window = _joint_softmax(slot_logits, window_logits, total, chunk_size)
    late_out, final_values = chunks.read_values(probs_slots[:, :, early:], slot_values0)
    early_out = torch.einsum("bhtgm,bhmd->bhtgd", probs_slots[:, :, :early], slot_values0)
    out = torch.cat([early_out, late_out], 2)
    if band > 0:
        window_out = torch.einsum("bhntgj,bhnjd->bhntgd", probs_window, band_values)
        out = out + window_out.flatten(2, 3)[:, :, :total]
    out = out * mask[:, None, :, None, None]  # padding queries get exactly zero
    out = out[:, :, prefix:].permute(0, 2, 1, 3, 4).flatten(2, 3).to(q.dtype)  # [B, T, HQ, Dv]
    if not output_final_state:
        return out, None

    keep = total - min(window, total)
    final_state = NHAState(
        slot_keys=final_keys.to(initial_state.slot_keys.dtype),
        slot_values=final_values.to(initial_state.slot_values.dtype),
        slots_filled=filled[:, -1],
        window_keys=stream_k[:, keep:],
        window_keys_rope=stream_k_rope[:, keep:],
        window_values=stream_v[:, keep:],
        window_log_alpha=stream_gates[:, keep:],
        window_mask=mask[:, keep:],
    ).compact()
    return out, final_state


def _to_chunks(x, dim, chunk_size):
    """Pad `dim` to a multiple of chunk_size and split it into [n_chunks, chunk_size]."""
    length = x.shape[dim]
    n_chunks = -(-length // chunk_size)
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, n_chunks * chunk_size - length]
    return F.pad(x, pad).unflatten(dim, (n_chunks, chunk_size))


class _SlotChunks:
    """The absorption stream cut into chunks: decays inside each chunk and the slot state before each chunk."""

    def __init__(self, keys, values, gates, write, chunk_size):
        # keys [B, H, N, D], values [B, H, N, Dv], gates/write [B, H, N, M]
        self.length = keys.shape[2]
        self.chunk_size = chunk_size
        self.keys = _to_chunks(keys, 2, chunk_size)  # [B, H, n, C, D]
        self.values = _to_chunks(values, 2, chunk_size)
        write = _to_chunks(write, 2, chunk_size)
        cum = _to_chunks(gates, 2, chunk_size).cumsum(3)  # chunk-local cumulative log gate a
        self.decay_in = cum.exp()  # exp(a_tau): decay of the state carried into the chunk
        causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=keys.device).tril()
        diff = cum[:, :, :, :, None, :] - cum[:, :, :, None, :, :]  # [B, H, n, C(tau), C(j), M]
        self.weights = diff.masked_fill(~causal[:, :, None], float("-inf")).exp() * write[:, :, :, None]
        self.chunk_log_decay = cum[:, :, :, -1]  # [B, H, n, M]
        self.to_end = (cum[:, :, :, -1:] - cum).exp() * write  # weight of token j in the chunk's end state

    def _states_before_chunks(self, tokens, initial, group=16):
        """Slot state before each chunk ([B, H, n, M, X]) and after the last one.

        The recurrence state <- decay * state + update runs over groups of `group` chunks: inside a group every state
        is a weighted sum of the group's updates (weights exp(sum of the decays in between) <= 1, one einsum), and
        only the state entering each group is carried sequentially (n / group steps instead of n)."""
        updates = torch.einsum("bhncm,bhncx->bhnmx", self.to_end, tokens)
        n = updates.shape[2]
        if n == 0:
            return initial.new_zeros(*initial.shape[:2], 0, *initial.shape[2:]), initial
        pad = -(-n // group) * group - n  # padded chunks: decay 1, no update (the final state is unchanged)
        log_decay = F.pad(self.chunk_log_decay, (0, 0, 0, pad)).unflatten(2, (-1, group))  # [B, H, g, G, M]
        updates = F.pad(updates, (0, 0, 0, 0, 0, pad)).unflatten(2, (-1, group))  # [B, H, g, G, M, X]
        after = log_decay.cumsum(3)  # log decay from the group start to the end of chunk c
        before = after - log_decay  # ... to the start of chunk c
        earlier = torch.ones(group, group, dtype=torch.bool, device=updates.device).tril(-1)  # [c, p]: p < c
        gaps = (before[:, :, :, :, None] - after[:, :, :, None, :]).masked_fill(~earlier[:, :, None], float("-inf"))
        inside = torch.einsum("bhgcpm,bhgpmx->bhgcmx", gaps.exp(), updates)
        group_update = torch.einsum("bhgpm,bhgpmx->bhgmx", (after[:, :, :, -1:] - after).exp(), updates)
        group_decay = after[:, :, :, -1].exp()  # [B, H, g, M]
        state, entering = initial, []
        for g in range(updates.shape[2]):
            entering.append(state)
            state = group_decay[:, :, g, :, None] * state + group_update[:, :, g]
        states = inside + before.exp()[..., None] * torch.stack(entering, 2)[:, :, :, None]
        return states.flatten(2, 3)[:, :, :n], state

    def read_logits(self, queries, initial_keys):
        """q_tau . Sk_tau[i] for every absorption step tau; queries [B, H, N, G, D] -> [B, H, N, G, M]."""
        queries = _to_chunks(queries, 2, self.chunk_size)
        before, final = self._states_before_chunks(self.keys, initial_keys)
        scores = torch.einsum("bhntgd,bhnjd->bhntgj", queries, self.keys)
        inside = torch.einsum("bhntjm,bhntgj->bhntgm", self.weights, scores)
        carried = torch.einsum("bhntgd,bhnmd->bhntgm", queries, before) * self.decay_in[:, :, :, :, None]
        return (inside + carried).flatten(2, 3)[:, :, : self.length], final

    def read_values(self, probs, initial_values):
        """sum_i p_tau[i] Sv_tau[i]; probs [B, H, N, G, M] -> [B, H, N, G, Dv]."""
        probs = _to_chunks(probs, 2, self.chunk_size)
        before, final = self._states_before_chunks(self.values, initial_values)
        token_weights = torch.einsum("bhntgm,bhntjm->bhntgj", probs, self.weights)
        inside = torch.einsum("bhntgj,bhnjd->bhntgd", token_weights, self.values)
        carried = torch.einsum("bhntgm,bhnmd->bhntgd", probs * self.decay_in[:, :, :, :, None], before)
        return (inside + carried).flatten(2, 3)[:, :, : self.length], final


def _band_logits(queries, keys, values, mask, band, chunk_size, scale):
    """Sliding-window logits [B, H, n, C, G, C + band - 1] (invalid entries -inf) and the banded values."""
    if band == 0:
        return None, None
    queries = _to_chunks(queries, 2, chunk_size)  # [B, H, n, C, G, D]
    n_chunks = queries.shape[2]
    span = chunk_size + band - 1
    padded_len = (band - 1) + n_chunks * chunk_size

    def banded(x):  # [B, H, L, X] -> [B, H, n, span, X]: keys from chunk_start - band + 1 on
        x = F.pad(x, (0, 0, band - 1, padded_len - (band - 1) - x.shape[2]))
        return x.unfold(2, span, chunk_size).transpose(-1, -2)

    band_keys, band_values = banded(keys), banded(values)
    key_ok = banded(mask[:, None, :, None].to(keys.dtype))[..., 0] > 0  # [B, 1, n, span]
    offset = torch.arange(span, device=keys.device)[None, :] - torch.arange(chunk_size, device=keys.device)[:, None]
    in_window = (offset >= 0) & (offset < band)  # key r of query i: position i - band + 1 + ... (r - i in [0, band))
    valid = in_window[None, None, None] & key_ok[:, :, :, None, :]  # [B, H, n, C, span]
    logits = scale * torch.einsum("bhntgd,bhnjd->bhntgj", queries, band_keys)
    return logits.masked_fill(~valid[:, :, :, :, None, :], float("-inf")), band_values


def _joint_softmax(slot_logits, window_logits, total, chunk_size):
    """One softmax over slots and window; rows with nothing visible (padding queries) give all zeros."""
    parts = [slot_logits] if window_logits is None else [_to_chunks(slot_logits, 2, chunk_size), window_logits]
    rowmax = torch.stack([p.amax(-1, keepdim=True) for p in parts]).amax(0).detach()
    rowmax = rowmax.masked_fill(~torch.isfinite(rowmax), 0)
    exps = [(p - rowmax).exp() for p in parts]
    norm = sum(e.sum(-1, keepdim=True) for e in exps)
    probs = [e / torch.where(norm > 0, norm, torch.ones_like(norm)) for e in exps]
    if window_logits is None:
        return probs[0], None
    return probs[0].flatten(2, 3)[:, :, :total], probs[1]
