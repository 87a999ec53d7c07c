"""Conversion of pretrained checkpoints into NHA hybrids."""

from .converter import convert
from .resolve import resolve_model

__all__ = ["convert", "resolve_model"]
