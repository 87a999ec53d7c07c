"""Decode-ready models and caches, for code that runs prefills and one-token steps itself (the bench, evaluation)
rather than through `generate`:

- `original_sharing_weights` and `every_window_full`: the original family model, and the NHA model with every
  window full, both built around an NHA model's own weight tensors (no second copy);
- `nha_static_cache` and `original_static_cache`: the static caches each decodes on, and `kv_cache_dtype`, the
  names of what NHA's full layers may store keys and values in;
- `prefill` and `one_token_step`: forwards that keep only the last position's logits (as `generate` does) and pass
  the cache under the keyword the installed transformers takes (`CACHE_ARGUMENT`).
"""

import copy

import torch
from transformers import StaticCache

from ..errors import NHARetrofitError
from .modeling_nha import CACHE_ARGUMENT
from .nha_cache import NHAStaticCache

KV_CACHE_DTYPES = {"auto": None, "float8_e4m3": torch.float8_e4m3fn}


def sharing_weights(model, model_class, config):
    """`model_class(config)` holding `model`'s parameter and buffer tensors under the same names, in eval mode."""
    with torch.device("meta"):
        shared = model_class(config)
    for name, _ in list(shared.named_parameters(remove_duplicate=False)):
        owner, _, leaf = name.rpartition(".")
        shared.get_submodule(owner)._parameters[leaf] = model.get_parameter(name)
    for name, _ in list(shared.named_buffers(remove_duplicate=False)):
        owner, _, leaf = name.rpartition(".")
        shared.get_submodule(owner)._buffers[leaf] = model.get_buffer(name)
    return shared.eval()


def original_sharing_weights(model):
    """The original family model (every layer full attention through transformers' own attention code) on `model`'s
    tensors."""
    original_class = type(model).__bases__[-1]  # NHA<Family>ForCausalLM(NHAForCausalLMMixin, <Family>ForCausalLM)
    return sharing_weights(model, original_class, copy.deepcopy(model.config))


def every_window_full(model):
    """The NHA model with every window full on `model`'s tensors: the original's attention in every layer, decoding
    through the same `NHAStaticCache` path as NHA (its full layers' steps, a CUDA graph on CUDA)."""
    config = copy.deepcopy(model.config)
    config.nha_windows, config.nha_full_kv_heads = [None] * len(config.nha_windows), None
    return sharing_weights(model, type(model), config)


def kv_cache_dtype(name: str):
    """The dtype NHA's full layers store keys and values in, by name (None: the model's own)."""
    if name not in KV_CACHE_DTYPES:
        raise NHARetrofitError(f"unknown KV cache dtype {name!r}; use {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def nha_static_cache(model, batch_size: int, length: int, kv_cache_dtype=None,
                     cuda_graph: bool = True) -> NHAStaticCache:
    """An `NHAStaticCache` for `model` on its device: `batch_size` sequences of up to `length` tokens, the full
    layers' keys and values stored in `kv_cache_dtype` (default: the model's dtype); `cuda_graph=False` for a cache
    decoded a few steps only (a graph capture would cost more than it saves)."""
    return NHAStaticCache(model.config, batch_size, length, model.dtype, model.device, cuda_graph=cuda_graph,
                          kv_cache_dtype=kv_cache_dtype)


def original_static_cache(model, batch_size: int, length: int, device) -> StaticCache:
    """transformers' `StaticCache` for the original `model`, allocated on `device` now (not at the first forward)."""
    config = model.config
    cache = StaticCache(config=config, max_cache_len=length)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache.early_initialization(batch_size, config.num_key_value_heads, head_dim, model.dtype, device)
    return cache


def prefill(model, ids, cache=None):
    """(the cache holding `ids`, the forward's output with the last position's logits). Without `cache`, the model
    makes its default one (transformers' dynamic cache for the original, `NHACache` for NHA)."""
    output = model(ids, use_cache=True, logits_to_keep=1, **({CACHE_ARGUMENT: cache} if cache is not None else {}))
    return cache if cache is not None else getattr(output, "cache", None) or output.past_key_values, output


def one_token_step(model, token, positions, cache, forward=None):
    """One token per sequence [B, 1] at `positions` [B, 1] on `cache`: the forward's output (last logits only).
    `forward` replaces `model.forward` (a compiled one)."""
    return (forward or model)(input_ids=token, position_ids=positions, use_cache=True, logits_to_keep=1,
                              **{CACHE_ARGUMENT: cache})
