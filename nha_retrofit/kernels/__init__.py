"""Triton kernels for the NHA operator (DESIGN.md section 2) on CUDA.

- `nha_attention(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask=None, slot_bias=None) -> o`:
  same function as `nha_reference`, differentiable in q, k, v, q_rope, k_rope, log_alpha, slot_bias.
- `nha_chunked_triton(..., initial_state=None, output_final_state=False) -> (o, NHAState | None)`:
  same contract as `nha_chunked` (prefill with cache; a carried initial state is inference only).
- `nha_recurrent_step_triton(...)`: same contract as `nha_recurrent_step` (decode step, state updated in place).
- `KERNELS_AVAILABLE`: Triton importable and a CUDA device present.

Shapes the kernels take: head dims and slot count powers of two (16..256), query heads a multiple of kv
heads, float32/bfloat16/float16 inputs. Anything else (or CPU tensors) falls back to the PyTorch forms. A call whose
q-sized tensors reach 2^31 elements runs in batch slices (`autograd.batch_slices`: the kernels' offsets are int32).
"""

import torch

from ..modeling.nha_chunked import nha_chunked
from ..modeling.nha_recurrent import nha_recurrent_step

try:  # pragma: no cover - depends on the machine
    import triton  # noqa: F401

    _TRITON = True
except Exception:  # pragma: no cover
    _TRITON = False

KERNELS_AVAILABLE = bool(_TRITON and torch.cuda.is_available())


def _pow2(x, lo=16, hi=256):
    return lo <= x <= hi and (x & (x - 1)) == 0


def supported(q, k, v, log_alpha) -> bool:
    """Whether the Triton kernels handle these tensors (else the PyTorch forms are used)."""
    if not (_TRITON and q.is_cuda):
        return False
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return (
        _pow2(q.shape[-1]) and _pow2(v.shape[-1]) and _pow2(log_alpha.shape[-1], 16, 128)
        and q.shape[2] % k.shape[2] == 0
    )


if _TRITON:
    from .autograd import nha_attention as _nha_attention
    from .autograd import nha_chunked_triton as _nha_chunked_triton
    from .decode import nha_recurrent_step_triton as _nha_recurrent_step_triton


def nha_attention(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask=None, slot_bias=None):
    """Same contract as `nha_reference` (see DESIGN.md section 2)."""
    if supported(q, k, v, log_alpha):
        return _nha_attention(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask, slot_bias)
    out, _ = nha_chunked(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask, slot_bias)
    return out


def nha_chunked_triton(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask=None, slot_bias=None,
                       initial_state=None, output_final_state=False):
    """Same contract as `nha_chunked`: (o, final NHAState or None)."""
    if supported(q, k, v, log_alpha):
        return _nha_chunked_triton(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask, slot_bias,
                                   initial_state, output_final_state)
    return nha_chunked(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask, slot_bias,
                       initial_state=initial_state, output_final_state=output_final_state)


def nha_recurrent_step_triton(
    q, k, v, q_rope, k_rope, log_alpha, window, scale, state=None, attention_mask=None, slot_bias=None,
    gate_normalizer=None,
):
    """Same contract as `nha_recurrent_step` (with `gate_normalizer`, `log_alpha` holds the gate logits and the
    kernel applies the gate): (o [B, 1, HQ, Dv], the state, updated in place for a finite window; window None, which
    grows the state, runs in PyTorch)."""
    if window is not None and supported(q, k, v, log_alpha):
        return _nha_recurrent_step_triton(q, k, v, q_rope, k_rope, log_alpha, window, scale, state,
                                          attention_mask, slot_bias, gate_normalizer)
    return nha_recurrent_step(q, k, v, q_rope, k_rope, log_alpha, window, scale, state, attention_mask, slot_bias,
                              gate_normalizer)


__all__ = ["KERNELS_AVAILABLE", "nha_attention", "nha_chunked_triton", "nha_recurrent_step_triton", "supported"]
