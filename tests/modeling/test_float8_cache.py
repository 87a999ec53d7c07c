"""A float8 (e4m3) static cache for the full layers: per position and head scales, keys and values dequantized where
they are read, half the bytes of bfloat16. Its attention and logits stay within stated bounds of a float64 / float32
reference, and its batch-grouped reads equal one whole read."""

import pytest
import torch

from nha_retrofit.modeling import nha_cache
from nha_retrofit.modeling.nha_cache import NHAStaticCache, dequantize, quantize
from tiny_models import tiny_nha_pair

FLOAT8 = torch.float8_e4m3fn
# e4m3 keeps 3 mantissa bits: a rounding error of at most 2^-4 of each value (below the format's smallest normal,
# 2^-6 of the scaled range, an absolute 2^-10 of it).
VALUE_BOUND = 2.0**-4
# Relative error bounds through a float8 cache: one layer's attention over Gaussian keys and values against float64
# (measured 0.034), a tiny model's logits against a float32 cache (measured 0.003-0.005).
ATTENTION_BOUND, LOGITS_BOUND = 0.04, 0.01


def relative(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_quantize_keeps_each_value_within_the_format_rounding():
    x = torch.randn(3, 2, 17, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 17)[:, None]
    q, scale = quantize(x, FLOAT8)
    assert q.dtype == FLOAT8 and scale.shape == (3, 2, 17) and scale.dtype == torch.float32
    back = dequantize(q, scale, torch.float32)
    floor = scale.unsqueeze(-1) * 448 * 2.0**-10
    assert ((back - x).abs() <= VALUE_BOUND * x.abs() + floor).all()
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=VALUE_BOUND)  # each vector spans the range


def decode_steps(model, ids, new_tokens, kv_cache_dtype=None):
    """Logits of a prefill of `ids` then `new_tokens` greedy one-token steps on one static cache."""
    cache = NHAStaticCache(model.config, ids.shape[0], ids.shape[1] + new_tokens, torch.float32, "cpu",
                           kv_cache_dtype=kv_cache_dtype)
    logits, token = [], None
    with torch.no_grad():
        out = model(ids, cache=cache)
        for _ in range(new_tokens):
            token = out.logits[:, -1:].argmax(-1) if token is None else token
            logits.append(out.logits[:, -1])
            out = model(token, cache=cache)
    return torch.stack(logits, 1), cache


@pytest.mark.parametrize("windows", [[None, 4, None, 4], [None] * 4])
def test_decode_on_a_float8_cache_stays_close_to_float32(windows):
    _, nha = tiny_nha_pair(windows)
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    exact, _ = decode_steps(nha, ids, 5)
    approximate, cache = decode_steps(nha, ids, 5, FLOAT8)
    assert 0 < relative(approximate, exact) <= LOGITS_BOUND
    full = [layer for layer in cache.layers if isinstance(layer, nha_cache.StaticFullLayer)]
    assert full and all(layer.keys.dtype == FLOAT8 and layer.key_scales.dtype == torch.float32 for layer in full)


def test_a_float8_layer_attends_as_float64_attention_within_the_bound():
    """One full layer's decode step (grouped query heads, some positions padding) against softmax attention in
    float64 over the unquantized keys and values."""
    generator = torch.Generator().manual_seed(7)
    batch, heads, q_heads, length, dim = 3, 2, 4, 40, 32
    positions = nha_cache.StaticPositions(batch, length, "cpu")
    layer = nha_cache.StaticFullLayer(positions, heads, dim, torch.float32, FLOAT8)
    keys, values = torch.randn(2, batch, heads, length - 1, dim, generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :9] = 0
    positions.admit(length - 1, mask[:, :-1])
    layer.update(keys, values)
    positions.advance(length - 1)
    query, key, value = (torch.randn(batch, 1, n, dim, generator=generator) for n in (q_heads, heads, heads))
    positions.admit(1)
    out = layer.decode(query, key, value, dim**-0.5)
    all_keys = torch.cat([keys, key.transpose(1, 2)], 2).double().repeat_interleave(q_heads // heads, 1)
    all_values = torch.cat([values, value.transpose(1, 2)], 2).double().repeat_interleave(q_heads // heads, 1)
    scores = query.transpose(1, 2).double() @ all_keys.transpose(2, 3) * dim**-0.5
    scores = scores.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    reference = (scores.softmax(-1) @ all_values).transpose(1, 2)
    assert 0 < relative(out, reference) <= ATTENTION_BOUND


def test_grouped_dequantized_reads_equal_one_read(monkeypatch):
    """Dequantizing a few sequences at a time (a small `DEQUANTIZED_BYTES`) gives exactly the whole-batch result."""
    _, nha = tiny_nha_pair([None, 4, None, 4])
    ids = torch.randint(3, 128, (5, 30), generator=torch.Generator().manual_seed(4))
    whole, _ = decode_steps(nha, ids, 3, FLOAT8)
    monkeypatch.setattr(nha_cache, "DEQUANTIZED_BYTES", 1)  # one sequence at a time
    grouped, _ = decode_steps(nha, ids, 3, FLOAT8)
    assert torch.equal(whole, grouped)


def test_float8_cache_bytes_and_repeated_copies():
    """Keys and values take one byte per element plus a float32 scale per position and head; `repeated` keeps the
    dtype and copies the scales."""
    _, nha = tiny_nha_pair([None, 4, None, 4])
    config, batch, length = nha.config, 2, 64
    plain = NHAStaticCache(config, batch, length, torch.bfloat16, "cpu")
    small = NHAStaticCache(config, batch, length, torch.bfloat16, "cpu", kv_cache_dtype=FLOAT8)
    heads = config.num_key_value_heads
    dim = config.hidden_size // config.num_attention_heads
    per_layer = {name: sum(t.numel() * t.element_size() for t in cache.layers[0].tensors())
                 for name, cache in (("plain", plain), ("small", small))}
    assert per_layer["plain"] == 2 * batch * heads * length * dim * 2
    assert per_layer["small"] == 2 * batch * heads * length * (dim + 4)
    layer = small.layers[0]
    layer.key_scales.copy_(torch.rand(layer.key_scales.shape, generator=torch.Generator().manual_seed(1)))
    copy = small.repeated(3)
    assert copy.layers[0].keys.dtype == FLOAT8 and copy.kv_cache_dtype == FLOAT8
    assert torch.equal(copy.layers[0].key_scales, layer.key_scales.repeat_interleave(3, 0))
