"""Cross-entropy and distillation KL at the output head, a chunk of tokens at a time.

At a 128K vocabulary one [tokens x vocab] fp32 tensor of a 4 x 2048-token batch is 4.2 GB, and cross-entropy plus
a KL to the teacher hold several such tensors. Instead, the head's input (the final hidden states, [tokens x hidden])
is taken from inside the model's forward (`head_output`), and the logits are formed CHUNK_ELEMENTS at a time: the
chunk's cross-entropy and KL(teacher || student), then the next chunk. In the backward each chunk's logits are
recomputed (activation checkpointing), so at most one chunk's logits are alive at any time. The teacher's logits
come chunk by chunk from its own final hidden states and the same, frozen, head weight; only a trained head
(`trainable: full`) makes the teacher hand over its logits whole, in the compute dtype.

The loss is returned as the model's output, so wrappers that act on the forward's outputs (DDP, FSDP2's
pre-backward hooks, DeepSpeed) see it as they would see logits.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 2**27  # logits per chunk: 1,046 tokens at Llama-3's 128,256 words, 512 MB in fp32


def chunk_tokens(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


@contextlib.contextmanager
def head_output(model, consume):
    """While active, the model's output head receives no token and returns `consume(head, hidden_states)` instead of
    logits: the forward's `.logits` is whatever `consume` returns (computed while the head's weight is gathered under
    FSDP or ZeRO-3). `model` is the unwrapped model."""
    head = model.get_output_embeddings()
    captured = []

    def take_input(module, args):
        captured.append(args[0])
        return (args[0][..., :0, :],)

    def give_output(module, args, output):
        return consume(module, captured.pop())

    handles = [head.register_forward_pre_hook(take_input),
               head.register_forward_hook(give_output, prepend=True)]  # before ZeRO-3 releases the weight
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _chunk_sums(hidden, weight, bias, targets, teacher, teacher_is_hidden: bool, temperature: float):
    """[cross-entropy summed over the chunk's tokens, KL(teacher || student) at `temperature` summed likewise]."""
    logits = F.linear(hidden, weight, bias).float()
    ce = F.cross_entropy(logits, targets, reduction="sum")
    if teacher is None:
        return torch.stack([ce, ce.new_zeros(())])
    teacher_logits = F.linear(teacher, weight, bias) if teacher_is_hidden else teacher
    student = F.log_softmax(logits / temperature, dim=-1)
    reference = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = F.kl_div(student, reference, log_target=True, reduction="sum")
    return torch.stack([ce, kl])


def chunked_head_losses(hidden, weight, targets, teacher=None, *, bias=None, teacher_is_hidden=True,
                        temperature=1.0, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy and mean KL(teacher || student) x T^2 over the tokens of `hidden` [..., H],
    whose logits are `hidden @ weight.T + bias`; `targets` [...] are the next tokens; `teacher` is the teacher's final
    hidden states (`teacher_is_hidden`) or its logits, or None (the KL is then 0)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if teacher is not None:
        teacher = teacher.reshape(-1, teacher.shape[-1])
    chunk = chunk or chunk_tokens(weight.shape[0])
    total = None
    for start in range(0, hidden.shape[0], chunk):
        part = slice(start, start + chunk)
        reference = None if teacher is None else teacher[part]
        args = (hidden[part], weight, bias, targets[part], reference, teacher_is_hidden, temperature)
        sums = checkpoint(_chunk_sums, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk_sums(*args)
        total = sums if total is None else total + sums
    ce, kl = total / hidden.shape[0]
    return ce, kl * temperature * temperature
