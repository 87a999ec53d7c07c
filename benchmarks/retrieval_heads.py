"""Where a converted model's retrieval is lost, on the retrieval suite's tuning group (docs/benchmarks.md, quality
sweep). Two traces, both against the same suite cells:

    python benchmarks/retrieval_heads.py heads ORIGINAL_DIR CONVERTED_DIR --output benchmarks/results/retrieval_heads_smollm2.json
    python benchmarks/retrieval_heads.py layers TRAINED_DIR CONVERTED_DIR          (a GPU: ~3 minutes for SmolLM2)

`heads`: full attention per KV head instead of per layer, at the plan's number of full KV heads, simulated on the
converted (untrained) model: every layer runs its NHA operator (window as planned for the NHA layers) and full causal
attention, and the query heads of the chosen KV heads take the full output before `o_proj`. The heads are the ones
the retrieval probe (`conversion/layer_ranking.py`) ranks highest by their mean attention mass on the record: with
number values, with word values (words of the probe's own text), or both. ~40 minutes on a 2-core CPU for SmolLM2.

`layers`: on the converted model, each NHA layer made full in turn; on a trained model, each NHA layer's slot reads
switched off in turn.
"""

import argparse
import collections
import json
import re
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from nha_retrofit.conversion.layer_ranking import probe_prompts, probe_text
from nha_retrofit.eval.retrieval_suite import build_suite, score_suite
from nha_retrofit.eval.variants import load_tokenizer
from nha_retrofit.modeling.load import nha_checkpoint_class
from nha_retrofit.modeling.modeling_nha import operator_inputs
from nha_retrofit.ops.nha.dispatch import nha_operator

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


def head_scores(original, prompts) -> torch.Tensor:
    """[layers, KV heads]: each KV head's strongest query head's attention mass on the record, averaged over
    `prompts` (the original run with eager attention)."""
    config = original.config
    groups = config.num_attention_heads // config.num_key_value_heads
    total = torch.zeros(config.num_hidden_layers, config.num_key_value_heads)
    with torch.no_grad():
        for prompt, record, answer in prompts:
            out = original(torch.tensor([prompt]), output_attentions=True, use_cache=False, logits_to_keep=1)
            for layer, weights in enumerate(out.attentions):
                mass = weights[0][:, answer][:, :, record].sum(-1).mean(-1).float()  # [query heads]
                total[layer] += mass.view(-1, groups).max(-1).values
    return total / len(prompts)


def top_heads(scores: torch.Tensor, count: int) -> dict:
    """{layer: [KV heads]} of the `count` highest scores."""
    ranked = sorted(((scores[l, h].item(), l, h) for l in range(scores.shape[0]) for h in range(scores.shape[1])),
                    reverse=True)
    chosen = collections.defaultdict(list)
    for _, layer, head in ranked[:count]:
        chosen[layer].append(head)
    return dict(sorted(chosen.items()))


def head_mixed_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    """An NHA layer (any window) whose `full_kv_heads` read with full causal attention instead (no cache, no
    padding: the suite's samples are all of one length)."""
    batch, length = hidden_states.shape[:2]
    q, k, v, q_rope, k_rope = operator_inputs(*self.rotary_qkv(hidden_states, position_embeddings))
    out, _ = nha_operator(q, k, v, q_rope, k_rope, self.gate_logits(hidden_states), self.gate_normalizer,
                          self.nha_window, self.scaling, None, self.slot_bias, None, False)
    if self.full_kv_heads:
        groups = q.shape[2] // k.shape[2]
        full = F.scaled_dot_product_attention(
            q_rope.transpose(1, 2), k_rope.repeat_interleave(groups, 2).transpose(1, 2),
            v.repeat_interleave(groups, 2).transpose(1, 2), is_causal=True, scale=self.scaling).transpose(1, 2)
        out = out.clone()
        for head in self.full_kv_heads:
            out[:, :, head * groups : (head + 1) * groups] = full[:, :, head * groups : (head + 1) * groups]
    return self.o_proj(out.reshape(batch, length, -1)), None


def trace_heads(args) -> dict:
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(args.converted)
    original = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager").eval()
    words = sorted(set(re.findall(r"\b[a-z]{5,9}\b", probe_text())))
    number_prompts, word_prompts = probe_prompts(tokenizer), probe_prompts(tokenizer, seed=1, words=words)
    rankings = {"number probe": head_scores(original, number_prompts), "word probe": head_scores(original, word_prompts)}
    rankings["both probes"] = head_scores(original, number_prompts + word_prompts)
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
        for layer, attention in enumerate(model.nha_attention_layers()):
            attention.nha_window = windows[layer] if windows[layer] is not None else nha_window
            attention.full_kv_heads = heads.get(layer, [])
            attention.forward = types.MethodType(head_mixed_forward, attention)
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
