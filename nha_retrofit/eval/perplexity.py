"""Perplexity of a causal LM over one long token stream, cut into independent chunks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nha_retrofit.errors import NHARetrofitError


@torch.no_grad()
def perplexity(
    model,
    input_ids: torch.Tensor,
    *,
    chunk_len: int = 1024,
    max_tokens: int | None = 8192,
    batch_size: int = 1,
    progress: bool = False,
) -> float:
    """exp(mean next-token cross-entropy) over non-overlapping ``chunk_len`` chunks of the first ``max_tokens`` (None: all).

    ``input_ids`` is one stream, [N] or [1, N]. The ragged tail is dropped, so every chunk predicts
    ``chunk_len - 1`` tokens and chunks never see each other (no sliding context). Works with any Hugging Face
    causal LM; the model runs in eval mode on its own device and is returned to its previous mode.
    """
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise NHARetrofitError(f"perplexity needs one token stream, shape [N] or [1, N]; got {tuple(input_ids.shape)}")
    if chunk_len < 2 or batch_size < 1:
        raise NHARetrofitError(f"chunk_len must be >= 2 and batch_size >= 1 (got {chunk_len}, {batch_size})")
    n_tokens = input_ids.numel() if max_tokens is None else min(input_ids.numel(), max_tokens)
    n_chunks = n_tokens // chunk_len
    if n_chunks == 0:
        raise NHARetrofitError(f"perplexity needs at least chunk_len={chunk_len} tokens, got {n_tokens}")
    chunks = input_ids[: n_chunks * chunk_len].view(n_chunks, chunk_len)
    device = next(model.parameters()).device

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        from tqdm.auto import tqdm

        for batch in tqdm(chunks.split(batch_size), desc="perplexity", unit="batch", disable=not progress):
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
            total += F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
            count += batch[:, 1:].numel()
    finally:
        model.train(was_training)
    return math.exp(total / count)
