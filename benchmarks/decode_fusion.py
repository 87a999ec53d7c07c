"""What the fused decoder-layer step (`nha_retrofit/modeling/fused_step.py`) saves: NHA decode at Llama-3-8B's shape
(random bf16 weights, the default plan, batch 1) on the shipped CUDA-graph path, with the layers' norms, residual adds,
gated MLP and attention projections with RoPE fused (as shipped) and unfused (the layers' own forwards inside the same
graph), in alternating rounds.

    python benchmarks/decode_fusion.py --output benchmarks/results/decode_fusion_h100.json     (CUDA; ~2 minutes)

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

from nha_retrofit.bench.decoders import NHA, StaticDecoder
from nha_retrofit.bench.random_weights import NAMED_CONFIGS, random_nha_model
from nha_retrofit.bench.timing import Clock, decode_arms
from nha_retrofit.modeling import modeling_nha
from nha_retrofit.plan import PlanSpec, build_plan

ARMS = ("fused", "unfused")


def arm(name: str):
    """The decode step as shipped (`fused`), or with the layers' own forwards inside the graph (`unfused`)."""
    if name == "fused":
        return contextlib.nullcontext()
    return mock.patch.object(modeling_nha, "fused_decoder_layers", contextlib.nullcontext)


def measure(decoder, length: int, rounds: int, steps: int, clock) -> dict:
    record = decode_arms(decoder, length, {name: functools.partial(arm, name) for name in ARMS}, rounds, steps,
                         clock)
    record["saved_ms"] = record["unfused"]["median"] - record["fused"]["median"]
    print(json.dumps({key: record[key] for key in ("context", *ARMS, "saved_ms")}))
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4096,32768,131000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/decode_fusion.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_fusion.py times the CUDA-graph decode path: it needs a CUDA GPU")
    config = NAMED_CONFIGS["llama3-8b"]
    plan = build_plan(config["num_hidden_layers"], PlanSpec(select="even"))
    model = random_nha_model(config, plan, "cuda", torch.bfloat16)
    decoder, clock = StaticDecoder(NHA, model), Clock(model.device)
    report = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "model": "llama3-8b random bf16",
              "plan": plan.describe(), "batch": 1, "steps": args.steps,
              "contexts": [measure(decoder, int(length), args.rounds, args.steps, clock)
                           for length in args.contexts.split(",")]}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
