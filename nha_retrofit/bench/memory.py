"""The bench's memory accounting: the bytes a generation cache holds, and how many sequences fit at a context.

A static cache's bytes per sequence are exact (built on the meta device, nothing allocated); the largest batch is
what the device's memory holds beyond what a batch-1 run needed besides its cache (weights, activations):
(device memory - (batch-1 peak - batch-1 cache)) // bytes per sequence."""

from ..modeling.nha_cache import MixedCacheLayer, NHACacheLayer, NHAStaticCache


def cache_bytes(cache) -> int:
    """Bytes a generation cache holds in its layers: key/value tensors of full layers and of NHA layers' full heads
    (as allocated for a static cache; with their scales when quantized), NHA states."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "tensors"):  # the layers of `NHAStaticCache`
            total += sum(t.numel() * t.element_size() for t in layer.tensors())
            continue
        if isinstance(layer, (NHACacheLayer, MixedCacheLayer)):
            total += layer.state_bytes()
        if getattr(layer, "keys", None) is not None:
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return total


def static_bytes_per_sequence(config, length: int, dtype, kv_cache_dtype=None) -> int:
    """Bytes one sequence of up to `length` tokens takes in an `NHAStaticCache` of `config`'s windows."""
    return cache_bytes(NHAStaticCache(config, 1, length, dtype, "meta", cuda_graph=False,
                                      kv_cache_dtype=kv_cache_dtype))


def largest_batch(memory_bytes: int, fixed_bytes: int, bytes_per_sequence: int) -> int:
    """Sequences whose caches fit in `memory_bytes` beside `fixed_bytes` (weights, activations)."""
    return max(0, (memory_bytes - fixed_bytes) // bytes_per_sequence)
