"""The inputs of a chunked NHA call as the Triton kernels take them."""

import copy
import os

import torch

from ...utils.launch import cdiv, constant
from ...utils.products import dot_precision
from .settings import chunk_tokens, settings_for


class Prepared:
    """Contiguous inputs and the per-sequence scalars every kernel needs, the launch settings of their device, and the
    slot-state chunking (`cs` tokens per chunk, `nch` chunks), which a backward takes from its forward."""

    TENSORS = ("q", "k", "v", "q_rope", "k_rope", "log_alpha", "mask", "first", "bias")

    def __init__(self, q, k, v, q_rope, k_rope, log_alpha, window, attention_mask, slot_bias, training=False):
        self.B, self.T, self.HQ, self.D = q.shape
        self.H, self.M, self.DV = k.shape[2], log_alpha.shape[-1], v.shape[-1]
        self.G = self.HQ // self.H
        self.q, self.k, self.v = q.contiguous(), k.contiguous(), v.contiguous()
        self.q_rope, self.k_rope = q_rope.contiguous(), k_rope.contiguous()
        self.log_alpha = log_alpha.contiguous()
        self.W = self.T if window is None else int(window)
        device = q.device
        if attention_mask is None:  # every token real: no mask to load, the first real token is 0 (cached fill)
            self.mask = None
            self.first = constant((self.B,), 0, torch.int32, device)
        else:
            self.mask = attention_mask[:, -self.T:].to(torch.int32).contiguous()
            has_real = self.mask.bool().any(1)
            first = self.mask.to(torch.int8).argmax(1).to(torch.int32)
            self.first = torch.where(has_real, first, torch.full_like(first, 2**30)).contiguous()
        # in its own dtype (the kernels read it as fp32): a model's bf16 parameter costs no cast here nor its backward
        self.bias = constant((self.HQ,), 0.0, torch.float32, device) if slot_bias is None else slot_bias.contiguous()
        self.prec = dot_precision(q.dtype)
        self.training = training  # whether a backward can run
        self.settings = settings_for(device)
        self.cs = chunk_tokens(self.G, training, self.settings)
        self.nch = cdiv(self.T, self.cs)

    @property
    def has_slots(self):
        """Whether any query reads the slots (a window shorter than the sequence)."""
        return self.W < self.T

    @property
    def prefetchable(self):
        """Whether the kernels can issue L2 prefetches for these inputs: not under Triton's interpreter (it has no
        inline PTX), and only where a key and a value row are powers of two of whole 128-byte lines."""
        return os.environ.get("TRITON_INTERPRET") != "1" and all(d >= 64 and not d & (d - 1) for d in (self.D, self.DV))

    def tensors(self):
        """The tensors it holds, in TENSORS order (for `ctx.save_for_backward`)."""
        return tuple(getattr(self, name) for name in self.TENSORS)

    def with_tensors(self, tensors):
        """A copy holding `tensors` (TENSORS order; None to keep none, e.g. on an autograd ctx)."""
        other = copy.copy(self)
        for name, tensor in zip(self.TENSORS, tensors, strict=True):
            setattr(other, name, tensor)
        return other


def batch_strides(p, do):
    """The batch strides the kernels take: q (and q_rope), k (k_rope), v, the gates, o / dO."""
    return p.q.stride(0), p.k.stride(0), p.v.stride(0), p.log_alpha.stride(0), do.stride(0)
