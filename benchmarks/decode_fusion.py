"""What the fused decoder-layer step (`nha_retrofit/modeling/fused_step.py`) saves: NHA decode at Llama-3-8B's shape
(random bf16 weights, the default plan, batch 1) on the shipped CUDA-graph path, with the layers' norms, residual adds,
gated MLP and attention projections with RoPE fused (as shipped), unfused (the layers' own forwards inside the same
graph), and `merged`: fused, with each layer's q/k/v (and an NHA layer's gate) projections one matmul and its MLP's gate
and up projections one matmul, their weights made row blocks of one tensor (no extra memory), in alternating rounds.

    python benchmarks/decode_fusion.py --output benchmarks/results/decode_fusion_h100.json     (CUDA; ~2 minutes)
    python benchmarks/decode_fusion.py --arms fused,merged --contexts 4096,32768 --output ...

Each context: one untimed round per arm (compile, capture, and the first step's logits of both arms compared), then
`--rounds` timed rounds of `--steps` steps after a fresh prefill, medians with min-max (`bench.timing.decode_arms`).
"""

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

ARMS = ("fused", "unfused", "merged")


def merge_rows(linears):
    """One weight tensor whose row blocks become the weights of `linears` (their old storage is freed): a matmul
    with it computes all of their projections at once. Biases are concatenated the same way (None if none has one)."""
    merged = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = merged[start:start + rows]
        start += rows
    biases = [linear.bias for linear in linears]
    if all(bias is None for bias in biases):
        return merged, None
    return merged, torch.cat([bias.detach() if bias is not None else merged.new_zeros(linear.weight.shape[0])
                              for bias, linear in zip(biases, linears)])


def _merged_rotary_qkvg(hidden, head_dim: int, weight, bias, sizes: tuple, cos, sin):
    """q, k, v (and an NHA layer's gate logits) from one matmul, then RoPE: (q, k, v, q_rope, k_rope, gate)."""
    parts = F.linear(hidden, weight, bias).split(sizes, dim=-1)
    shape = (*hidden.shape[:-1], -1, head_dim)
    q, k, v = (part.view(shape) for part in parts[:3])
    gate = parts[3] if len(parts) > 3 else None
    return q, k, v, fused_step._rotate(q, cos, sin), fused_step._rotate(k, cos, sin), gate


def _add_rms_norm_merged_mlp(residual, update, weight, eps: float, gate_up, down):
    """`fused_step._add_rms_norm_gated_mlp` with the gate and up projections one matmul."""
    hidden, normed = fused_step._add_rms_norm(residual, update, weight, eps)
    gate, up = F.linear(normed, gate_up).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, down)


@contextlib.contextmanager
def merged_projections(layers):
    """Inside: the fused step with merged projections (Llama's shape: no q/k norms)."""
    merged = {}
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        if attention.window is not None:
            projections.append(attention.g_proj)
        merged[attention] = (*merge_rows(projections), tuple(p.weight.shape[0] for p in projections))
        merged[mlp] = merge_rows([mlp.gate_proj, mlp.up_proj])[0]
    gates = {}

    def rotary_qkv(attention, hidden_states, position_embeddings):
        *qkv, gate = fused_step.compiled(_merged_rotary_qkvg)(hidden_states, attention.head_dim,
                                                              *merged[attention], *position_embeddings)
        if gate is not None:
            gates[attention] = gate
        return tuple(qkv)

    def gate_logits(attention, hidden_states):  # a prefill (the layers' own forwards) computes its own
        if attention not in gates:
            return type(attention).gate_logits(attention, hidden_states)
        return gates.pop(attention).view(*hidden_states.shape[:-1], attention.num_kv_heads, attention.num_slots)

    def layer_step(layer, hidden_states, **kwargs):
        norm, post_norm, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
        attended, _ = layer.self_attn(
            hidden_states=fused_step.compiled(fused_step._rms_norm)(hidden_states, norm.weight, norm.variance_epsilon),
            **kwargs)
        return fused_step.compiled(_add_rms_norm_merged_mlp)(
            hidden_states, attended, post_norm.weight, post_norm.variance_epsilon, merged[mlp], mlp.down_proj.weight)

    with (mock.patch.object(fused_step, "attention_rotary_qkv", rotary_qkv),
          mock.patch.object(fused_step, "decoder_layer_step", layer_step)):
        for layer in layers:
            layer.self_attn.gate_logits = functools.partial(gate_logits, layer.self_attn)
        try:
            yield
        finally:
            for layer in layers:
                del layer.self_attn.gate_logits


def arm(name: str, layers):
    """The decode step as shipped (`fused`), with the layers' own forwards inside the graph (`unfused`), or fused
    with merged projections (`merged`)."""
    if name == "fused":
        return contextlib.nullcontext()
    if name == "merged":
        return merged_projections(layers)
    return mock.patch.object(modeling_nha, "fused_decoder_layers", contextlib.nullcontext)


def measure(decoder, length: int, arms: list, rounds: int, steps: int, clock) -> dict:
    layers = decoder.model.model.layers
    record = decode_arms(decoder, length, {name: functools.partial(arm, name, layers) for name in arms}, rounds,
                         steps, clock)
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
