"""What the fused decoder-layer step (`nha_retrofit/modeling/fused_step.py`) saves: NHA decode at Llama-3-8B's shape
(random bf16 weights, the default plan, batch 1) on the shipped CUDA-graph path, with the layers' norms, residual adds,
gated MLP and attention projections with RoPE fused (as shipped) and unfused (the layers' own forwards inside the same
graph), in alternating rounds.

    python benchmarks/decode_fusion.py --output benchmarks/results/decode_fusion_h100.json     (CUDA; ~2 minutes)

Each context: one untimed round per arm (compile, capture, and the first step's logits of both arms compared), then
`--rounds` timed rounds of `--steps` steps after a fresh prefill, medians with min-max.
"""

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from nha_retrofit.bench.decoders import NHA, StaticDecoder
from nha_retrofit.bench.random_weights import NAMED_CONFIGS, random_nha_model
from nha_retrofit.bench.timing import Clock, decode_ms_per_step, free_memory
from nha_retrofit.modeling import modeling_nha
from nha_retrofit.modeling.decoding import one_token_step
from nha_retrofit.plan import PlanSpec, build_plan

ARMS = ("fused", "unfused")


def arm(name: str):
    """The decode step as shipped (`fused`), or with the layers' own forwards inside the graph (`unfused`)."""
    if name == "fused":
        return contextlib.nullcontext()
    return mock.patch.object(modeling_nha, "fused_decoder_layers", contextlib.nullcontext)


def measure(decoder, model, length: int, rounds: int, steps: int, clock) -> dict:
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=model.device)
    times, first = {name: [] for name in ARMS}, {}
    for round_index in range(rounds + 1):
        for name in ARMS if round_index % 2 else ARMS[::-1]:
            free_memory(model.device)
            with arm(name):
                cache, token = decoder.prefill(ids, 2 * steps)
                if round_index == 0:  # untimed: compiles and captures; the first step's logits of each arm
                    start = time.perf_counter()
                    positions = torch.full((1, 1), length, dtype=torch.long, device=model.device)
                    first[name] = one_token_step(model, token, positions, cache).logits.float()
                    print(f"{length}: {name} first step (compile, capture) {time.perf_counter() - start:.1f} s")
                else:
                    times[name].append(decode_ms_per_step(decoder.step, cache, token, length, steps, clock, 8))
            del cache
    record = {"context": length, "rounds": times}
    for name in ARMS:
        record[name] = {"median": statistics.median(times[name]), "min": min(times[name]), "max": max(times[name])}
    record["saved_ms"] = record["unfused"]["median"] - record["fused"]["median"]
    fused, unfused = first["fused"], first["unfused"]
    record["first_step_logits"] = {"max_abs_difference": (fused - unfused).abs().max().item(),
                                   "max_abs": unfused.abs().max().item(),
                                   "same_argmax": bool((fused.argmax(-1) == unfused.argmax(-1)).all())}
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
              "contexts": [measure(decoder, model, int(length), args.rounds, args.steps, clock)
                           for length in args.contexts.split(",")]}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
