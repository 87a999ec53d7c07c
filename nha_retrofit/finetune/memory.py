"""Projected GPU memory per process of a finetuning run, from the model's config and the recipe, before any weight
is read (`--dry-run`). An estimate of what PyTorch allocates (torch.cuda.max_memory_allocated), not of the CUDA
context or the allocator's cache; the benchmarks write the measured peak beside it.

Terms, in bytes per process:
- weights: frozen matrices in the compute dtype when the checkpoint holds them in it, everything else (trainable
  weights, norms, embeddings) in fp32; under FSDP split across processes, plus two decoder layers gathered in the
  compute dtype; under ZeRO-3 everything in the compute dtype split across processes, with the trainable ones' fp32
  master copy;
- gradients (fp32, of the trainable ones; split under FSDP / ZeRO-3; twice under DDP, whose buckets copy them);
- optimizer states (AdamW: two fp32 values per trainable parameter; SGD: one), split under FSDP / ZeRO-3;
- the teacher's copy of the trained projections' original values (distillation with `attention` or `full`);
- activations of one micro-step: with gradient checkpointing each decoder layer keeps its input and one layer's
  internals live in the backward; without, every layer keeps its internals;
- head losses: the teacher's final hidden states, and one chunk of logits with its softmax terms and gradient.
"""

from __future__ import annotations

from .head_losses import chunk_tokens

GIB = 2**30


def _layer_activation_bytes(config, compute_bytes: int) -> int:
    """Bytes a decoder layer saves for the backward, per token: norms (fp32 inside), q/k/v before and after RoPE, the
    attention output, the NHA gate logits, and the MLP's inputs and products (the routed experts' for an MoE)."""
    h = config.hidden_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    experts = getattr(config, "num_experts_per_tok", None)
    mlp = config.moe_intermediate_size * experts if experts else config.intermediate_size
    router = getattr(config, "num_experts", 0) * 4
    gates = kv_heads * getattr(config, "nha_num_slots", 0)
    return compute_bytes * (7 * h + 2 * q + 3 * kv + gates + 4 * mlp) + 16 * h + router


def project_memory(config, recipe, trainable: int, total: int, *, processes: int = 1, sharding: str = "none",
                   teacher_values: int = 0, low_precision_values: int = 0, teacher_bytes: int = 4) -> dict:
    """GiB per process for `recipe` on a model of `config` with `trainable` of `total` parameters; `sharding` is
    "none" (one process or DDP), "fsdp" or "zero3"; `low_precision_values` of them are kept in the compute dtype;
    the teacher keeps `teacher_values` originals of `teacher_bytes` bytes."""
    t, d = recipe.train, recipe.data
    compute = 4 if t.precision == "fp32" else 2  # `auto` is bf16 on a GPU
    weight_bytes = compute * low_precision_values + 4 * (total - low_precision_values)
    split = processes if sharding in ("fsdp", "zero3") else 1
    layers = config.num_hidden_layers
    if sharding == "fsdp":
        weights = weight_bytes / split + 2 * compute * total / layers
    elif sharding == "zero3":
        weights = compute * total / split + 4 * trainable / split + 2 * compute * total / layers
    else:
        weights = weight_bytes
    gradients = 4 * trainable / split * (2 if processes > 1 and sharding == "none" else 1)
    optimizer = (8 if t.optimizer == "adamw" else 4) * trainable / split
    teacher = (4 / split if sharding == "fsdp" else teacher_bytes) * teacher_values
    tokens = t.batch_size * d.seq_len
    per_layer = _layer_activation_bytes(config, compute)
    if t.gradient_checkpointing:
        activations = tokens * (layers * config.hidden_size * compute + per_layer)
    else:
        activations = tokens * layers * per_layer
    vocab = config.vocab_size
    distilling = recipe.stages.lm.tokens > 0 and recipe.stages.lm.distill_weight > 0
    head = tokens * config.hidden_size * compute * (2 if distilling else 1)
    head += min(tokens, chunk_tokens(vocab)) * vocab * (compute + 4 * (5 if distilling else 3))
    parts = {"weights": weights, "gradients": gradients, "optimizer": optimizer, "teacher_originals": teacher,
             "activations": activations, "head_losses": head}
    result = {name: round(value / GIB, 2) for name, value in parts.items()}
    result["total"] = round(sum(parts.values()) / GIB, 2)
    result.update(processes=processes, sharding=sharding)
    return result
