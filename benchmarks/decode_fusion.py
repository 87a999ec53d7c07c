"""What the fused decoder-layer step (`nha_retrofit/modeling/fused_step.py`) saves: NHA decode at Llama-3-8B's shape
(random bf16 weights, the default plan, batch 1) on the shipped CUDA-graph path, with the layers' norms, residual adds,
gated MLP and attention projections with RoPE fused and each layer's q/k/v/gate and gate/up projections one matmul
each (`fused`, as shipped), fused with one matmul per projection (`separate`), and unfused (the layers' own forwards
inside the same graph), in alternating rounds.

    python benchmarks/decode_fusion.py --output benchmarks/results/decode_fusion_h100.json     (CUDA; ~2 minutes)
    python benchmarks/decode_fusion.py --arms fused,separate --contexts 4096,32768 --output ...

Each context: one untimed round per arm (compile, capture, and the first step's logits of both arms compared), then
`--rounds` timed rounds of `--steps` steps after a fresh prefill, medians with min-max (`bench.timing.decode_arms`)."""

import argparse
import contextlib
import functools
import json
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from nha_retrofit.bench.decoders import NHA, StaticDecoder
from nha_retrofit.bench.random_weights import NAMED_CONFIGS, random_nha_model
from nha_retrofit.bench.timing import Clock, decode_arms
from nha_retrofit.modeling import fused_step, modeling_nha
from nha_retrofit.plan import PlanSpec, build_plan

ARMS = ("fused", "separate", "unfused")


def _rotary_qkv(hidden, head_dim: int, q_weight, q_bias, k_weight, k_bias, v_weight, v_bias, cos, sin):
    """q, k, v and their RoPE, each projection its own matmul (Llama's shape: no q/k norms)."""
    shape = (*hidden.shape[:-1], -1, head_dim)
    q = F.linear(hidden, q_weight, q_bias).view(shape)
    k = F.linear(hidden, k_weight, k_bias).view(shape)
    v = F.linear(hidden, v_weight, v_bias).view(shape)
    return q, k, v, fused_step._rotate(q, cos, sin), fused_step._rotate(k, cos, sin)


def _add_rms_norm_separate_mlp(residual, update, weight, eps: float, gate, up, down):
    """`fused_step._add_rms_norm_gated_mlp` with the gate and up projections two matmuls."""
    hidden, normed = fused_step._add_rms_norm(residual, update, weight, eps)
    return hidden + F.linear(F.silu(F.linear(normed, gate)) * F.linear(normed, up), down)


def separate_projections(attention, hidden_states, position_embeddings):
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    projected = fused_step.compiled(_rotary_qkv)(hidden_states, attention.head_dim, q.weight, q.bias, k.weight,
                                                 k.bias, v.weight, v.bias, *position_embeddings)
    return *projected, attention.gate_logits(hidden_states) if attention.window is not None else None


def separate_layer_step(layer, hidden_states, **kwargs):
    norm, post_norm, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
    attended, _ = layer.self_attn(
        hidden_states=fused_step.compiled(fused_step._rms_norm)(hidden_states, norm.weight, norm.variance_epsilon),
        **kwargs)
    return fused_step.compiled(_add_rms_norm_separate_mlp)(
        hidden_states, attended, post_norm.weight, post_norm.variance_epsilon, mlp.gate_proj.weight,
        mlp.up_proj.weight, mlp.down_proj.weight)


def arm(name: str):
    """The decode step as shipped (`fused`), fused with one matmul per projection (`separate`), or with the layers'
    own forwards inside the graph (`unfused`)."""
    if name == "fused":
        return contextlib.nullcontext()
    if name == "separate":
        return mock.patch.multiple(fused_step, attention_projections=separate_projections,
                                   decoder_layer_step=separate_layer_step)
    return mock.patch.object(modeling_nha, "fused_decoder_layers", contextlib.nullcontext)


def measure(decoder, length: int, arms: list, rounds: int, steps: int, clock) -> dict:
    record = decode_arms(decoder, length, {name: functools.partial(arm, name) for name in arms}, rounds, steps, clock)
    for name in arms[1:]:
        record[f"{name}_minus_{arms[0]}_ms"] = record[name]["median"] - record[arms[0]]["median"]
    print(json.dumps({key: value for key, value in record.items() if key not in ("rounds", "first_step_logits")}))
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4096,32768,131000")
    parser.add_argument("--arms", default="fused,unfused", help="comma-separated, the first the reference: "
                        + ", ".join(ARMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/decode_fusion.json"))
    args = parser.parse_args()
    arms = args.arms.split(",")
    if not set(arms) <= set(ARMS):
        raise SystemExit(f"--arms: of {', '.join(ARMS)}")
    if not torch.cuda.is_available():
        raise SystemExit("decode_fusion.py times the CUDA-graph decode path: it needs a CUDA GPU")
    config = NAMED_CONFIGS["llama3-8b"]
    plan = build_plan(config["num_hidden_layers"], PlanSpec(select="even"))
    model = random_nha_model(config, plan, "cuda", torch.bfloat16)
    decoder, clock = StaticDecoder(NHA, model), Clock(model.device)
    report = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "model": "llama3-8b random bf16",
              "plan": plan.describe(), "batch": 1, "steps": args.steps,
              "contexts": [measure(decoder, int(length), arms, args.rounds, args.steps, clock)
                           for length in args.contexts.split(",")]}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
