"""Perplexity by position: the mean next-token loss of the tokens at each range of positions of long sequences.

A model that keeps using context beyond its window predicts late tokens better than early ones; one that forgets
everything past the window levels off after it. Sequences are consecutive, non-overlapping pieces of the held-out
texts (`texts.py`), taken from each text in turn; ranges are log-spaced: 0-64, 64-128, 128-256, ... up to the
sequence length (position p is the token predicted from positions 0..p-1; position 0 is never predicted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import NHARetrofitError
from .compare import DEFAULT_TEXTS
from .texts import load_heldout_tokens

FIRST_BUCKET = 64
LOSS_SLICE = 4096  # positions whose logits are turned to fp32 at a time


@dataclass
class PositionSpec:
    """Sequence length in tokens (None: the longest default retrieval length), sequences, and their texts."""

    length: int | None = None
    sequences: int = 8
    texts: list[str] = field(default_factory=lambda: list(DEFAULT_TEXTS))


def position_buckets(length: int) -> list[tuple[int, int]]:
    """[start, end) position ranges: 0-64, then doubling, the last one ending at `length`."""
    edges, edge = [0], FIRST_BUCKET
    while edge < length:
        edges.append(edge)
        edge *= 2
    edges.append(length)
    return list(zip(edges[:-1], edges[1:]))


def long_sequences(tokenizer, texts, length: int, count: int) -> torch.LongTensor:
    """Up to `count` sequences of `length` tokens, [N, length]: the texts' consecutive pieces, one text at a time in
    turn (a text shorter than `length` gives none)."""
    pieces = [load_heldout_tokens(tokenizer, name, max_tokens=None)[0].split(length) for name in texts]
    pieces = [[piece for piece in text if piece.numel() == length] for text in pieces]
    chosen = []
    for index in range(max(map(len, pieces), default=0)):
        chosen += [text[index] for text in pieces if index < len(text)]
    if not chosen:
        raise NHARetrofitError(f"no held-out text of {', '.join(texts)} has {length} tokens for a position-wise "
                               "perplexity; use a shorter --position-length or a longer text")
    return torch.stack(chosen[:count])


@torch.no_grad()
def token_losses(model, ids: torch.LongTensor) -> torch.Tensor:
    """Next-token cross-entropy of every position 1..T-1 of each sequence, [B, T-1] fp32."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    targets = ids[:, 1:]
    losses = torch.empty(targets.shape, dtype=torch.float32, device=ids.device)
    for start in range(0, targets.shape[1], LOSS_SLICE):
        part = slice(start, start + LOSS_SLICE)
        losses[:, part] = F.cross_entropy(logits[:, part].float().transpose(1, 2), targets[:, part], reduction="none")
    return losses


def run_positions(variants, sequences: torch.LongTensor, spec: PositionSpec, *, batch_size: int = 1,
                  progress: bool = False) -> dict:
    """Loss by position of every variant on `sequences` ([N, spec.length], `long_sequences`): {length, sequences,
    texts, buckets, loss: {variant: mean next-token loss per bucket}}."""
    from tqdm.auto import tqdm

    buckets = position_buckets(spec.length)
    loss = {}
    batches = sequences.split(batch_size)
    with tqdm(total=len(batches) * len(variants.names), desc="positions", unit="batch", disable=not progress) as bar:
        for variant in variants.names:
            totals = torch.zeros(spec.length - 1, dtype=torch.float64)
            with variants.use(variant) as model:
                for batch in batches:
                    totals += token_losses(model, batch.to(model.device)).double().sum(0).cpu()
                    bar.update()
            # totals[p - 1] is the summed loss of position p over the sequences
            loss[variant] = [(totals[max(start, 1) - 1 : end - 1].sum() / (end - max(start, 1)) / len(sequences)).item()
                             for start, end in buckets]
    return {
        "length": spec.length, "sequences": len(sequences), "texts": list(spec.texts),
        "buckets": [list(bucket) for bucket in buckets], "loss": loss,
    }
