"""A decoder layer's one-token step with its small work fused: the RMSNorms, the residual adds, (dense families) the
gated MLP, and in the attention the q/k/v projections with Qwen3's q/k norms and RoPE run as torch.compile'd functions
around the attention's own cache reads (and MoE experts).

Between its matmuls, a layer's eager step runs a dozen elementwise kernels (an RMSNorm alone is five, each reading
the hidden state again); compiled, each group between two matmuls is one kernel. On Llama-3-8B's shape at batch 1
on an H100, fusing the norms, adds, MLP and projections with RoPE saves 1.52 ms of each 9 ms decode step
(`benchmarks/decode_fusion.py`). The functions take the weights as arguments, so one compiled graph serves every
layer. The decode CUDA graph (`decode_graph.py`) uses them: its first, eager step compiles them, then the capture
records their kernels. Prefill and training keep the layers' own forwards.
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


def _rotary_qkv(hidden, head_dim: int, q_weight, q_bias, k_weight, k_bias, v_weight, v_bias, q_norm, k_norm,
                eps: float, cos, sin):
    """An attention's (q, k, v, q_rope, k_rope) as `NHAAttentionMixin.rotary_qkv` computes them; q_norm and k_norm
    are the weights of Qwen3's per-head RMSNorms (None elsewhere)."""
    shape = (*hidden.shape[:-1], -1, head_dim)
    q = F.linear(hidden, q_weight, q_bias).view(shape)
    k = F.linear(hidden, k_weight, k_bias).view(shape)
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    v = F.linear(hidden, v_weight, v_bias).view(shape)
    return q, k, v, _rotate(q, cos, sin), _rotate(k, cos, sin)


def _add_rms_norm(residual, update, weight, eps: float):
    """(residual + update, its RMSNorm)."""
    hidden = residual + update
    return hidden, _rms_norm(hidden, weight, eps)


def _add_rms_norm_gated_mlp(residual, update, weight, eps: float, gate, up, down):
    """The second half of a dense layer: the residual add, the RMSNorm, the SiLU-gated MLP and its residual add."""
    hidden, normed = _add_rms_norm(residual, update, weight, eps)
    return hidden + F.linear(F.silu(F.linear(normed, gate)) * F.linear(normed, up), down)


@functools.cache
def compiled(function):
    """`function` through torch.compile, made at its first use (importing this file compiles nothing)."""
    return torch.compile(function)


def is_gated_silu_mlp(mlp) -> bool:
    """Whether `mlp` is a dense down(silu(gate(x)) * up(x)) without biases (Llama's and Qwen2's MLP)."""
    projections = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (all(isinstance(p, torch.nn.Linear) and p.bias is None for p in projections)
            and getattr(getattr(mlp, "config", None), "hidden_act", None) == "silu")


def decoder_layer_step(layer, hidden_states, **kwargs):
    """`layer`'s forward (transformers' decoder layer: pre-norm attention, then pre-norm MLP, each with its residual)
    with the norms, adds and gated MLP compiled; `kwargs` go to the attention as the layer's own forward passes them."""
    norm, post_norm, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
    attended, _ = layer.self_attn(
        hidden_states=compiled(_rms_norm)(hidden_states, norm.weight, norm.variance_epsilon), **kwargs)
    if is_gated_silu_mlp(mlp):
        return compiled(_add_rms_norm_gated_mlp)(hidden_states, attended, post_norm.weight, post_norm.variance_epsilon,
                                                 mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    hidden, normed = compiled(_add_rms_norm)(hidden_states, attended, post_norm.weight, post_norm.variance_epsilon)
    update = mlp(normed)
    return hidden + (update[0] if isinstance(update, tuple) else update)  # MoE blocks may return router logits too


def attention_rotary_qkv(attention, hidden_states, position_embeddings):
    """`attention.rotary_qkv` through the compiled `_rotary_qkv`."""
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return compiled(_rotary_qkv)(
        hidden_states, attention.head_dim, attention.q_proj.weight, attention.q_proj.bias, attention.k_proj.weight,
        attention.k_proj.bias, attention.v_proj.weight, attention.v_proj.bias,
        q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
        q_norm.variance_epsilon if q_norm is not None else 0.0, *position_embeddings)


# the attention's small functions of tensors that a fused step runs compiled: the head split of layers with full KV
# heads (index gathers, each compiled into one kernel)
COMPILED_ATTENTION_FUNCTIONS = ("split_heads", "merge_heads")


@contextlib.contextmanager
def fused_decoder_layers(layers):
    """Inside: each of `layers` steps through `decoder_layer_step`, its attention's projections through
    `attention_rotary_qkv` and its `COMPILED_ATTENTION_FUNCTIONS` compiled, except a layer whose forward is already
    wrapped (accelerate's device-map hooks set it on the instance: they move the inputs to the layer's device)."""
    fused = [layer for layer in layers if "forward" not in vars(layer)]
    for layer in fused:
        layer.forward = functools.partial(decoder_layer_step, layer)
        attention = layer.self_attn
        attention.rotary_qkv = functools.partial(attention_rotary_qkv, attention)
        for name in COMPILED_ATTENTION_FUNCTIONS:
            setattr(attention, name, compiled(getattr(type(attention), name)))
    try:
        yield
    finally:
        for layer in fused:
            del layer.forward, layer.self_attn.rotary_qkv
            for name in COMPILED_ATTENTION_FUNCTIONS:
                delattr(layer.self_attn, name)
