"""The two training stages' losses, and the teacher: the original model, recovered from the same weights.

Stage 1, attention transfer: every NHA layer computes, in the same forward, the original full attention output of
its own (frozen) projections and the MSE to its NHA output (`NHAAttentionMixin.attention_transfer`). Only the gates
and slot offsets train; each layer's input is detached, so a layer's loss trains only that layer (as in LoLCATs).
Stage 2, language modelling: cross-entropy on the next token plus, optionally, KL(teacher || student) at a
temperature. The teacher is the same model with every window full, LoRA adapters disabled, and the original values
of any trained projection swapped in (a copy of those tensors only, none for LoRA or gates): a teacher that moved
with the student would let the two meet halfway, away from the original.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .model import nha_modules


GATE_PARAMETERS = ("g_proj.", "slot_bias")


def is_gate_parameter(name: str) -> bool:
    return any(part in name for part in GATE_PARAMETERS)


def snapshot_teacher(model) -> int:
    """Keep the original values of the trainable weights the teacher uses (q/k/v/o, and everything else under
    `full`), so that the teacher stays the original model while they train. LoRA adapters and gates need no copy:
    the teacher disables the former and never reads the latter. Returns the number of values kept."""
    originals = [
        (param, param.detach().clone())
        for name, param in model.named_parameters()
        if param.requires_grad and not is_gate_parameter(name) and "lora_" not in name
    ]
    model._nha_teacher_originals = originals
    return sum(t.numel() for _, t in originals)


@contextlib.contextmanager
def _fresh_autocast_casts():
    """Autocast caches the low-precision copies of fp32 weights until its outermost region ends, keyed by the
    parameter: across a swap of the weights' values the teacher would reuse the student's copies, or the student the
    teacher's. Nested regions cannot prevent it (accelerate's forward wrapper opens a caching region of its own), so
    the cache is emptied on entering and on leaving the teacher."""
    torch.clear_autocast_cache()
    try:
        yield
    finally:
        torch.clear_autocast_cache()


@contextlib.contextmanager
def teacher_mode(model):
    """The original model: every window full, LoRA adapters disabled, trained weights swapped for their original
    values (see `snapshot_teacher`); gates and slots are unused. Use under torch.no_grad()."""
    modules = nha_modules(model)
    windows = [m.window for m in modules]
    transfer = [m.attention_transfer for m in modules]
    originals = getattr(model, "_nha_teacher_originals", ())
    disable = getattr(model, "disable_adapter", None)
    swapped = []
    try:
        for m in modules:
            m.window, m.attention_transfer = None, False
        for param, saved in originals:
            swapped.append((param, param.data))
            param.data = saved
        with disable() if disable is not None else contextlib.nullcontext(), _fresh_autocast_casts():
            yield model
    finally:
        for param, trained in swapped:
            param.data = trained
        for m, window, flag in zip(modules, windows, transfer):
            m.window, m.attention_transfer = window, flag


def _detach_input(module, args, kwargs):
    if args:
        return (args[0].detach(), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": kwargs["hidden_states"].detach()}


@contextlib.contextmanager
def attention_transfer_mode(model):
    """Turn on every NHA layer's transfer loss, with its input detached (per-layer objectives), and freeze all but
    the gates and slot offsets: the target is the full attention of the layer's own projections, which must stay
    the original's (frozen) for the target to be the original layer's output."""
    modules = [m for m in nha_modules(model) if m.window is not None]
    handles = [m.register_forward_pre_hook(_detach_input, with_kwargs=True) for m in modules]
    frozen = [p for n, p in model.named_parameters() if p.requires_grad and not is_gate_parameter(n)]
    try:
        for p in frozen:
            p.requires_grad_(False)
        for m in modules:
            m.attention_transfer, m.transfer_loss = True, None
        yield modules
    finally:
        for p in frozen:
            p.requires_grad_(True)
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
def evaluate_blocks(model, blocks: torch.Tensor, batch_size: int, teacher: bool = False, kl: bool = True) -> dict:
    """Mean next-token cross-entropy over held-out blocks, of the model or (`teacher`) of the original; for the
    model also the KL from the original (`kl`)."""
    was_training = model.training
    model.eval()
    device = next(p for p in model.parameters()).device
    kl = kl and not teacher
    ce_sum, kl_sum, count = 0.0, 0.0, 0
    try:
        for batch in blocks.split(batch_size):
            batch = batch.to(device)
            with teacher_mode(model) if teacher else contextlib.nullcontext():
                logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
            n = batch[:, 1:].numel()
            ce_sum += F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
            if kl:
                with teacher_mode(model):
                    reference = model(input_ids=batch, use_cache=False).logits[:, :-1]
                kl_sum += distillation_kl(logits, reference, 1.0).item() * n
            count += n
    finally:
        model.train(was_training)
    result = {"eval_ce": ce_sum / count}
    if kl:
        result["eval_kl"] = kl_sum / count
    return result
