"""The public way to decode outside `generate`: the original and the every-window-full model on an NHA model's own
tensors, the static caches they decode on, and one-token steps that equal a whole forward."""

import torch

from nha_retrofit.modeling.decoding import (every_window_full, nha_static_cache, one_token_step,
                                            original_sharing_weights, original_static_cache, prefill)
from nha_retrofit.modeling.load import load_nha_checkpoint
from nha_retrofit.modeling.nha_cache import NHAStaticCache, StaticFullLayer
from tiny_models import tiny_nha_pair


def test_original_sharing_weights_is_the_original_model(family):
    """The same logits as the original checkpoint loaded by transformers, on the NHA model's own tensors."""
    _, original, _, out = family
    nha = load_nha_checkpoint(out)
    rebuilt = original_sharing_weights(nha)
    assert type(rebuilt) is type(original)
    shared = {p.data_ptr() for p in nha.parameters()}
    assert all(p.data_ptr() in shared and not p.is_meta for p in rebuilt.parameters())
    assert not any(b.is_meta for b in rebuilt.buffers())
    ids = torch.randint(0, original.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (rebuilt(ids).logits - original(ids).logits).abs().max() <= 1e-5


def test_every_window_full_is_the_original_on_the_same_tensors():
    """Every layer full, the NHA model's tensors shared (not copied), its planned windows untouched; its logits are
    the original's, and its one-token steps on an NHAStaticCache continue them."""
    original, nha = tiny_nha_pair([3, None, 0, 5])
    full = every_window_full(nha)
    assert full.config.nha_windows == [None] * 4 and nha.config.nha_windows == [3, None, 0, 5]
    shared = {p.data_ptr() for p in nha.parameters()}
    assert all(p.data_ptr() in shared for p in full.parameters())
    ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = original(ids).logits
        assert (full(ids).logits - expected).abs().max() <= 1e-5
        cache = nha_static_cache(full, 2, 21)
        assert all(isinstance(layer, StaticFullLayer) for layer in cache.layers)
        _, out = prefill(full, ids[:, :18], cache)
        steps = [out.logits[:, -1]]
        for t in range(18, 20):
            positions = torch.full((2, 1), t)
            steps.append(one_token_step(full, ids[:, t : t + 1], positions, cache).logits[:, -1])
    assert (torch.stack(steps, 1) - expected[:, 17:20]).abs().max() <= 1e-5


def test_original_decodes_on_its_dynamic_and_static_caches_as_one_forward():
    original, nha = tiny_nha_pair([3, None, 0, 5])
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = original(ids).logits[:, -1]
        dynamic, _ = prefill(original, ids[:, :15])
        last = one_token_step(original, ids[:, 15:], torch.tensor([[15]]), dynamic).logits[:, -1]
        assert (last - expected).abs().max() <= 1e-5
        static = original_static_cache(original, 1, 24, "cpu")
        config = original.config
        head_dim = config.hidden_size // config.num_attention_heads
        assert static.layers[0].keys.shape == (1, config.num_key_value_heads, 24, head_dim)
        _, out = prefill(original, ids[:, :15], static)
        last = one_token_step(original, ids[:, 15:], torch.tensor([[15]]), static).logits[:, -1]
    assert (last - expected).abs().max() <= 1e-5 and isinstance(nha_static_cache(nha, 1, 8), NHAStaticCache)
