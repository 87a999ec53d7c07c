"""One query token per sequence against a static cache's stored keys and values (full layers and full KV heads),
kept in the model's dtype or in float8 with one scale per position and head.

- `naive.py`: `naive_stored_attention`, the dense definition (tests, reading);
- `split_kv.py`: `split_kv_stored_attention`, the Triton read, split over the cache like flash-decoding, which
  reads float8 bytes where they lie instead of a model-dtype copy.
"""

from .naive import naive_stored_attention
from .split_kv import split_kv_stored_attention

__all__ = ["naive_stored_attention", "split_kv_stored_attention"]
