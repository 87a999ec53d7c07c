"""Where a converted model's retrieval is lost, on the retrieval suite's tuning group (docs/benchmarks.md, quality
sweep). Two traces, both against the same suite cells:

    python benchmarks/retrieval_heads.py heads ORIGINAL_DIR CONVERTED_DIR --output benchmarks/results/retrieval_heads_smollm2.json
    python benchmarks/retrieval_heads.py layers TRAINED_DIR CONVERTED_DIR          (a GPU: ~3 minutes for SmolLM2)

`heads`: full attention per KV head instead of per layer, at the plan's number of full KV heads, on the converted
(untrained) model: its full layers made NHA layers (the plan's window) and the chosen KV heads full inside them
(`set_windows(windows, full_kv_heads)`). The heads are the ones the retrieval probe (`conversion/layer_ranking.py`)
ranks highest by their mean attention mass on the record: with number values, with word values (words of the
probe's own text), or both. ~40 minutes on a 2-core CPU for SmolLM2.

`layers`: on the converted model, each NHA layer made full in turn; on a trained model, each NHA layer's slot reads
switched off in turn.
"""

import argparse
import collections
import json
import re
from pathlib import Path

import torch

from nha_retrofit.conversion.layer_ranking import probe_prompts, probe_text, prompt_scores, rank_heads
from nha_retrofit.eval.retrieval_suite import build_suite, score_suite
from nha_retrofit.eval.variants import load_tokenizer
from nha_retrofit.modeling.load import nha_checkpoint_class

LENGTHS = (1024, 2048)
DEPTHS = (0, 50, 100)


def counts(hits: dict) -> dict:
    """{"task length": "hits/samples"} over depths."""
    cells = collections.defaultdict(list)
    for (_, _, task, length, _), hit in hits.items():
        cells[f"{task} {length}"].extend(hit)
    return {cell: f"{sum(hit)}/{len(hit)}" for cell, hit in sorted(cells.items())}


def score(model, suite, batch_size: int) -> dict:
    with torch.no_grad():
        return counts(score_suite({"nha": model}, suite, batch_size=batch_size))


def top_heads(scores, count: int) -> dict:
    """{layer: [KV heads]} of the `count` strongest heads of `scores` (per layer, per KV head)."""
    chosen = collections.defaultdict(list)
    for layer, head in rank_heads(scores)[:count]:
        chosen[layer].append(head)
    return dict(sorted(chosen.items()))


def trace_heads(args) -> dict:
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(args.converted)
    original = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager").eval()
    words = sorted(set(re.findall(r"\b[a-z]{5,9}\b", probe_text())))
    number_prompts, word_prompts = probe_prompts(tokenizer), probe_prompts(tokenizer, seed=1, words=words)
    rankings = {"number probe": prompt_scores(original, number_prompts).heads,
                "word probe": prompt_scores(original, word_prompts).heads,
                "both probes": prompt_scores(original, number_prompts + word_prompts).heads}
    del original

    model = nha_checkpoint_class(args.converted).from_pretrained(args.converted, dtype=torch.float32).eval()
    windows = list(model.config.nha_windows)
    full_layers = [layer for layer, window in enumerate(windows) if window is None]
    budget = len(full_layers) * model.config.num_key_value_heads
    nha_window = next(window for window in windows if window is not None)
    suite = build_suite(tokenizer, lengths=LENGTHS, samples=args.samples, depths=DEPTHS, group="tuning",
                        tasks=["niah_number", "passkey", "niah_word"])
    plans = {f"{len(full_layers)} whole layers {full_layers}": {layer: list(range(model.config.num_key_value_heads))
                                                                for layer in full_layers}}
    plans.update({f"top {budget} KV heads, {name}": top_heads(scores, budget) for name, scores in rankings.items()})
    result = {"full_kv_heads": budget, "plans": {}}
    for name, heads in plans.items():
        kv_heads = model.config.num_key_value_heads
        whole = [layer for layer, ids in heads.items() if len(ids) == kv_heads]  # every head full: a full layer
        model.set_windows([None if layer in whole else nha_window for layer in range(len(windows))],
                          [[] if layer in whole else heads.get(layer, []) for layer in range(len(windows))])
        result["plans"][name] = {"heads": heads, "hits": score(model, suite, args.batch_size)}
        print(name, json.dumps(result["plans"][name]), flush=True)
    return result


def trace_layers(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(args.model)
    load = lambda folder: nha_checkpoint_class(folder).from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    trained, converted = load(args.model), load(args.converted)
    suite = build_suite(tokenizer, lengths=LENGTHS, samples=args.samples, depths=DEPTHS, group="tuning",
                        tasks=["niah_word", "niah_number"])
    planned = list(converted.config.nha_windows)
    result = {"converted": score(converted, suite, args.batch_size), "converted, one more layer full": {},
              "trained": score(trained, suite, args.batch_size), "trained, one layer's slots off": {}}
    for layer, window in enumerate(planned):
        if window is None:
            continue
        converted.set_windows([None if i == layer else w for i, w in enumerate(planned)])
        result["converted, one more layer full"][layer] = score(converted, suite, args.batch_size)
        attention = trained.nha_attention_layers()[layer]
        attention.slot_reads = False
        result["trained, one layer's slots off"][layer] = score(trained, suite, args.batch_size)
        attention.slot_reads = True
        print(layer, result["converted, one more layer full"][layer], result["trained, one layer's slots off"][layer],
              flush=True)
    converted.set_windows(planned)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", choices=("heads", "layers"))
    parser.add_argument("model", help="heads: the original model's folder; layers: a trained NHA checkpoint")
    parser.add_argument("converted", help="the converted, untrained NHA checkpoint")
    parser.add_argument("--samples", type=int, default=10, help="per task, length and depth")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    result = {"trace": args.trace, "samples": args.samples, "lengths": LENGTHS, "depths": DEPTHS,
              **(trace_heads(args) if args.trace == "heads" else trace_layers(args))}
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
