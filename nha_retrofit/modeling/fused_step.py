"""A decoder layer's one-token step with its small work fused: the RMSNorms, the residual adds, (dense families) the
gated MLP, and in the attention the q/k/v (and gate) projections with Qwen3's q/k norms and RoPE run as torch.compile'd
functions around the attention's own cache reads (and MoE experts).

Between its matmuls, a layer's eager step runs a dozen elementwise kernels (an RMSNorm alone is five, each reading
the hidden state again); compiled, each group between two matmuls is one kernel. On Llama-3-8B's shape at batch 1
on an H100, fusing the norms, adds, MLP and projections with RoPE saves 1.52 ms of each 9 ms decode step, and
computing q, k, v and the gate with one matmul, and the MLP's gate and up with another, saves 0.6 ms more
(`benchmarks/decode_fusion.py`): their weights become row blocks of one tensor (`merged_rows`). The functions take the
weights as arguments, so one compiled graph serves every layer. The decode CUDA graph (`decode_graph.py`) uses them:
its first, eager step compiles them, then the capture records their kernels. Prefill and training keep the layers'
own forwards.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F


def _rms_norm(hidden, weight, eps: float):
    """transformers' Llama / Qwen2 / Qwen3-MoE RMSNorm: normalised in fp32, cast back, then scaled."""
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(hidden.dtype)


def _rotate(x, cos, sin):
    """RoPE on [B, T, heads, D] with cos / sin [B, T, D]: x cos + (-x2, x1) sin, x1 and x2 the halves of D."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _projections(hidden, head_dim: int, weight, biases: tuple, sizes: tuple, q_norm, k_norm, eps: float, cos, sin):
    """(q, k, v, q_rope, k_rope, *rest) as `NHAAttentionMixin.projections` computes them, from one matmul with the
    row-merged weight of q, k, v (and the gate projection: `rest`), `sizes` its row blocks and `biases` theirs (None
    where none); q_norm and k_norm are the weights of Qwen3's per-head RMSNorms (None elsewhere)."""
    parts = [part if bias is None else part + bias
             for part, bias in zip(F.linear(hidden, weight).split(sizes, dim=-1), biases)]
    shape = (*hidden.shape[:-1], -1, head_dim)
    q, k, v = (part.view(shape) for part in parts[:3])
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    return q, k, v, _rotate(q, cos, sin), _rotate(k, cos, sin), *parts[3:]


def _add_rms_norm(residual, update, weight, eps: float):
    """(residual + update, its RMSNorm)."""
    hidden = residual + update
    return hidden, _rms_norm(hidden, weight, eps)


def _add_rms_norm_gated_mlp(residual, update, weight, eps: float, gate_up, down):
    """The second half of a dense layer: the residual add, the RMSNorm, the SiLU-gated MLP (its gate and up projections
    one matmul with their row-merged weight) and its residual add."""
    hidden, normed = _add_rms_norm(residual, update, weight, eps)
    gate, up = F.linear(normed, gate_up).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, down)


@functools.cache
def compiled(function):
    """`function` through torch.compile, made at its first use (importing this file compiles nothing)."""
    return torch.compile(function)


def _plain_linears_alike(linears) -> bool:
    """Whether `linears` are plain linear layers (not, say, peft's LoRA layers, whose adapters a merged weight would
    leave out) with weights of one dtype on one device, which can be merged without changing either."""
    return (all(type(linear) is torch.nn.Linear for linear in linears)
            and len({(linear.weight.dtype, linear.weight.device) for linear in linears}) == 1)


def is_gated_silu_mlp(mlp) -> bool:
    """Whether `mlp` is a dense down(silu(gate(x)) * up(x)) without biases (Llama's and Qwen2's MLP) whose gate and up
    projections can be merged."""
    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (_plain_linears_alike(projections) and all(p.bias is None for p in projections)
            and getattr(getattr(mlp, "config", None), "hidden_act", None) == "silu")


def _attention_linears(attention) -> list:
    """The projections a fused step computes with one matmul: q, k, v and the gate's (every layer has one: a full
    layer's is merged too, so that a plan's windows can change without merging again)."""
    return [attention.q_proj, attention.k_proj, attention.v_proj, attention.g_proj]


def _are_row_blocks(weights) -> bool:
    """Whether `weights` are contiguous views of one storage, each starting where the one before ends."""
    first, offset = weights[0], weights[0].storage_offset()
    for weight in weights:
        if (weight.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or not weight.is_contiguous()
                or weight.storage_offset() != offset or weight.dtype != first.dtype
                or weight.shape[1:] != first.shape[1:]):
            return False
        offset += weight.numel()
    return True


def merged_rows(linears, count: int | None = None):
    """One weight whose row blocks are the weights of `linears` (of the first `count`), so that one matmul computes
    their projections at once. The weights are made such views the first time (their concatenation, each weight
    re-pointed at its rows: the old storage is freed and no memory is added) and stay so: training, `load_state_dict`
    and transformers' `save_pretrained` (which writes disjoint views as separate tensors) see the same parameters,
    and a conversion that gives them new storage (`.to()`) is merged again at the next call."""
    weights = [linear.weight for linear in linears]
    if not _are_row_blocks(weights):
        merged = torch.cat([weight.detach() for weight in weights])
        start = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            linear.weight.data = merged[start:start + rows]
            start += rows
        weights = [linear.weight for linear in linears]
    first = weights[0].detach()
    rows = sum(weight.shape[0] for weight in weights[:count])
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def can_fuse(layer) -> bool:
    """Whether `layer` steps fused: its forward not wrapped (accelerate's device-map hooks set one on the instance:
    they move the inputs to the layer's device) and its attention's projections mergeable."""
    return "forward" not in vars(layer) and _plain_linears_alike(_attention_linears(layer.self_attn))


def merge_projections(layers):
    """Merge the row blocks of each fusable layer's attention projections and gated MLP (`merged_rows`) now: the
    decode graph calls it before its first step, so that no weight is re-pointed while a side stream reads it."""
    for layer in filter(can_fuse, layers):
        merged_rows(_attention_linears(layer.self_attn))
        if is_gated_silu_mlp(layer.mlp):
            merged_rows([layer.mlp.gate_proj, layer.mlp.up_proj])


def decoder_layer_step(layer, hidden_states, **kwargs):
    """`layer`'s forward (transformers' decoder layer: pre-norm attention, then pre-norm MLP, each with its residual)
    with the norms, adds and gated MLP compiled; `kwargs` go to the attention as the layer's own forward passes them."""
    norm, post_norm, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
    attended, _ = layer.self_attn(
        hidden_states=compiled(_rms_norm)(hidden_states, norm.weight, norm.variance_epsilon), **kwargs)
    if is_gated_silu_mlp(mlp):
        return compiled(_add_rms_norm_gated_mlp)(hidden_states, attended, post_norm.weight, post_norm.variance_epsilon,
                                                 merged_rows([mlp.gate_proj, mlp.up_proj]), mlp.down_proj.weight)
    hidden, normed = compiled(_add_rms_norm)(hidden_states, attended, post_norm.weight, post_norm.variance_epsilon)
    update = mlp(normed)
    return hidden + (update[0] if isinstance(update, tuple) else update)  # MoE blocks may return router logits too


def attention_projections(attention, hidden_states, position_embeddings):
    """`attention.projections` through the compiled `_projections`: q, k, v (and in an NHA layer the gate logits)
    from one matmul."""
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    every = _attention_linears(attention)
    linears = every[:3 if attention.window is None else 4]  # a full layer's gate is merged, not computed
    q, k, v, q_rope, k_rope, *gates = compiled(_projections)(
        hidden_states, attention.head_dim, merged_rows(every, len(linears)),
        tuple(linear.bias for linear in linears), tuple(linear.out_features for linear in linears),
        q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
        q_norm.variance_epsilon if q_norm is not None else 0.0, *position_embeddings)
    gates = gates[0].view(*hidden_states.shape[:-1], attention.num_kv_heads, attention.num_slots) if gates else None
    return q, k, v, q_rope, k_rope, gates


# the attention's small functions of tensors that a fused step runs compiled: the head split of layers with full KV
# heads (index gathers, each compiled into one kernel)
COMPILED_ATTENTION_FUNCTIONS = ("split_heads", "merge_heads")


@contextlib.contextmanager
def fused_decoder_layers(layers):
    """Inside: each of `layers` that `can_fuse` steps through `decoder_layer_step`, its attention's projections
    through `attention_projections` and its `COMPILED_ATTENTION_FUNCTIONS` compiled."""
    fused = list(filter(can_fuse, layers))
    merge_projections(fused)
    for layer in fused:
        layer.forward = functools.partial(decoder_layer_step, layer)
        attention = layer.self_attn
        attention.projections = functools.partial(attention_projections, attention)
        for name in COMPILED_ATTENTION_FUNCTIONS:
            setattr(attention, name, compiled(getattr(type(attention), name)))
    try:
        yield
    finally:
        for layer in fused:
            del layer.forward, layer.self_attn.projections
            for name in COMPILED_ATTENTION_FUNCTIONS:
                delattr(layer.self_attn, name)
