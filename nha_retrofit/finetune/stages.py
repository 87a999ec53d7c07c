"""The two training stages' losses, and the teacher: the original model, recovered from the same weights.

Stage 1, attention transfer: every NHA layer computes, in the same forward, the original full attention output of
its own (frozen) projections and the MSE to its NHA output (`NHAAttentionMixin.attention_transfer`). Only the gates
and slot offsets train; each layer's input is detached, so a layer's loss trains only that layer (as in LoLCATs).
Stage 2, language modelling: cross-entropy on the next token plus, optionally, KL(teacher || student) at a
temperature, both computed at the head a chunk of tokens at a time (`head_losses.py`). The teacher is the same model
with every window full, LoRA adapters disabled, and the original values of any trained projection swapped in (a copy
of those tensors only, none for LoRA or gates): a teacher that moved with the student would let the two meet halfway,
away from the original.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .head_losses import chunked_head_losses, head_output
from .model import nha_modules


GATE_PARAMETERS = ("g_proj.", "slot_bias")


def is_gate_parameter(name: str) -> bool:
    return any(part in name for part in GATE_PARAMETERS)


def _is_sharded(tensor) -> bool:
    return hasattr(tensor, "to_local")  # a DTensor: an FSDP2 shard


def snapshot_teacher(model, dtype: torch.dtype | None = None) -> int:
    """Keep the original values of the trainable weights the teacher uses (q/k/v/o, and everything else under
    `full`), so that the teacher stays the original model while they train. LoRA adapters and gates need no copy:
    the teacher disables the former and never reads the latter. A copy is kept in `dtype` (the compute dtype) when
    that loses nothing, as for weights read from a bf16 checkpoint; an FSDP2 shard keeps its own dtype and is
    1/processes of the tensor. Returns the number of values kept."""
    originals = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.requires_grad or is_gate_parameter(name) or "lora_" in name:
                continue
            saved = None
            if dtype is not None and not _is_sharded(param) and param.dtype != dtype:
                low = param.detach().to(dtype)
                saved = low if torch.equal(low.to(param.dtype), param.detach()) else None
            originals.append((param, param.detach().clone() if saved is None else saved))
    model._nha_teacher_originals = originals
    return sum(t.numel() for _, t in originals)


def _exchange_shard_values(param, other) -> None:
    here, there = param.to_local(), other.to_local()
    held = here.clone()
    here.copy_(there)
    there.copy_(held)


@contextlib.contextmanager
def _originals_swapped(originals):
    """Each trained weight holds its original value until the block ends, its trained value kept aside. A plain
    tensor swaps storage (no copy; a low-precision original is upcast only outside autocast); an FSDP2 shard
    exchanges values in place, because FSDP gathers a layer's weights from the shard's own storage, not from
    `param.data`."""
    done = []
    try:
        with torch.no_grad():
            for param, saved in originals:
                if _is_sharded(param):
                    _exchange_shard_values(param, saved)
                    done.append((param, saved))
                else:
                    done.append((param, param.data))
                    low = saved.dtype != param.dtype and not torch.is_autocast_enabled(param.device.type)
                    param.data = saved.to(param.dtype) if low else saved  # autocast takes either dtype
        yield
    finally:
        with torch.no_grad():
            for param, other in done:
                if _is_sharded(param):
                    _exchange_shard_values(param, other)
                else:
                    param.data = other


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
    disable = getattr(model, "disable_adapter", None)
    try:
        for m in modules:
            m.window, m.attention_transfer = None, False
        with _originals_swapped(getattr(model, "_nha_teacher_originals", ())), \
                disable() if disable is not None else contextlib.nullcontext(), _fresh_autocast_casts():
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


@contextlib.contextmanager
def long_position_transfer(model):
    """For the LM stage's `transfer_weight`: every NHA layer also scores its output against the full attention of its
    own projections, at the positions beyond its window (where the window no longer holds the prefix and the slots
    must stand in for it); nothing is frozen or detached. Call the loss and its backward inside, so that gradient
    checkpointing recomputes the same graph."""
    modules = [m for m in nha_modules(model) if m.window is not None]
    try:
        for m in modules:
            m.attention_transfer, m.transfer_from, m.transfer_loss = True, m.window, None
        yield modules
    finally:
        for m in modules:
            m.attention_transfer, m.transfer_from, m.transfer_loss = False, 0, None


def attention_transfer_loss(model, modules, input_ids, through_outputs: bool = False) -> tuple[torch.Tensor, dict]:
    """Mean over NHA layers of the per-layer output MSE; the LM head runs on one position only. Call it (and the
    backward) inside `attention_transfer_mode`, so that gradient checkpointing recomputes the same graph.

    `through_outputs` (FSDP): FSDP gathers a layer's weights for the backward, and reduces its gradients, from hooks
    on the layer's outputs and inputs, which the per-layer losses bypass; a zero-weighted term on the model's output
    sends a (zero) gradient through every layer's output, so those hooks run, and changes no gradient."""
    for m in modules:
        m.transfer_loss = None
    logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits
    loss = torch.stack([m.transfer_loss for m in modules if m.transfer_loss is not None]).mean()
    for m in modules:
        m.transfer_loss = None
    metrics = {"transfer": loss.item()}
    if through_outputs:
        loss = loss + logits.float().sum() * 0.0
    return loss, metrics


@torch.no_grad()
def teacher_states(model, input_ids) -> tuple[torch.Tensor, bool]:
    """What the student's head losses need of the teacher (the original model) on `input_ids`: its final hidden
    states, which the shared frozen head turns into logits a chunk at a time; or, when the head itself trains, its
    logits (in the compute dtype). Returns (tensor, is_hidden). `model` is the unwrapped model."""
    kept = {}

    def keep(head, hidden):
        kept["hidden"] = not head.weight.requires_grad
        kept["states"] = hidden if kept["hidden"] else F.linear(hidden, head.weight, head.bias)
        return hidden.new_zeros(())

    with teacher_mode(model), head_output(model, keep):
        model(input_ids=input_ids, use_cache=False)
    return kept["states"], kept["hidden"]


def head_losses(model, unwrapped, input_ids, teacher=None, temperature: float = 1.0) -> torch.Tensor:
    """[mean next-token cross-entropy, mean KL(teacher || student) x T^2 (0 without `teacher`)] of the model on
    `input_ids`, returned by the forward of `model` (the wrapped model when training); `teacher` is what
    `teacher_states` returns."""
    states, is_hidden = teacher if teacher is not None else (None, True)

    def losses(head, hidden):
        return torch.stack(chunked_head_losses(
            hidden[:, :-1], head.weight, input_ids[:, 1:], None if states is None else states[:, :-1], bias=head.bias,
            teacher_is_hidden=is_hidden, temperature=temperature,
        ))

    with head_output(unwrapped, losses):
        return model(input_ids=input_ids, use_cache=False).logits


def lm_loss(model, unwrapped, input_ids, *, ce_weight=1.0, distill_weight=0.0, temperature=1.0,
            transfer_weight=0.0, transfer_modules=()):
    """ce_weight * CE + distill_weight * KL(teacher || student) + transfer_weight * the mean over
    `transfer_modules` (those `long_position_transfer` yields) of their output MSE beyond the window; returns
    (loss, metrics)."""
    teacher = teacher_states(unwrapped, input_ids) if distill_weight > 0 else None
    for m in transfer_modules:  # a checkpointed backward's recompute sets them again after the last step's loss
        m.transfer_loss = None
    ce, kl = head_losses(model, unwrapped, input_ids, teacher, temperature)
    metrics = {"ce": ce.item()}
    loss = ce_weight * ce if ce_weight > 0 else ce.detach() * 0
    if teacher is not None:
        metrics["kl"] = kl.item()
        loss = loss + distill_weight * kl
    transfers = [m.transfer_loss for m in transfer_modules if m.transfer_loss is not None]
    if transfer_weight > 0 and transfers:
        transfer = torch.stack(transfers).mean()
        metrics["transfer"] = transfer.item()
        loss = loss + transfer_weight * transfer
    return loss, metrics


@torch.no_grad()
def evaluate_blocks(model, blocks: torch.Tensor, batch_size: int, teacher: bool = False, kl: bool = True,
                    progress: bool = False) -> dict:
    """Mean next-token cross-entropy over held-out blocks, of the model or (`teacher`) of the original; for the
    model also the KL from the original (`kl`). `progress`: a bar per batch."""
    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    device = next(p for p in model.parameters()).device
    kl = kl and not teacher
    ce_sum, kl_sum, count = 0.0, 0.0, 0
    try:
        name = "held-out blocks, original" if teacher else "held-out blocks"
        for batch in tqdm(blocks.split(batch_size), desc=name, unit="batch", disable=not progress, leave=False):
            batch = batch.to(device)
            reference = teacher_states(model, batch) if kl else None
            with teacher_mode(model) if teacher else contextlib.nullcontext():
                ce, divergence = head_losses(model, model, batch, reference)
            n = batch[:, 1:].numel()
            ce_sum += ce.item() * n
            kl_sum += divergence.item() * n
            count += n
    finally:
        model.train(was_training)
    result = {"eval_ce": ce_sum / count}
    if kl:
        result["eval_kl"] = kl_sum / count
    return result
