"""Random NHA inputs with the statistics of a real converted model (SmolLM2-135M on English text), for the kernel
tests. `nha_oracle.make_inputs` draws isotropic unit-variance q/k and strong decays (gate logits N(0, 9),
log alpha = logsigmoid / 2: about -22 nats per 64-token chunk); the converted model's operator inputs (captured
on Hamlet and on random token ids, layers 1, 11 and 21) look different:

- q and k are dominated by one direction per head: |mean over tokens| / rms norm ~ 0.9, per-element rms ~ 2,
  a few channels up to ~ 18; window logits spread ~ 8-10 per row, slot logits (q . mean k) large too;
- gate logits f ~ N(0.15, 2.3) with tails to -18 / +17 and tau = 8 (log alpha = logsigmoid(f) / 8): median
  -0.08 per token, minimum ~ -2.5, ~ -6 nats per 64-token chunk typically and down to ~ -120 (long memory in
  most slots, resets in a few);
- v rms ~ 0.6 with outliers to ~ 4-17; slot_bias = -4 for every head (the converter's initialisation);
- q_rope / k_rope are q / k under a real rotary embedding (theta 1e5), not independent draws.
"""

import math

import torch


def _rope(x, theta=1e5):
    """Rotate-half rotary embedding over positions 0..T-1 of x [B, T, heads, D]."""
    T, D = x.shape[1], x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :]
    half = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * cos + half * sin


def real_like_inputs(batch, length, q_heads, kv_heads, head_dim, slots, *, seed=0, dtype=torch.float32,
                     mean_ratio=0.9, rms=2.0):
    """Same keys as `nha_oracle.make_inputs` (q, k, v, q_rope, k_rope, log_alpha, slot_bias, scale)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def aligned(heads):
        # one dominant direction per head (with a few large channels) plus token noise; per-element rms ~ `rms`
        mean = rand(heads, head_dim)
        big = torch.randint(0, head_dim, (heads, 2), generator=gen)
        mean.scatter_(1, big, 6.0 * torch.sign(rand(heads, 2)))
        mean = mean / mean.norm(dim=-1, keepdim=True) * mean_ratio
        noise = rand(batch, length, heads, head_dim) / math.sqrt(head_dim) * math.sqrt(1 - mean_ratio**2)
        return (mean + noise) * rms * math.sqrt(head_dim)

    q, k = aligned(q_heads), aligned(kv_heads)
    v = rand(batch, length, kv_heads, head_dim) * 0.6
    v = torch.where(rand(batch, length, kv_heads, head_dim).abs() > 3.0, v * 8, v)  # outliers
    # per-slot mean gate logit (a few slots that reset: about -1 nat per token, ~ -60..-120 per chunk) + token noise
    slot_mean = 0.15 + 1.5 * rand(kv_heads, slots)
    slot_mean = torch.where(rand(kv_heads, slots) > 1.65, -12.0 + 2 * rand(kv_heads, slots), slot_mean)
    f = slot_mean + 1.8 * rand(batch, length, kv_heads, slots)
    f = torch.where(rand(batch, length, kv_heads, slots) > 2.6, -18.0 + rand(batch, length, kv_heads, slots), f)
    log_alpha = torch.nn.functional.logsigmoid(f) / 8
    out = dict(q=q, k=k, v=v, q_rope=_rope(q), k_rope=_rope(k), log_alpha=log_alpha,
               slot_bias=torch.full((q_heads,), -4.0, dtype=torch.float64))
    out = {n: x.to(dtype) for n, x in out.items()}
    out["scale"] = head_dim**-0.5
    return out
