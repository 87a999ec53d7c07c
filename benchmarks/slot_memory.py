"""How long the slots of converted checkpoints remember (not a test): for every NHA layer, each slot's timescale
1 / mean(-log alpha) over a held-out text, the tokens after which an absorbed token keeps weight 1/e, summarised as
the median, 90th percentile and largest over the layer's slots. A slot whose timescale is shorter than the window
only repeats what the window already holds (docs/design.md, gate bias).

    python benchmarks/slot_memory.py DIR [DIR ...] [--text python-docs] [--tokens 2048]

The committed result reads SmolLM2-135M converted with the default plan's pinned layers and each gate bias B:
    nha-retrofit convert smollm2-135m -o smollm2_gate_bias_B --full-layer-ids 7,14,18,20,21 [--gate-bias-init B]

Runs on the CPU in float32; prints one table per checkpoint and writes benchmarks/results/slot_memory.json
({checkpoint folder name: {gate_bias_init, full_layer_ids, window, layers: [{layer, median, p90, max}]}}).
"""

import argparse
import json
from pathlib import Path

import torch

from nha_retrofit.eval.texts import load_heldout_tokens
from nha_retrofit.eval.variants import load_tokenizer
from nha_retrofit.modeling.load import load_for_inference
from nha_retrofit.ops.nha.gates import gate_log_alpha

ROOT = Path(__file__).resolve().parent.parent


@torch.no_grad()
def slot_timescales(model, input_ids: torch.Tensor) -> dict:
    """{layer index: [timescale of every slot of every KV head]} of the NHA layers, over one forward of
    `input_ids` (padding-free)."""
    nha = {i: attention for i, attention in enumerate(model.nha_attention_layers()) if attention.window is not None}
    logits = {}
    hooks = [attention.g_proj.register_forward_hook(
                 lambda module, inputs, output, i=i: logits.__setitem__(i, output))
             for i, attention in nha.items()]
    try:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    timescales = {}
    for i, attention in nha.items():
        gates = logits[i].unflatten(-1, (attention.num_kv_heads, attention.num_slots))  # as `gate_logits` shapes them
        log_alpha = gate_log_alpha(gates, attention.gate_normalizer).double()
        timescales[i] = (1 / -log_alpha.mean(dim=(0, 1))).flatten().tolist()
    return timescales


def summary(timescales: list) -> dict:
    values = torch.tensor(timescales, dtype=torch.float64)
    return {"median": values.median().item(), "p90": values.quantile(0.9).item(), "max": values.max().item()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--text", default="python-docs", help="the held-out text read")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "slot_memory.json")
    args = parser.parse_args(argv)
    results = {}
    for folder in args.checkpoints:
        model = load_for_inference(folder, device="cpu", dtype="float32")
        ids = load_heldout_tokens(load_tokenizer(folder), args.text, args.tokens)
        layers = [{"layer": i, **summary(t)} for i, t in slot_timescales(model, ids).items()]
        windows = sorted({w for w in model.config.nha_windows if w is not None})
        full = [i for i, w in enumerate(model.config.nha_windows) if w is None]
        results[folder.name] = {"gate_bias_init": model.config.nha_gate_bias_init, "full_layer_ids": full,
                                "window": windows,
                                "text": args.text, "tokens": ids.shape[1], "layers": layers}
        print(f"\n{folder} (gate bias {model.config.nha_gate_bias_init}, window {windows}): slot timescale in tokens")
        print("| layer | median | 90th percentile | largest |\n|---|---|---|---|")
        for row in layers:
            print(f"| {row['layer']} | {row['median']:.1f} | {row['p90']:.1f} | {row['max']:.0f} |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
