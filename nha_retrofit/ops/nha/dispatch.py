"""The one place that chooses between the Triton kernels and the plain-PyTorch forms of the NHA operator (and of
a static cache's float8 read).

This file is also copied into converted checkpoints (remote code): there it imports only torch and its sibling
files, and it uses nha_retrofit's kernels only where nha_retrofit is installed.
"""

import os

import torch

from .chunk_torch import nha_chunked
from .gates import gate_log_alpha
from .recurrent_torch import nha_recurrent_step

try:  # the Triton kernels (absolute import: this file runs as a checkpoint's remote code too)
    import triton  # noqa: F401

    from nha_retrofit.ops.nha.chunk import nha_attention_triton, nha_chunked_triton
    from nha_retrofit.ops.nha.decode_op import nha_decode_step
    from nha_retrofit.ops.stored_attention import split_kv_stored_attention
except ImportError:
    triton = None

KERNELS_AVAILABLE = triton is not None and torch.cuda.is_available()


def kernel_scope() -> str:
    """Where the Triton kernels run on CUDA, from NHA_RETROFIT_KERNELS: `all` (the default: prefill, training and
    the one-token decode step), `decode` (the decode step only) or `0` (none: plain PyTorch everywhere)."""
    value = os.environ.get("NHA_RETROFIT_KERNELS", "all")
    scope = {"1": "all", "none": "0", "": "all"}.get(value.strip().lower(), value.strip().lower())
    if scope not in ("decode", "all", "0"):
        raise ValueError(f"NHA_RETROFIT_KERNELS={value!r}: expected decode, all or 0")
    return scope


def shapes_supported(q, k, v, log_alpha, q_rope=None, k_rope=None) -> bool:
    """Whether the Triton kernels take tensors of these shapes and dtypes (those their GPU tests cover): one dtype of
    fp32, bf16 or fp16 for q, k, v and the rotated q, k; head dims 64 or 128 with values as wide as keys, 16 to 128
    slots (a power of two), query heads a multiple of kv heads. Anything else runs the PyTorch forms."""
    return (
        q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and all(t.dtype == q.dtype for t in (k, v, q_rope, k_rope) if t is not None)
        and q.shape[-1] in (64, 128) and k.shape[-1] == v.shape[-1] == q.shape[-1]
        and log_alpha.shape[-1] in (16, 32, 64, 128) and q.shape[2] % k.shape[2] == 0
    )


def _use_kernels(q, k, v, q_rope, k_rope, log_alpha, scopes):
    return (KERNELS_AVAILABLE and q.is_cuda and kernel_scope() in scopes
            and shapes_supported(q, k, v, log_alpha, q_rope, k_rope))


def nha_attention(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask=None, slot_bias=None):
    """NHA over whole sequences (same contract as `nha_reference`), differentiable: the Triton kernels where they
    apply, else the chunked PyTorch form."""
    if _use_kernels(q, k, v, q_rope, k_rope, log_alpha, ("all",)):
        return nha_attention_triton(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask, slot_bias)
    out, _ = nha_chunked(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask, slot_bias)
    return out


def nha_operator(q, k, v, q_rope, k_rope, gate_logits, gate_normalizer, window, scale, attention_mask, slot_bias,
                 state, output_state):
    """An NHA layer's operator call: (o, the new state or None). One-token steps with a carried state take the
    recurrent form (the Triton step applies the gate to the logits itself), anything else the chunked form."""
    if state is not None and q.shape[1] == 1:
        triton_step = window is not None and _use_kernels(q, k, v, q_rope, k_rope, gate_logits, ("all", "decode"))
        step = nha_decode_step if triton_step else nha_recurrent_step
        return step(q, k, v, q_rope, k_rope, gate_logits, window, scale, state=state, attention_mask=attention_mask,
                    slot_bias=slot_bias, gate_normalizer=gate_normalizer)
    log_alpha = gate_log_alpha(gate_logits, gate_normalizer)
    chunked = nha_chunked_triton if _use_kernels(q, k, v, q_rope, k_rope, log_alpha, ("all",)) else nha_chunked
    return chunked(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask=attention_mask,
                   slot_bias=slot_bias, initial_state=state, output_final_state=output_state)


def float8_stored_attention(query, keys, values, real, scale, key_scales, value_scales):
    """A static cache's one-token read of float8 keys and values through the Triton split-KV kernel, which reads
    the float8 bytes where they lie: [B, 1, HQ, Dv]; None where it does not apply (off CUDA, the kernels disabled,
    head dims that are not powers of two from 16), and the caller dequantizes."""
    dims = (keys.shape[-1], values.shape[-1])
    if not (KERNELS_AVAILABLE and query.is_cuda and kernel_scope() in ("all", "decode")
            and all(d >= 16 and not d & (d - 1) for d in dims)):
        return None
    return split_kv_stored_attention(query, keys, values, real, scale, key_scales, value_scales)
