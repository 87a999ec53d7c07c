"""NHA layers with full KV heads (`nha_full_kv_heads`): those heads' query heads read every position exactly as a full
layer's do, the others exactly as the NHA layer's, and every cache gives the uncached forward's results."""

import pytest
import torch

from nha_retrofit.bench.memory import cache_bytes
from nha_retrofit.modeling.configuration_nha import NHALlamaConfig
from nha_retrofit.modeling.nha_cache import MixedCacheLayer, NHACache, NHAStaticCache, NHAStaticLayer, StaticMixedLayer
from tiny_models import TINY_LLAMA, left_padded_ids, tiny_nha_pair

WINDOWS = [3, None, 7, 0]
HEADS = [[0], [], [1], [0]]  # the tiny Llama: 2 KV heads, 3 query heads each


def head_outputs(attention, hidden, position_embeddings):
    """The attention's per-query-head outputs before o_proj [B, T, HQ, D], for `hidden`."""
    seen = {}
    hook = attention.o_proj.register_forward_hook(lambda module, args, out: seen.update(x=args[0]))
    try:
        attention(hidden, position_embeddings)
    finally:
        hook.remove()
    return seen["x"].view(*hidden.shape[:2], attention.config.num_attention_heads, attention.head_dim)


@pytest.mark.parametrize("window", [0, 1, 5, 64])
@pytest.mark.parametrize("full", [[0], [1]])
def test_full_heads_read_as_a_full_layer_and_the_others_as_nha(window, full):
    _, nha = tiny_nha_pair([window, None, 4, 4], full_kv_heads=[full, [], [], []])
    attention = nha.model.layers[0].self_attn
    hidden = torch.randn(2, 90, TINY_LLAMA["hidden_size"], generator=torch.Generator().manual_seed(5))
    positions = torch.arange(90).expand(2, 90)
    rotary = nha.model.rotary_emb(hidden, positions)
    with torch.no_grad():
        mixed = head_outputs(attention, hidden, rotary)
        attention.full_kv_heads, attention.window = [], window
        attention._head_index_cache.clear()
        nha_only = head_outputs(attention, hidden, rotary)
        attention.window = None
        full_only = head_outputs(attention, hidden, rotary)
    groups = TINY_LLAMA["num_attention_heads"] // TINY_LLAMA["num_key_value_heads"]
    full_query = [head * groups + i for head in full for i in range(groups)]
    nha_query = [head for head in range(TINY_LLAMA["num_attention_heads"]) if head not in full_query]
    assert (mixed[:, :, full_query] - full_only[:, :, full_query]).abs().max() <= 1e-5
    assert (mixed[:, :, nha_query] - nha_only[:, :, nha_query]).abs().max() <= 1e-5
    assert (mixed[:, :, full_query] - nha_only[:, :, full_query]).abs().max() > 1e-3  # the heads really differ


def test_dynamic_and_static_caches_equal_one_forward():
    _, nha = tiny_nha_pair(WINDOWS, full_kv_heads=HEADS)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    results = []
    with torch.no_grad():
        whole = nha(ids, use_cache=False).logits
        for cache in (NHACache(nha.config), NHAStaticCache(nha.config, 2, 40, torch.float32, "cpu")):
            pieces = [nha(ids[:, :20], cache=cache).logits, nha(ids[:, 20:34], cache=cache).logits]
            pieces += [nha(ids[:, t : t + 1], cache=cache).logits for t in range(34, 40)]
            results.append(torch.cat(pieces, 1))
            assert int(cache.get_seq_length()) == 40
    assert isinstance(cache.layers[0], StaticMixedLayer) and cache.layers[0].keys.shape[1] == 1
    for logits in results:
        assert (logits - whole).abs().max() <= 1e-5


def test_static_generate_equals_dynamic_on_a_left_padded_batch():
    _, nha = tiny_nha_pair(WINDOWS, full_kv_heads=HEADS)
    ids, mask = left_padded_ids([30, 17, 5], 30, seed=4)
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                  output_logits=True)
    with torch.no_grad():
        dynamic = nha.generate(ids, **common)
        static = nha.generate(ids, cache_implementation="static", **common)
    assert isinstance((getattr(dynamic, "cache", None) or dynamic.past_key_values).layers[0], MixedCacheLayer)
    assert torch.equal(dynamic.sequences, static.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(dynamic.logits, static.logits)) <= 1e-5


def test_cache_bytes_count_the_full_heads_keys_and_the_other_heads_state():
    _, nha = tiny_nha_pair(WINDOWS, full_kv_heads=HEADS)
    _, plain = tiny_nha_pair(WINDOWS)
    length, head_dim = 64, TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
    mixed = NHAStaticCache(nha.config, 1, length, torch.float32, "meta", cuda_graph=False)
    whole = NHAStaticCache(plain.config, 1, length, torch.float32, "meta", cuda_graph=False)
    one_head_states = sum(NHAStaticLayer(mixed.positions, window, 1, 5, head_dim, torch.float32).state_bytes()
                          for window in (3, 7, 0))
    full_heads = 3 * 2 * length * head_dim * 4  # each full KV head: keys and values of every position, float32
    expected = cache_bytes(whole) - sum(whole.nha_state_bytes()) + one_head_states + full_heads
    assert cache_bytes(mixed) == expected
    assert mixed.nha_state_bytes()[1] == 0 and sum(mixed.nha_state_bytes()) == one_head_states


def test_set_windows_keeps_or_replaces_the_full_heads():
    _, nha = tiny_nha_pair(WINDOWS, full_kv_heads=HEADS)
    nha.set_windows([3, None, None, 0])
    assert nha.config.nha_full_kv_heads == [[0], [], [], [0]]
    nha.set_windows(WINDOWS, HEADS)
    assert nha.config.nha_full_kv_heads == HEADS and nha.model.layers[2].self_attn.full_kv_heads == [1]


def test_the_all_full_variant_puts_the_full_heads_back():
    from nha_retrofit.eval.variants import Variants

    _, nha = tiny_nha_pair(WINDOWS, full_kv_heads=HEADS)
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = nha(ids).logits
        with Variants(nha, ["nha_all_full"]).use("nha_all_full") as model:
            assert model.config.nha_windows == [None] * 4 and model(ids).logits.sub(before).abs().max() > 1e-3
        assert nha.config.nha_full_kv_heads == HEADS and torch.equal(nha(ids).logits, before)


@pytest.mark.parametrize("heads, problem", [
    ([[2], [], [], []], "distinct KV head ids 0..1"),
    ([[0, 0], [], [], []], "distinct KV head ids"),
    ([[], [0], [], []], "is a full layer already"),
    ([[0, 1], [], [], []], "make the layer full instead"),
    ([[0], [], []], "has 3 entries for 4 layers"),
])
def test_a_config_refuses_full_heads_that_cannot_work(heads, problem):
    with pytest.raises(ValueError, match=problem):
        NHALlamaConfig(**TINY_LLAMA, nha_windows=WINDOWS, nha_full_kv_heads=heads)
