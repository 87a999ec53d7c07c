"""A decoder layer's one-token step with its small work fused: the RMSNorms, the residual adds and (dense families)
the gated MLP run as torch.compile'd functions around the layer's own attention (and MoE experts).

Between its matmuls, a layer's eager step runs a dozen elementwise kernels (an RMSNorm alone is five, each reading
the hidden state again); compiled, each group between two matmuls is one kernel. On Llama-3-8B's shape at batch 1
on an H100 this takes 0.90-0.94 ms from each decode step (`benchmarks/decode_fusion.py`). The functions take the weights
as arguments, so one compiled graph serves every layer. The decode CUDA graph (`decode_graph.py`) uses them: its
first, eager step compiles them, then the capture records their kernels. Prefill and training keep the layers' own
forwards.
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


@contextlib.contextmanager
def fused_decoder_layers(layers):
    """Inside: each of `layers` steps through `decoder_layer_step`, except a layer whose forward is already wrapped
    (accelerate's device-map hooks set it on the instance: they move the inputs to the layer's device)."""
    fused = [layer for layer in layers if "forward" not in vars(layer)]
    for layer in fused:
        layer.forward = functools.partial(decoder_layer_step, layer)
    try:
        yield
    finally:
        for layer in fused:
            del layer.forward
