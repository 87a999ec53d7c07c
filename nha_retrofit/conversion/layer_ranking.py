"""Which layers and KV heads hold the original model's retrieval heads: the ranking behind `select="retrieval"`
and `full_kv_heads`.

A few attention heads do a model's long-range retrieval: asked for a fact stated far back, they put their attention
on it. A layer whose retrieval heads become a window and slots loses that fact, so those layers keep full attention.
The probe: `samples` prompts of `length` tokens of Python standard-library source (code the finetuning recipes train
on, never a held-out text of the evaluations), each with one record line (`registry entry KEY holds VALUE`) at a
random line start in its first half, and the record's first words again at the end. In the original model (its
attention weights as eager attention gives them), a KV head's score is the largest, over its query heads, of the
attention mass the positions that predict the value put on the record's tokens, averaged over the prompts; a layer's
is the largest over all of its heads, averaged the same way. Layers and heads rank by score.
On SmolLM2-135M the retrieval heads sit in layers 7, 14, 17, 18, 20, 21 and 23; the evenly spaced default of 4 of 30
(3, 10, 18, 25) kept one of them (docs/benchmarks.md#quality-sweep-benchmarksquality_sweeppy).
"""

from __future__ import annotations

import glob
import random
import sysconfig
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import NHARetrofitError
from ..plan import evenly_spaced

PROBE_MODULES = ("argparse.py", "email/message.py", "email/_header_value_parser.py", "logging/__init__.py")
# Per-prompt scores vary: on SmolLM2-135M the fifth and sixth layers (7 and 17) differ by 0.047 on average with a
# standard deviation of 0.077 over prompts, so 4 prompts rank them by chance (and CPU and GPU rounding can flip them),
# while from 8 prompts on the order holds (16: 0.783 against 0.744; 32: 0.793 against 0.746; `retrieval_scores` with
# `samples` 4 to 32 on the embedded model in float32 on a CPU).
PROBE_SAMPLES = 16
PROBE_LENGTH = 1024


class ProbeError(NHARetrofitError):
    """The model's tokenizer cannot build the probe's prompts (too few tokens, or too few positions), or its layers
    do not run the probe's attention function."""


def probe_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [path.read_text(encoding="utf-8", errors="replace")
             for name in PROBE_MODULES for path in map(Path, glob.glob(str(stdlib / name))) if path.is_file()]
    if not texts:
        raise NHARetrofitError(f"the retrieval probe found none of {', '.join(PROBE_MODULES)} in {stdlib}")
    return "\n".join(texts)


def probe_prompts(tokenizer, samples: int = PROBE_SAMPLES, length: int = PROBE_LENGTH, seed: int = 0, words=None):
    """[(token ids, record span, answer positions)]: each prompt is exactly `length` tokens. The records' values are
    6-digit numbers, or one of `words` each when given."""
    ids = tokenizer(probe_text(), add_special_tokens=False, verbose=False)["input_ids"]
    rng = random.Random(seed)
    prompts = []
    for _ in range(samples):
        key = f"{rng.choice(('ORCA', 'LYNX', 'KITE', 'MOTH', 'WREN'))}{rng.randrange(10, 99)}"
        value = rng.choice(words) if words else str(rng.randrange(100000, 999999))
        record = tokenizer(f"\n# registry entry {key} holds {value}\n", add_special_tokens=False)["input_ids"]
        question = tokenizer(f"\n# registry entry {key} holds", add_special_tokens=False)["input_ids"]
        answer = tokenizer(f" {value}", add_special_tokens=False)["input_ids"]
        room = length - len(record) - len(question) - len(answer)
        if room < 16 or room >= len(ids):
            raise ProbeError(f"the retrieval probe cannot make prompts of {length} tokens with this tokenizer")
        start = rng.randrange(len(ids) - room)
        haystack = ids[start : start + room]
        place = rng.randrange(room // 2)
        prompt = haystack[:place] + record + haystack[place:] + question + answer
        first_answer = length - len(answer) - 1  # the position that predicts the answer's first token
        prompts.append((prompt, range(place, place + len(record)), range(first_answer, length - 1)))
    return prompts


class ProbeScores(NamedTuple):
    """The probe's scores, averaged over its prompts: per layer, the strongest head's mass on the record in each
    prompt; per layer and KV head, its strongest query head's."""

    layers: list[float]
    heads: list[list[float]]


PROBE_ATTENTION = "nha_retrofit_probe"


def answer_row_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, probe_rows=None,
                         probe_weights=None, **kwargs):
    """The probe's attention function: SDPA's output, and the attention weights eager attention would give, for the
    rows `probe_rows` alone (appended to `probe_weights` as [batch, heads, rows, keys]). Eager attention builds every
    row of every layer's weights, which made the probe twice as slow on a CPU. Unpadded causal prompts only."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    output = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                    **kwargs)
    rows = torch.as_tensor(probe_rows, device=query.device)
    keys = key.float().repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # query head h reads KV head h // g
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    logits = query[:, :, rows].float() @ keys.transpose(-1, -2) * scale
    future = torch.arange(key.shape[2], device=query.device) > rows[:, None]
    probe_weights.append(logits.masked_fill(future, float("-inf")).softmax(-1))
    return output


@torch.no_grad()
def prompt_scores(model, prompts, progress: bool = False) -> ProbeScores:
    """The `ProbeScores` of the original `model` on `prompts` (`probe_prompts`), with its weights as eager attention
    gives them (`answer_row_attention`)."""
    from tqdm.auto import tqdm
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE_ATTENTION, answer_row_attention)
    device = next(model.parameters()).device
    groups = model.config.num_attention_heads // (model.config.num_key_value_heads or model.config.num_attention_heads)
    heads = layers = None
    implementation = model.config._attn_implementation
    model.set_attn_implementation(PROBE_ATTENTION)
    try:
        for prompt, record, answer in tqdm(prompts, desc="retrieval probe", unit="prompt", disable=not progress,
                                           leave=False):
            attentions = []
            model(torch.tensor([prompt], device=device), use_cache=False, logits_to_keep=1,
                  probe_rows=list(answer), probe_weights=attentions)
            if len(attentions) != model.config.num_hidden_layers:  # a model that takes no attention function
                raise ProbeError(f"the retrieval probe read the attention of {len(attentions)} of "
                                 f"{model.config.num_hidden_layers} layers")
            per_head = torch.stack([weights[0][:, :, record].sum(-1).mean(-1).view(-1, groups).amax(-1)
                                    for weights in attentions])  # [layers, KV heads]
            heads = per_head if heads is None else heads + per_head
            layers = per_head.amax(-1) if layers is None else layers + per_head.amax(-1)
    finally:
        model.set_attn_implementation(implementation)
    return ProbeScores((layers / len(prompts)).tolist(), (heads / len(prompts)).tolist())


def probe_scores(model, tokenizer, samples: int = PROBE_SAMPLES, length: int = PROBE_LENGTH,
                 progress: bool = False) -> ProbeScores:
    """The retrieval probe's `ProbeScores` of the original `model`."""
    return prompt_scores(model, probe_prompts(tokenizer, samples, length), progress)


def rank_layers(scores: list[float]) -> list[int]:
    """Layer ids, the strongest retrieval layer first (ties: the lower id first)."""
    return sorted(range(len(scores)), key=lambda layer: (-scores[layer], layer))


def rank_heads(head_scores: list[list[float]]) -> list[tuple[int, int]]:
    """(layer, KV head) pairs, the strongest retrieval head first (ties: the lower layer, then head, first)."""
    pairs = [(layer, head) for layer, row in enumerate(head_scores) for head in range(len(row))]
    return sorted(pairs, key=lambda pair: (-head_scores[pair[0]][pair[1]], pair))


def probe_folder(folder: Path, device: str = "auto", log=print, progress: bool = True) -> ProbeScores | None:
    """The probe's scores of the original model in `folder` (loaded once, in its dtype, on CUDA when present), with a
    progress bar; None when the folder has no weights, or no tokenizer that can build the probe's prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          "cpu" if device == "auto" else device)
    log(f"ranking layers by retrieval: {PROBE_SAMPLES} probes on {target.type}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        return None
    try:
        model = AutoModelForCausalLM.from_pretrained(folder).to(target).eval()
    except OSError:  # no weights (a config-only folder, as for a dry run of a recipe's plan)
        return None
    try:
        return probe_scores(model, tokenizer, length=min(PROBE_LENGTH, model.config.max_position_embeddings),
                            progress=progress)
    except ProbeError:
        return None


class Ranking(NamedTuple):
    """What `build_plan` takes from the probe: layer ids and (layer, KV head) pairs, strongest first (heads: None
    when the probe could not run), and the scores behind them (None: not probed)."""

    layers: list[int] | None
    heads: list[tuple[int, int]] | None
    scores: ProbeScores | None


def plan_ranking(folder: Path, spec, num_layers: int, device: str = "auto", log=print) -> Ranking:
    """The `Ranking` that `build_plan` takes for `spec` on the model in `folder` (all None when its full layers and
    heads do not depend on the weights). A folder without weights, or without a tokenizer that can build the probe,
    cannot be probed: its full layers are then placed evenly, and a log line says so."""
    if not spec.needs_ranking:
        return Ranking(None, None, None)
    scores = probe_folder(folder, device, log=log)
    if scores is None:
        even = evenly_spaced(num_layers, min(spec.full_layer_count(num_layers), num_layers))
        log("no weights, or no tokenizer that can build the retrieval probe: the full layers are placed evenly "
            "(--select even)")
        return Ranking(even + [layer for layer in range(num_layers) if layer not in even], None, None)
    return Ranking(rank_layers(scores.layers), rank_heads(scores.heads), scores)
