"""The two training stages' losses, and the teacher: the same model with every window full (adapters off).

Stage 1, attention transfer: every NHA layer computes, in the same forward, the original full attention output of
its own projections (no grad) and the MSE to its NHA output (`NHAAttentionMixin.attention_transfer`). Each layer's
input is detached, so a layer's loss trains only that layer: the layers learn independently, as in LoLCATs.
Stage 2, language modelling: cross-entropy on the next token plus, optionally, KL(teacher || student) at a
temperature; no second copy of the weights is ever made.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .model import nha_modules


@contextlib.contextmanager
def teacher_mode(model):
    """Every window full and LoRA adapters disabled: exactly the original model (gates and slots unused)."""
    modules = nha_modules(model)
    windows = [m.window for m in modules]
    transfer = [m.attention_transfer for m in modules]
    disable = getattr(model, "disable_adapter", None)
    try:
        for m in modules:
            m.window, m.attention_transfer = None, False
        with disable() if disable is not None else contextlib.nullcontext():
            yield model
    finally:
        for m, window, flag in zip(modules, windows, transfer):
            m.window, m.attention_transfer = window, flag


def _detach_input(module, args, kwargs):
    if args:
        return (args[0].detach(), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": kwargs["hidden_states"].detach()}


@contextlib.contextmanager
def attention_transfer_mode(model):
    """Turn on every NHA layer's transfer loss, with its input detached (per-layer objectives)."""
    modules = [m for m in nha_modules(model) if m.window is not None]
    handles = [m.register_forward_pre_hook(_detach_input, with_kwargs=True) for m in modules]
    try:
        for m in modules:
            m.attention_transfer, m.transfer_loss = True, None
        yield modules
    finally:
        for handle in handles:
            handle.remove()
        for m in modules:
            m.attention_transfer, m.transfer_loss = False, None


def attention_transfer_loss(model, modules, input_ids) -> tuple[torch.Tensor, dict]:
    """Mean over NHA layers of the per-layer output MSE; the LM head runs on one position only. Call it (and the
    backward) inside `attention_transfer_mode`, so that gradient checkpointing recomputes the same graph."""
    for m in modules:
        m.transfer_loss = None
    model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    loss = torch.stack([m.transfer_loss for m in modules if m.transfer_loss is not None]).mean()
    for m in modules:
        m.transfer_loss = None
    return loss, {"transfer": loss.item()}


def distillation_kl(student_logits, teacher_logits, temperature: float) -> torch.Tensor:
    """KL(teacher || student) per token, averaged, scaled by T^2 (gradients comparable across temperatures)."""
    t = temperature
    student = F.log_softmax(student_logits.float() / t, dim=-1)
    teacher = F.log_softmax(teacher_logits.float() / t, dim=-1)
    kl = F.kl_div(student.flatten(0, -2), teacher.flatten(0, -2), log_target=True, reduction="batchmean")
    return kl * t * t


def lm_loss(model, unwrapped, input_ids, *, ce_weight=1.0, distill_weight=0.0, temperature=1.0):
    """ce_weight * CE + distill_weight * KL(teacher || student); returns (loss, metrics)."""
    teacher_logits = None
    if distill_weight > 0:
        with torch.no_grad(), teacher_mode(unwrapped):
            teacher_logits = unwrapped(input_ids=input_ids, use_cache=False).logits[:, :-1]
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1]
    ce = F.cross_entropy(logits.float().flatten(0, 1), input_ids[:, 1:].flatten())
    metrics = {"ce": ce.item()}
    loss = ce_weight * ce if ce_weight > 0 else ce.detach() * 0
    if teacher_logits is not None:
        kl = distillation_kl(logits, teacher_logits, temperature)
        metrics["kl"] = kl.item()
        loss = loss + distill_weight * kl
    return loss, metrics


@torch.no_grad()
def evaluate_blocks(model, blocks: torch.Tensor, batch_size: int, teacher: bool = False) -> dict:
    """Mean next-token cross-entropy over held-out blocks (and KL to the teacher unless `teacher`)."""
    was_training = model.training
    model.eval()
    device = next(p for p in model.parameters()).device
    ce_sum, kl_sum, count = 0.0, 0.0, 0
    try:
        for batch in blocks.split(batch_size):
            batch = batch.to(device)
            with teacher_mode(model) if teacher else contextlib.nullcontext():
                logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
            n = batch[:, 1:].numel()
            ce_sum += F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
            if not teacher:
                with teacher_mode(model):
                    reference = model(input_ids=batch, use_cache=False).logits[:, :-1]
                kl_sum += distillation_kl(logits, reference, 1.0).item() * n
            count += n
    finally:
        model.train(was_training)
    result = {"eval_ce": ce_sum / count}
    if not teacher:
        result["eval_kl"] = kl_sum / count
    return result
