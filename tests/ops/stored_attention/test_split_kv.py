"""The Triton stored read (`ops/stored_attention/split_kv.py`) against the float64 definition (`naive.py`, itself
checked against a loop over heads), on CUDA and, without it, under Triton's CPU interpreter (bounds-checked, buffers
poisoned: `operator_cases`)."""

import pytest
import torch

from operator_cases import DEVICE, TOL, kernel_checks, rel

pytest.importorskip("triton")

from nha_retrofit.modeling import nha_cache  # noqa: E402
from nha_retrofit.modeling.nha_cache import attend_stored, dequantize, quantize  # noqa: E402
from nha_retrofit.ops.stored_attention import naive_stored_attention, split_kv_stored_attention  # noqa: E402
from nha_retrofit.ops.stored_attention import split_kv  # noqa: E402

FLOAT8 = torch.float8_e4m3fn
# (batch, kv heads, query heads per kv head, stored positions, head dim, value dim, stored dtype, padding)
CASES = [
    (1, 1, 1, 1, 16, 16, torch.float32, "none"),  # one position
    (2, 2, 3, 300, 32, 16, torch.float32, "random"),  # GQA by 3, values narrower than keys, a partial last tile
    (1, 1, 4, 1000, 64, 64, torch.bfloat16, "left"),  # four splits, the first with no real position
    (3, 2, 4, 129, 128, 128, FLOAT8, "random"),
    (1, 2, 2, 700, 64, 64, FLOAT8, "left"),
]


def stored_inputs(batch, kv_heads, groups, length, dim, value_dim, stored, padding, seed=0):
    """(query [B, 1, HQ, D] in the compute dtype, keys, values, real, key scales, value scales): keys and values
    are views of a longer cache (as a static cache's are), with magnitudes that vary by position."""
    generator = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-1, 1, length)[:, None]
    keys = (torch.randn(batch, kv_heads, length + 5, dim, generator=generator) * 2)[:, :, :length] * spread
    values = torch.randn(batch, kv_heads, length + 5, value_dim, generator=generator)[:, :, :length] * spread
    query = torch.randn(batch, 1, kv_heads * groups, dim, generator=generator)
    real = torch.ones(batch, length, dtype=torch.bool)
    if padding == "random":
        real = torch.rand(batch, length, generator=generator) > 0.3
    elif padding == "left":
        real[:, : int(0.4 * length)] = False
    real[:, -1] = True  # a decode step's own token is real
    if stored == FLOAT8:
        (keys, key_scales), (values, value_scales) = quantize(keys, FLOAT8), quantize(values, FLOAT8)
        return query.bfloat16(), keys, values, real, key_scales, value_scales
    return query.to(stored), keys.to(stored), values.to(stored), real, None, None


def to_device(tensors):
    return [t.to(DEVICE) if t is not None else None for t in tensors]


def float64_reference(query, keys, values, real, key_scales, value_scales, scale):
    q, k, v, ks, vs = (t.double() if t is not None else None for t in (query, keys, values, key_scales, value_scales))
    return naive_stored_attention(q, k, v, real, scale, ks, vs)


def test_naive_equals_a_loop_over_sequences_and_heads():
    query, keys, values, real, key_scales, value_scales = stored_inputs(2, 2, 3, 50, 16, 8, FLOAT8, "random")
    out = float64_reference(query, keys, values, real, key_scales, value_scales, 0.25)
    for b in range(2):
        for head in range(6):
            k = keys[b, head // 3].double() * key_scales[b, head // 3].double()[:, None]
            v = values[b, head // 3].double() * value_scales[b, head // 3].double()[:, None]
            scores = (k[real[b]] @ query[b, 0, head].double()) * 0.25
            expected = scores.softmax(0) @ v[real[b]]
            assert torch.allclose(out[b, 0, head], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_H{}_G{}_L{}_D{}-{}_{}_{}".format(
    *c[:6], str(c[6]).split(".")[-1], c[7]))
def test_split_kv_read_matches_float64(case):
    """Against float64 attention over the stored values: fp32 to 1e-5; bf16 and float8 (bf16 queries) within the
    bf16 tolerance and no further from float64 than the grouped-matmul read of the same cache dequantized."""
    query, keys, values, real, key_scales, value_scales = to_device(stored_inputs(*case))
    scale = case[4] ** -0.5
    with kernel_checks(query.dtype):
        out = split_kv_stored_attention(query, keys, values, real, scale, key_scales, value_scales)
    reference = float64_reference(query, keys, values, real, key_scales, value_scales, scale)
    assert out.shape == reference.shape and out.dtype == query.dtype and torch.isfinite(out).all()
    error = rel(out, reference)
    if query.dtype == torch.float32:
        assert error <= 1e-5
        return
    assert error <= TOL[torch.bfloat16]
    if key_scales is not None:
        keys, values = dequantize(keys, key_scales, query.dtype), dequantize(values, value_scales, query.dtype)
    assert error <= 1.5 * rel(attend_stored(query, keys, values, real, scale), reference) + 1e-4


def test_splits_cover_the_cache_whatever_the_batch():
    """A batch too large to split keeps one split per (sequence, kv head); one sequence is split into tiles of
    `BLOCK_N`, and both read the same result."""
    query, keys, values, real, key_scales, value_scales = to_device(stored_inputs(4, 1, 2, 520, 16, 16, FLOAT8, "left"))
    with kernel_checks(query.dtype):
        whole = split_kv_stored_attention(query, keys, values, real, 0.25, key_scales, value_scales)
        first = split_kv_stored_attention(query[:1], keys[:1], values[:1], real[:1], 0.25, key_scales[:1],
                                          value_scales[:1])
    assert rel(first, whole[:1]) <= 1e-2 and split_kv.MIN_SPLIT_TILES * split_kv.BLOCK_N < 520


def test_a_float8_cache_layer_reads_through_the_kernel(monkeypatch):
    """`StaticFullLayer.decode` hands its float8 keys, values, flags and scales to the kernel (here run under the
    dispatch's name), which agrees with the dequantizing read."""
    generator = torch.Generator().manual_seed(5)
    batch, heads, q_heads, length, dim = 2, 2, 4, 70, 32
    layers = []
    for _ in range(2):
        positions = nha_cache.StaticPositions(batch, length, DEVICE)
        layer = nha_cache.StaticFullLayer(positions, heads, dim, torch.bfloat16, FLOAT8)
        layers.append((positions, layer))
    keys, values = torch.randn(2, batch, heads, length - 1, dim, generator=generator).to(DEVICE, torch.bfloat16)
    query, key, value = (torch.randn(batch, 1, n, dim, generator=generator).to(DEVICE, torch.bfloat16)
                         for n in (q_heads, heads, heads))
    calls = []

    def kernel(*args):
        calls.append(args)
        with kernel_checks(torch.bfloat16):
            return split_kv_stored_attention(*args)

    outputs = []
    for read, (positions, layer) in zip((kernel, lambda *args: None), layers):
        monkeypatch.setattr(nha_cache, "float8_stored_attention", read)
        positions.admit(length - 1)
        layer.update(keys, values)
        positions.advance(length - 1)
        positions.admit(1)
        outputs.append(layer.decode(query, key, value, dim**-0.5))
    assert len(calls) == 1 and calls[0][1] is layers[0][1].keys and calls[0][5] is layers[0][1].key_scales
    assert rel(outputs[0], outputs[1]) <= TOL[torch.bfloat16]
