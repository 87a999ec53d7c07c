"""A float64 brute-force oracle of the NHA contract (docs/design.md section 2), one position at a time.

It keeps the slot state after every token explicitly and builds each query's softmax entry by entry, so it
shares no code and no algebra with the package's implementations.
"""

import torch


def make_inputs(batch, length, q_heads, kv_heads, head_dim, slots, *, dtype=torch.float64, value_dim=None, seed=None,
                decay=1.0):
    """Fresh random NHA inputs (never zeros); gates spread over strong and weak decay. `decay` scales log(alpha):
    8 gives a mean of about -6 per token (hundreds over a 64-token chunk), as gates trained to reset slots do."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(2**31, ())))
    value_dim = value_dim or head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    gate_logits = rand(batch, length, kv_heads, slots) * 3
    return dict(
        q=rand(batch, length, q_heads, head_dim),
        k=rand(batch, length, kv_heads, head_dim),
        v=rand(batch, length, kv_heads, value_dim),
        q_rope=rand(batch, length, q_heads, head_dim),
        k_rope=rand(batch, length, kv_heads, head_dim),
        log_alpha=(torch.nn.functional.logsigmoid(gate_logits.double()) / 2 * decay).to(dtype),
        slot_bias=rand(q_heads),
        scale=head_dim**-0.5,
    )


def padding_mask(batch, length, side, seed=0):
    """Each sequence gets a different number of padding tokens (0 for the first) on `side`."""
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(1, batch):
        pad = min(length - 1, (b * 7 + seed) % max(length, 1))
        if pad:
            if side == "left":
                mask[b, :pad] = 0
            else:
                mask[b, length - pad :] = 0
    return mask


def nha_oracle(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask=None, slot_bias=None):
    q, k, v, q_rope, k_rope, log_alpha = (x.double() for x in (q, k, v, q_rope, k_rope, log_alpha))
    batch, length, q_heads, _ = q.shape
    kv_heads, slots = k.shape[2], log_alpha.shape[-1]
    groups = q_heads // kv_heads
    mask = torch.ones(batch, length, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    bias = torch.zeros(q_heads, dtype=torch.float64) if slot_bias is None else slot_bias.double()
    width = length if window is None else window
    out = torch.zeros(batch, length, q_heads, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(kv_heads):
            slot_k = torch.zeros(slots, k.shape[-1], dtype=torch.float64)
            slot_v = torch.zeros(slots, v.shape[-1], dtype=torch.float64)
            absorbed, after = 0, []  # after[j] = (Sk, Sv, real tokens absorbed) once tokens 0..j are in
            for j in range(length):
                if mask[b, j]:
                    alpha = log_alpha[b, j, h].exp()[:, None]
                    slot_k = alpha * slot_k + (1 - alpha) * k[b, j, h]
                    slot_v = alpha * slot_v + (1 - alpha) * v[b, j, h]
                    absorbed += 1
                after.append((slot_k, slot_v, absorbed))
            for hq in range(h * groups, (h + 1) * groups):
                for t in range(length):
                    if not mask[b, t]:
                        continue
                    logits, values = [], []
                    if t - width >= 0 and after[t - width][2] > 0:
                        read_k, read_v, _ = after[t - width]
                        for i in range(slots):
                            logits.append(scale * q[b, t, hq] @ read_k[i] + bias[hq])
                            values.append(read_v[i])
                    for j in range(max(0, t - width + 1), t + 1):
                        if mask[b, j]:
                            logits.append(scale * q_rope[b, t, hq] @ k_rope[b, j, h])
                            values.append(v[b, j, h])
                    probs = torch.stack(logits).softmax(0)
                    out[b, t, hq] = (probs[:, None] * torch.stack(values)).sum(0)
    return out
