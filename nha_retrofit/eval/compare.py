"""Held-out perplexity of a converted checkpoint against its original: the first number every user wants."""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..conversion.converter import CONVERSION_RECORD
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


def compare_perplexity(folder, texts=DEFAULT_TEXTS, *, max_tokens=8192, chunk_len=1024, log=print):
    """Perplexity of the original model, the converted model as planned, and the converted model with every window
    full (which must equal the original: a visible check of the conversion). Returns {text: {variant: ppl}}."""
    folder = Path(folder)
    unknown = [t for t in texts if t not in HELDOUT_TEXTS]
    if unknown:
        raise NHARetrofitError(f"unknown text {unknown[0]!r}; available: {', '.join(HELDOUT_TEXTS)}")
    record_path = folder / CONVERSION_RECORD
    if not record_path.is_file():
        raise NHARetrofitError(f"{folder} has no {CONVERSION_RECORD}: it was not written by `nha-retrofit convert`")
    source = Path(json.loads(record_path.read_text())["source_path"])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    streams = {name: load_heldout_tokens(tokenizer, name, max_tokens) for name in texts}
    results = {name: {} for name in texts}

    def measure(variant, model):
        for name, ids in streams.items():
            results[name][variant] = perplexity(model, ids, chunk_len=chunk_len, max_tokens=max_tokens, progress=True)
            log(f"{name:>14}  {variant:<22} perplexity {results[name][variant]:.2f}")

    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    measure("original", original)
    del original
    converted = load_nha_checkpoint(folder)
    planned = list(converted.config.nha_windows)
    measure("converted", converted)
    converted.set_windows([None] * len(planned))
    measure("converted, all full", converted)
    converted.set_windows(planned)
    return results


def generate_text(folder, prompt: str, max_new_tokens: int = 40) -> str:
    """Greedy completion of `prompt` by the checkpoint at `folder` (NHA or not)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load_nha_checkpoint(folder)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
