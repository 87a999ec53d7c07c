"""Which layers should keep full attention: each layer's sensitivity to becoming NHA, measured on held-out text.

One NHA model with every layer converted is built in memory, its gates initialised as `convert` writes them. Then,
for every layer alone, that layer gets its window and every other layer stays full (architecture duality: a full
layer runs the original attention), and the next-token distributions are compared with the original's (every
window full) as the mean KL divergence per token. The layers whose conversion costs the most keep full attention.
The chosen plan and the evenly spaced default are then scored whole, so the pick is checked, not assumed. Sensitivity is measured before finetuning; it ranks how much each layer relies on tokens beyond its
window that the untrained slots do not yet carry. The plans are scored on other text (`check_texts`) than the layers
were ranked on, so the comparison is not flattered by the choice.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from ..conversion.converter import build_nha_model
from ..conversion.layer_ranking import probe_folder, rank_layers
from ..conversion.resolve import resolve_model
from ..conversion.source import read_source_config_dict
from ..errors import NHARetrofitError
from ..modeling.load import resolve_device
from ..plan import PlanSpec, build_plan, select_full_layers
from .texts import HELDOUT_TEXTS, load_heldout_tokens


def heldout_chunks(tokenizer, texts, max_tokens: int, chunk_len: int) -> torch.Tensor:
    """[N, chunk_len]: the first `max_tokens` tokens of each text, cut into whole chunks."""
    if chunk_len < 2:
        raise NHARetrofitError(f"--chunk-len {chunk_len}: at least 2 tokens")
    chunks = []
    for name in texts:
        ids = load_heldout_tokens(tokenizer, name, max_tokens)[0]
        chunks.append(ids[: ids.numel() // chunk_len * chunk_len].view(-1, chunk_len))
    chunks = torch.cat(chunks)
    if chunks.shape[0] == 0:
        raise NHARetrofitError(f"--max-tokens {max_tokens} gives no whole chunk of {chunk_len} tokens")
    return chunks


class Scorer:
    """Sums, over chunks, the KL divergence from the original's next-token distribution and the cross-entropy of
    the text, for named window settings of one model."""

    def __init__(self, model):
        self.model = model
        self.full = [None] * model.config.num_hidden_layers
        self.kl, self.nll, self.tokens = {}, {}, 0

    def log_probs(self, windows, ids):
        self.model.set_windows(windows)
        return F.log_softmax(self.model(input_ids=ids, use_cache=False).logits.float(), dim=-1)

    def add_chunk(self, ids, candidates: dict):
        reference = self.log_probs(self.full, ids)
        self._add("original", reference, reference, ids)
        for name, windows in candidates.items():
            self._add(name, self.log_probs(windows, ids), reference, ids)
        self.tokens += ids.numel()
        self.model.set_windows(self.full)

    def _add(self, name, log_probs, reference, ids):
        kl = (reference.exp() * (reference - log_probs)).sum()
        nll = -log_probs[:, :-1].gather(-1, ids[:, 1:, None]).sum()
        self.kl[name] = self.kl.get(name, 0.0) + kl.item()
        self.nll[name] = self.nll.get(name, 0.0) + nll.item()

    def mean_kl(self, name) -> float:
        return self.kl[name] / self.tokens

    def perplexity(self, name, predicted_tokens) -> float:
        return math.exp(self.nll[name] / predicted_tokens)


@torch.no_grad()
def search_full_layers(model: str, spec: PlanSpec = PlanSpec(), *, texts=("python-stdlib",),
                       check_texts=("python-docs",), max_tokens: int = 2048, chunk_len: int = 512, device: str = "auto",
                       revision: str | None = None, token: str | None = None, progress: bool = False) -> dict:
    """Rank layers by the KL divergence their conversion alone causes; keep the `spec.full_layer_count` highest full
    (the other fields of `spec` set the NHA layers). Returns per-layer scores, the chosen ids, and the chosen and
    evenly spaced plans scored whole. A Hub id missing from the Hugging Face cache is downloaded at `revision`, with
    `token`."""
    if spec.full_layer_ids is not None or spec.windows is not None:
        raise NHARetrofitError("the search chooses the full layers: give it their count, not their ids or windows")
    if spec.full_kv_heads:
        raise NHARetrofitError("the search chooses whole full layers; full KV heads are placed by the retrieval probe "
                               "(convert --full-kv-heads)")
    source = resolve_model(model, revision=revision, token=token)
    num_layers = read_source_config_dict(source)["num_hidden_layers"]
    build_plan(num_layers, spec, ranking=list(range(num_layers)))  # the plan's errors before any weight is read
    full_layers, window = spec.full_layer_count(num_layers), spec.window
    settings = dict(window=window, slots=spec.slots, gate_normalizer=spec.gate_normalizer,
                    slot_bias_init=spec.slot_bias_init, gate_bias_init=spec.gate_bias_init)
    unknown = [t for t in (*texts, *check_texts) if t not in HELDOUT_TEXTS]
    if unknown:
        raise NHARetrofitError(f"unknown text {unknown[0]!r}; available: {', '.join(HELDOUT_TEXTS)}")
    tokenizer = AutoTokenizer.from_pretrained(source)
    chunks = heldout_chunks(tokenizer, texts, max_tokens, chunk_len)
    check_chunks = heldout_chunks(tokenizer, check_texts, max_tokens, chunk_len)
    target = resolve_device(device)
    nha = build_nha_model(source, build_plan(num_layers, dataclasses.replace(spec, full_layers=0)))
    nha = nha.to(target).float() if target.type == "cpu" else nha.to(target)  # CPU bf16 matmuls are slow
    single = {i: [window if j == i else None for j in range(num_layers)] for i in range(num_layers)}

    from tqdm.auto import tqdm

    scorer = Scorer(nha)
    for ids in tqdm(chunks, desc="layers", unit="chunk", disable=not progress):
        scorer.add_chunk(ids[None].to(target), {f"layer {i}": windows for i, windows in single.items()})
    scores = [scorer.mean_kl(f"layer {i}") for i in range(num_layers)]
    chosen = sorted(sorted(range(num_layers), key=scores.__getitem__, reverse=True)[:full_layers])
    even = select_full_layers(num_layers, full_layers, "even")
    probed = probe_folder(source, device, log=lambda line: None, progress=progress)
    retrieval_scores = None if probed is None else probed.layers
    plans = {"searched": chosen, "even": even}
    if retrieval_scores is not None:  # a model with a tokenizer to probe with
        plans["retrieval"] = select_full_layers(num_layers, full_layers, "retrieval", rank_layers(retrieval_scores))

    whole = Scorer(nha)
    for ids in tqdm(check_chunks, desc="plans", unit="chunk", disable=not progress):
        whole.add_chunk(ids[None].to(target), {
            name: [None if i in ids_ else window for i in range(num_layers)] for name, ids_ in plans.items()})
    predicted = check_chunks.shape[0] * (chunk_len - 1)
    return {
        "model": model, **settings, "texts": list(texts), "tokens": chunks.numel(),
        "check_texts": list(check_texts), "check_tokens": check_chunks.numel(),
        "layer_kl": scores, "layer_retrieval": retrieval_scores, "full_layer_ids": chosen,
        "plans": {name: {"full_layer_ids": ids_, "kl": whole.mean_kl(name), "perplexity": whole.perplexity(
            name, predicted)} for name, ids_ in plans.items()},
        "original_perplexity": whole.perplexity("original", predicted),
    }


def format_search(report: dict) -> str:
    """The per-layer table, the two plans side by side, and the convert command for the chosen plan."""
    chosen = set(report["full_layer_ids"])
    lines = [f"{report['tokens']} tokens of {', '.join(report['texts'])}; window {report['window']}, "
             f"{report['slots']} slots, gates as converted (before finetuning)", "",
             "| layer | KL per token when NHA alone | retrieval-head score | kept full |", "|---|---|---|---|"]
    retrieval = report["layer_retrieval"] or [float("nan")] * len(report["layer_kl"])
    lines += [f"| {i} | {kl:.4g} | {retrieval[i]:.3f} | {'yes' if i in chosen else ''} |"
              for i, kl in enumerate(report["layer_kl"])]
    lines += ["", f"Plans scored whole on {report['check_tokens']} tokens of {', '.join(report['check_texts'])}:", "",
              "| plan | full layers | KL per token | perplexity |", "|---|---|---|---|",
              f"| original | all | 0 | {report['original_perplexity']:.3f} |"]
    lines += [f"| {name} | {plan['full_layer_ids']} | {plan['kl']:.4g} | {plan['perplexity']:.3f} |"
              for name, plan in report["plans"].items()]
    ids = ",".join(map(str, report["full_layer_ids"]))
    full = f"--full-layer-ids {ids}" if ids else "--full-layers 0"
    lines += ["", f"nha-retrofit convert {report['model']} --output OUT {full} --window {report['window']} "
              f"--slots {report['slots']} --gate-normalizer {report['gate_normalizer']:g} "
              f"--slot-bias-init {report['slot_bias_init']:g}"
              + (f" --gate-bias-init {report['gate_bias_init']:g}" if report.get("gate_bias_init") is not None else "")]
    return "\n".join(lines)
