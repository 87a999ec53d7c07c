"""The decode paths the bench times: NHA, and the original at its best on the same weight tensors.

- `nha`: NHA on `NHAStaticCache`, its one-token steps replayed from a CUDA graph on CUDA (eager elsewhere);
- the baselines, every one filled from one prefill of the original per round (transformers' default dynamic cache,
  PyTorch's own choice among every SDPA backend, native grouped-query attention):
  - `original, eager`: one-token steps on that dynamic cache, as transformers runs them by default (no mask: a
    single query attends to every cached position);
  - `original, compiled` (CUDA only): transformers' `StaticCache` with the steps through
    torch.compile(mode="reduce-overhead"), compiled for every context: transformers' own fast path;
  - `original, every window full`: the same weights as an NHA model with every window full, on the same
    `NHAStaticCache` CUDA-graph path as NHA (grouped heads read in place, no mask over the whole cache).
"""

import torch

from ..modeling.decoding import (every_window_full, nha_static_cache, one_token_step, original_sharing_weights,
                                 original_static_cache, prefill)

NHA = "nha"
EAGER = "original, eager"
COMPILED = "original, compiled"
EVERY_WINDOW_FULL = "original, every window full"


def next_token(output) -> torch.Tensor:
    return output.logits[:, -1:].argmax(-1)


class StaticDecoder:
    """A model on an `NHAStaticCache` (a CUDA graph on CUDA): NHA, or the original as every window full."""

    def __init__(self, name: str, model, kv_cache_dtype=None):
        self.name, self.model, self.kv_cache_dtype = name, model, kv_cache_dtype
        self.graph = model.device.type == "cuda"
        stored = (f", full layers' keys and values in {str(kv_cache_dtype).removeprefix('torch.')}" if kv_cache_dtype
                  else "")
        steps = "; decode steps replayed from a CUDA graph" if self.graph else "; eager decode steps"
        self.description = "NHAStaticCache" + stored + steps
        if name == EVERY_WINDOW_FULL:
            self.description = "the same weights with every window full on " + self.description

    def prefill(self, ids, room: int):
        """(a static cache holding `ids` with room for `room` more tokens, the greedy next token [B, 1])."""
        cache = nha_static_cache(self.model, ids.shape[0], ids.shape[1] + room, self.kv_cache_dtype)
        return cache, next_token(prefill(self.model, ids, cache)[1])

    def filled_from(self, dynamic, length: int, room: int):
        """A static cache holding the first `length` positions of the original's dynamic cache (every layer full:
        the same keys and values the model would store), with room for `room` more."""
        cache = nha_static_cache(self.model, dynamic.layers[0].keys.shape[0], length + room, self.kv_cache_dtype)
        cache.positions.admit(length)
        for layer, filled in zip(cache.layers, dynamic.layers):
            layer.update(filled.keys[:, :, :length], filled.values[:, :, :length])
        cache.positions.advance(length)
        return cache

    def step(self, cache, token, positions):
        return next_token(one_token_step(self.model, token, positions, cache))

    def repeated(self, cache, repeats: int):
        return cache.repeated(repeats)


class Original:
    """The original family model on the NHA model's tensors: its prefill on transformers' dynamic cache, its eager
    steps there, and (CUDA) its compiled steps on transformers' `StaticCache`."""

    def __init__(self, model, compile_steps: bool):
        self.model = original_sharing_weights(model)
        self.compiled = torch.compile(self.model.forward, mode="reduce-overhead") if compile_steps else None
        self.static = None  # the compiled path's StaticCache, kept across rounds of one length (its address is
        # part of the compiled graph: a new cache would compile again)

    def prefill(self, ids):
        """(transformers' dynamic cache holding `ids`, the greedy next token [B, 1])."""
        cache, output = prefill(self.model, ids)
        return cache, next_token(output)

    def eager_step(self, cache, token, positions):
        return next_token(one_token_step(self.model, token, positions, cache))

    def static_from(self, dynamic, length: int, room: int):
        """The compiled path's `StaticCache` holding the first `length` positions of `dynamic`."""
        batch, device = dynamic.layers[0].keys.shape[0], dynamic.layers[0].keys.device
        if self.static is None or self.static.layers[0].keys.shape[2] != length + room:
            self.static = None
            self.static = original_static_cache(self.model, batch, length + room, device)
        for layer, filled in zip(self.static.layers, dynamic.layers):
            layer.keys[:, :, :length].copy_(filled.keys[:, :, :length])
            layer.values[:, :, :length].copy_(filled.values[:, :, :length])
            layer.cumulative_length.fill_(length)
        return self.static

    def compiled_step(self, cache, token, positions):
        return next_token(one_token_step(self.model, token, positions, cache, forward=self.compiled))


def full_windows_decoder(model) -> StaticDecoder:
    return StaticDecoder(EVERY_WINDOW_FULL, every_window_full(model))
