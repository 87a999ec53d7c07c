"""The static NHA cache: pre-allocated, updated in place, the dynamic cache's results, and decode steps that a CUDA
graph can capture (no host reads of device values). The CUDA-graph replay itself is tested on the GPU at the end."""

import pytest
import torch

from nha_retrofit.modeling.nha_cache import SPLIT_FROM, NHAStaticCache, attend_stored, stored_length
from nha_retrofit.plan import nha_state_bytes
from tiny_models import TINY_LLAMA, left_padded_ids, tiny_nha_pair

WINDOW_PLANS = [[3, None, 0, 5], [64, None, 64, 64], [None] * 4]
HOST_READS = ("__bool__", "item", "__int__", "__float__", "tolist")


def cache_of(output):
    return getattr(output, "cache", None) or output.past_key_values


def generate_both(model, ids, mask, new_tokens=6, **kwargs):
    common = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                  output_logits=True, **kwargs)
    with torch.no_grad():
        return model.generate(ids, **common), model.generate(ids, cache_implementation="static", **common)


@pytest.mark.parametrize("windows", WINDOW_PLANS)
def test_static_generate_equals_dynamic_on_a_left_padded_batch(windows):
    _, nha = tiny_nha_pair(windows)
    ids, mask = left_padded_ids([30, 17, 5], 30, seed=4)
    dynamic, static = generate_both(nha, ids, mask)
    assert isinstance(cache_of(static), NHAStaticCache)
    assert torch.equal(dynamic.sequences, static.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(dynamic.logits, static.logits)) <= 1e-5


def test_static_generate_past_the_split_length_equals_dynamic():
    """A cache longer than SPLIT_FROM positions is read in slices: same tokens and logits as the dynamic cache."""
    _, nha = tiny_nha_pair([4, None, 2, None], max_position_embeddings=4096)
    ids = torch.randint(3, 128, (1, SPLIT_FROM + 40), generator=torch.Generator().manual_seed(2))
    dynamic, static = generate_both(nha, ids, torch.ones_like(ids), new_tokens=3)
    assert cache_of(static).get_max_length() % 256 == 0 and cache_of(static).get_max_length() > SPLIT_FROM
    assert torch.equal(dynamic.sequences, static.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(dynamic.logits, static.logits)) <= 1e-5


def test_prefill_in_pieces_then_decode_on_a_static_cache_equals_one_forward():
    _, nha = tiny_nha_pair([3, None, 7, 0])
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    cache = NHAStaticCache(nha.config, 2, 40, torch.float32, "cpu")
    with torch.no_grad():
        full = nha(ids, use_cache=False).logits
        pieces = [nha(ids[:, :20], cache=cache).logits, nha(ids[:, 20:34], cache=cache).logits]
        for t in range(34, 40):
            pieces.append(nha(ids[:, t : t + 1], cache=cache).logits)
    assert int(cache.get_seq_length()) == 40
    assert (torch.cat(pieces, 1) - full).abs().max() <= 1e-5


def test_attend_stored_equals_softmax_attention_over_real_positions():
    """Grouped query heads, padding flags, and a length read in slices, against the plain formula in float64."""
    gen = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, dim, length = 3, 6, 2, 16, 2304
    query = torch.randn(batch, 1, q_heads, dim, generator=gen)
    keys, values = (torch.randn(batch, kv_heads, length, dim, generator=gen) for _ in range(2))
    real = torch.rand(batch, length, generator=gen) > 0.3
    out = attend_stored(query, keys, values, real, 0.25)
    expanded = lambda x: x.double().repeat_interleave(q_heads // kv_heads, dim=1)  # noqa: E731
    scores = torch.einsum("bhd,bhld->bhl", query[:, 0].double(), expanded(keys)) * 0.25
    probs = scores.masked_fill(~real[:, None], float("-inf")).softmax(-1)
    reference = torch.einsum("bhl,bhld->bhd", probs, expanded(values))
    assert out.shape == (batch, 1, q_heads, dim)
    assert (out[:, 0].double() - reference).abs().max() <= 1e-5


def test_static_decode_reads_no_device_value_on_the_host(monkeypatch):
    """What a CUDA graph capture forbids: a one-token step on the static cache never turns a tensor into a Python
    value (each such read is a device sync on CUDA). An unpadded prefill reads the filled length once, not once per
    layer."""
    _, nha = tiny_nha_pair([3, None, 0, 5])
    ids, mask = left_padded_ids([12, 7], 12, seed=3)
    reads = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _f=original, _n=name, **k: reads.append(_n) or _f(
            self, *a, **k))
    with torch.no_grad():
        nha(ids, cache=NHAStaticCache(nha.config, 2, 20, torch.float32, "cpu"))
        assert reads == ["__int__"]
        cache = NHAStaticCache(nha.config, 2, 20, torch.float32, "cpu")
        nha(ids, attention_mask=mask, cache=cache)
        reads.clear()
        positions = mask.sum(1, keepdim=True)
        for step in range(3):
            nha(ids[:, :1], attention_mask=torch.cat([mask, torch.ones(2, step + 1, dtype=torch.long)], 1),
                position_ids=positions + step, cache=cache)
    assert reads == []


def test_static_cache_is_allocated_once_and_holds_the_plan_bytes():
    _, nha = tiny_nha_pair([3, None, 0, 5])
    cache = NHAStaticCache(nha.config, 1, 40, torch.float32, "cpu")
    before = [t.data_ptr() for layer in cache.layers for t in layer.tensors()]
    held = cache.held_bytes()
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        nha(ids, cache=cache)
        for t in range(5):
            nha(ids[:, :1], cache=cache)
    assert [t.data_ptr() for layer in cache.layers for t in layer.tensors()] == before
    assert cache.held_bytes() == held
    heads, head_dim = TINY_LLAMA["num_key_value_heads"], TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
    assert cache.nha_state_bytes() == [nha_state_bytes(heads, head_dim, 5, w, 4) if w is not None else 0
                                       for w in (3, None, 0, 5)]
    assert stored_length(40) == 40 and stored_length(SPLIT_FROM + 1) == SPLIT_FROM + 256


def test_repeated_cache_decodes_each_copy_as_the_original():
    _, nha = tiny_nha_pair([3, None, 0, 5])
    ids = torch.randint(3, 128, (1, 25), generator=torch.Generator().manual_seed(6))
    single = NHAStaticCache(nha.config, 1, 30, torch.float32, "cpu")
    with torch.no_grad():
        nha(ids, cache=single)
        many = single.repeated(3)
        token = torch.tensor([[17]])
        expected = nha(token, cache=single).logits
        logits = nha(token.expand(3, 1), cache=many).logits
    assert int(many.get_seq_length()) == 26 and many.batch_size == 3
    assert (logits - expected).abs().max() <= 1e-6


def test_static_cache_errors_name_the_limit():
    _, nha = tiny_nha_pair([3, None, 0, 5])
    cache = NHAStaticCache(nha.config, 1, 20, torch.float32, "cpu")
    with torch.no_grad(), pytest.raises(ValueError, match="holds 20 positions; 0 are filled and 25 more"):
        nha(torch.randint(3, 128, (1, 25)), cache=cache)
    with pytest.raises(ValueError, match="cache_implementation='offloaded_static'"):
        nha.generate(torch.randint(3, 128, (1, 5)), max_new_tokens=2, cache_implementation="offloaded_static")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("windows, heads", [([64, None, 64, 64], None), ([0, 4, None, 8], None),
                                            ([64, None, 64, 4], [[1], [], [0], [1]])])
def test_graph_replayed_decode_equals_eager_decode_on_the_gpu(windows, heads):
    """On CUDA (the Triton decode step): bf16 steps replayed from the CUDA graph give the eager static steps' tokens
    and logits (the fused layers uncompiled, so both run the same operations); in float32, `generate` on the static
    cache (graph-replayed, the fused layers compiled) gives the dynamic cache's tokens and logits within 1e-4 (bf16
    would let near-tied random logits flip a greedy token). With full KV heads too."""
    _, nha = tiny_nha_pair(windows, slots=16, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           full_kv_heads=heads)
    ids, mask = left_padded_ids([40, 23, 9], 40, seed=5)
    ids, mask = ids.cuda(), mask.cuda()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    nha = nha.to("cuda", torch.bfloat16)
    runs = {}
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for graph in (False, True):
            cache = NHAStaticCache(nha.config, 3, 60, torch.bfloat16, "cuda", cuda_graph=graph)
            out = nha(ids, attention_mask=mask, position_ids=positions, cache=cache, logits_to_keep=1)
            tokens, logits, step_mask = [], [], mask
            for step in range(12):
                token = out.logits[:, -1:].argmax(-1)
                tokens.append(token)
                step_mask = torch.cat([step_mask, torch.ones_like(token)], 1)
                out = nha(token, attention_mask=step_mask, position_ids=positions[:, -1:] + step + 1, cache=cache)
                logits.append(out.logits.float())
            runs[graph] = torch.cat(tokens, 1), torch.cat(logits, 1)
            assert (cache.decode_graph is not None) == graph
    assert torch.equal(runs[False][0], runs[True][0])
    assert (runs[False][1] - runs[True][1]).abs().max() <= 1e-2 * runs[False][1].abs().max()
    dynamic, static = generate_both(nha.float(), ids, mask, new_tokens=12)
    assert cache_of(static).decode_graph is not None
    assert torch.equal(dynamic.sequences, static.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(dynamic.logits, static.logits)) <= 1e-4
