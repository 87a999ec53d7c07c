"""Prefill and decode speed and cache memory of a converted checkpoint against its original, side by side.

The original is the family's own transformers class (`LlamaForCausalLM`, ...) holding the very same weight tensors
(no copy), so the two differ only in attention. They are measured in alternating rounds in one process, so both see
the same machine noise; medians are reported.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..errors import NHARetrofitError
from ..modeling.modeling_nha import _CACHE_ARGUMENT
from ..modeling.nha_cache import NHACacheLayer
from .compare import nha_checkpoint_class
from .texts import load_heldout_tokens

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def original_sharing_weights(model):
    """The original family model (every layer full attention, transformers' own attention code) built around
    `model`'s parameter and buffer tensors: no second copy of the weights."""
    original_class = type(model).__bases__[-1]  # NHA<Family>ForCausalLM(NHAForCausalLMMixin, <Family>ForCausalLM)
    with torch.device("meta"):
        original = original_class(copy.deepcopy(model.config))
    for name, _ in list(original.named_parameters(remove_duplicate=False)):
        owner, _, leaf = name.rpartition(".")
        original.get_submodule(owner)._parameters[leaf] = model.get_parameter(name)
    for name, _ in list(original.named_buffers(remove_duplicate=False)):
        owner, _, leaf = name.rpartition(".")
        original.get_submodule(owner)._buffers[leaf] = model.get_buffer(name)
    return original.eval()


def cache_bytes(cache) -> int:
    """Bytes a generation cache holds: growing key/value tensors of full layers, fixed NHA states."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, NHACacheLayer):
            total += layer.state_bytes()
        elif getattr(layer, "keys", None) is not None:
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return total


def context_tokens(folder: Path, length: int, vocab_size: int, device) -> torch.Tensor:
    """`length` tokens of held-out text (repeated if short) when the checkpoint has a tokenizer, else random ids."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        tokenizer = None
    if tokenizer is None:
        ids = torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    else:
        text = load_heldout_tokens(tokenizer, "python-stdlib", length)[0]
        ids = text.repeat(-(-length // text.numel()))[:length]
    return ids.view(1, length).to(device)


class Clock:
    """Wall-clock milliseconds with the device drained first and last (CUDA runs asynchronously)."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self, fn):
        self.sync()
        start = time.perf_counter()
        result = fn()
        self.sync()
        return result, 1000 * (time.perf_counter() - start)


@torch.no_grad()
def measure_once(model, ids, decode_steps: int, clock: Clock) -> dict:
    """One prefill of `ids`, then `decode_steps` greedy one-token steps on its cache: ms, per-step ms, cache bytes
    after the prefill, and (CUDA) peak bytes allocated above what was allocated before."""
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ids.device)
        base = torch.cuda.memory_allocated(ids.device)
    out, prefill_ms = clock(lambda: model(ids, use_cache=True))
    cache = getattr(out, "cache", None) or out.past_key_values  # the output field was renamed during 5.x
    held = cache_bytes(cache)
    token = out.logits[:, -1:].argmax(-1)
    step_ms = []
    for _ in range(decode_steps):
        out, ms = clock(lambda: model(token, use_cache=True, **{_CACHE_ARGUMENT: cache}))
        token = out.logits[:, -1:].argmax(-1)
        step_ms.append(ms)
    peak = torch.cuda.max_memory_allocated(ids.device) - base if cuda else None
    return {"prefill_ms": prefill_ms, "step_ms": step_ms, "cache_bytes": held, "peak_bytes": peak}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NHARetrofitError(f"device {device!r} asked for, but this machine has no CUDA device")
    try:
        return torch.device(device)
    except RuntimeError:
        raise NHARetrofitError(f"unknown device {device!r}; use auto, cpu or cuda[:N]") from None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, float32 on the CPU (where bfloat16 matmuls are slow)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise NHARetrofitError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def benchmark_checkpoint(folder, contexts=(512, 2048), *, decode_steps: int = 16, rounds: int = 3,
                         device: str = "auto", dtype: str = "auto", progress: bool = False) -> dict:
    """Prefill ms, decode ms/token and cache bytes of the checkpoint at `folder` and of its original (same weights),
    per context length, batch 1: medians over `rounds` alternating rounds (decode: over every step of every round)."""
    if not contexts or min(contexts) < 1:
        raise NHARetrofitError(f"context lengths must be >= 1, got {list(contexts)}")
    if decode_steps < 1 or rounds < 1:
        raise NHARetrofitError(f"decode steps and rounds must be >= 1, got {decode_steps} and {rounds}")
    target = resolve_device(device)
    weights_dtype = resolve_dtype(dtype, target)
    model_class = nha_checkpoint_class(Path(folder))
    limit = model_class.config_class.from_pretrained(folder).max_position_embeddings
    if max(contexts) + decode_steps > limit:
        raise NHARetrofitError(f"context {max(contexts)} + {decode_steps} decode steps exceeds the model's "
                               f"max_position_embeddings ({limit})")
    model = model_class.from_pretrained(folder, dtype=weights_dtype).eval().to(target)
    models = {"original": original_sharing_weights(model), "nha": model}
    clock = Clock(target)
    samples = {(length, name): [] for length in contexts for name in models}
    from tqdm.auto import tqdm

    with tqdm(total=len(samples) * rounds, desc="bench", unit="run", disable=not progress) as bar:
        longest_ids = context_tokens(Path(folder), max(contexts), model.config.vocab_size, target)
        for length in contexts:
            ids = longest_ids[:, :length]
            for name, candidate in models.items():  # warm-up: first-call allocations and kernel compiles
                measure_once(candidate, ids[:, : min(length, 64)], 1, clock)
            for _ in range(rounds):
                for name, candidate in models.items():
                    samples[length, name].append(measure_once(candidate, ids, decode_steps, clock))
                    bar.update()
    results = []
    for (length, name), runs in samples.items():
        peaks = [run["peak_bytes"] for run in runs if run["peak_bytes"] is not None]
        results.append({
            "model": name, "context": length,
            "prefill_ms": statistics.median(run["prefill_ms"] for run in runs),
            "decode_ms_per_token": statistics.median(ms for run in runs for ms in run["step_ms"]),
            "cache_bytes": runs[-1]["cache_bytes"],
            "peak_bytes": max(peaks) if peaks else None,
        })
    device_name = torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu"
    return {
        "checkpoint": str(folder), "device": device_name, "dtype": str(model.dtype).removeprefix("torch."),
        "torch": torch.__version__, "windows": list(model.config.nha_windows), "decode_steps": decode_steps,
        "rounds": rounds, "results": results,
    }


def human_bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def format_table(report: dict) -> str:
    """Markdown: one row per context length, original against NHA (peak memory on CUDA only)."""
    rows = {(r["context"], r["model"]): r for r in report["results"]}
    columns = [("prefill ms", "prefill_ms", "{:.1f}".format), ("decode ms per token", "decode_ms_per_token",
               "{:.2f}".format), ("cache", "cache_bytes", human_bytes)]
    if all(r["peak_bytes"] is not None for r in report["results"]):
        columns.append(("peak memory", "peak_bytes", human_bytes))
    lines = [
        f"{report['device']}, {report['dtype']}, batch 1, medians of {report['rounds']} alternating rounds",
        "",
        "| context | " + " | ".join(f"{title} (original / NHA)" for title, _, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for length in sorted({context for context, _ in rows}):
        pair = rows[length, "original"], rows[length, "nha"]
        lines.append(f"| {length} | " + " | ".join(" / ".join(fmt(r[key]) for r in pair) for _, key, fmt in columns)
                     + " |")
    return "\n".join(lines)
