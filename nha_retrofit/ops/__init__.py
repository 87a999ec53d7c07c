"""The operators of nha-retrofit, one folder each (`nha/`: Native Hybrid Attention; `stored_attention/`: a static
cache's one-token read of its full layers)."""

from .nha import KERNELS_AVAILABLE, NHAState, nha_attention, nha_chunked, nha_recurrent_step, nha_reference

__all__ = ["KERNELS_AVAILABLE", "NHAState", "nha_attention", "nha_chunked", "nha_recurrent_step", "nha_reference"]
