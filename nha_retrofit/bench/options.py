"""The bench's options, checked before any model is built or loaded: one error line for what cannot be measured."""

from ..errors import NHARetrofitError
from ..modeling.decoding import kv_cache_dtype

WARM_STEPS = 2  # untimed decode steps first: the eager step that CUDA graphs capture after, and a first replay
COMPILED_WARM_STEPS = 4  # torch.compile(mode="reduce-overhead") runs eagerly, then records its graph, then replays


def decode_room(decode_steps: int) -> int:
    """Positions a measured cache keeps beyond its context: the batch-1 steps, then as many on copied caches."""
    return 2 * (COMPILED_WARM_STEPS + decode_steps)


def check_options(positions: int, contexts, decode_steps: int = 16, rounds: int = 3, batch_sizes=(),
                  batch_contexts=None, kv_cache="auto", **_) -> None:
    """One error line for options that cannot be measured on a model of `positions` positions."""
    if not contexts or min(contexts) < 1:
        raise NHARetrofitError(f"context lengths must be >= 1, got {list(contexts)}")
    if decode_steps < 1 or rounds < 1:
        raise NHARetrofitError(f"decode steps and rounds must be >= 1, got {decode_steps} and {rounds}")
    room = decode_room(decode_steps)
    if max(contexts) + room > positions:
        raise NHARetrofitError(f"context {max(contexts)} + {room} decode positions exceeds the model's "
                               f"max_position_embeddings ({positions}); use contexts up to {positions - room}")
    if batch_sizes and min(batch_sizes) < 1:
        raise NHARetrofitError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    missing = [c for c in batch_contexts or () if c not in contexts]
    if batch_sizes and missing:
        raise NHARetrofitError(f"batch context {missing[0]} is not one of the contexts {sorted(contexts)}")
    kv_cache_dtype(kv_cache)
