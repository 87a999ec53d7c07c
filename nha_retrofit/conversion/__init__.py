"""Conversion of pretrained checkpoints into NHA hybrids: model resolution (`resolve`), the source config
(`source`), the shard-wise checkpoint rewrite (`shards`) and the converter itself (`converter`).

`nha_retrofit.convert` is `converter.convert`, exposed lazily by the package.
"""

from .converter import convert
from .resolve import resolve_model

__all__ = ["convert", "resolve_model"]
