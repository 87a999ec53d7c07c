"""Prefill and decode speed, memory and batch throughput of an NHA model against its original, side by side.

The original is the family's own transformers class (`LlamaForCausalLM`, ...) holding the very same weight tensors
(no copy), so the two differ only in attention. Both decode on a static cache, as `generate(...,
cache_implementation="static")` does: NHA on `NHAStaticCache`, the original on transformers' `StaticCache`; on CUDA
both decode steps are replayed from a CUDA graph (`modeling/decode_graph.py`), and `compile_original` also times the
original's steps through torch.compile (transformers' own fast path). The original prefills on transformers' default
dynamic cache (flash attention; a static cache would mask every prompt token against the whole cache) and its keys
and values are then copied into the static cache; NHA prefills into its static cache. Both compute the prefill's
logits for the last position only, as `generate` does.

Contexts are measured at batch 1 (alternating rounds, medians); batch throughput continues from the batch-1 prefill,
copied into a cache of B sequences (`NHAStaticCache.repeated`). A context or batch that does not fit (CUDA out of
memory) is recorded as such and the run goes on.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, StaticCache

from ..errors import NHARetrofitError
from ..modeling.modeling_nha import _CACHE_ARGUMENT, _DECODE_SDPA_BACKENDS
from ..modeling.decode_graph import DecodeGraph
from ..modeling.nha_cache import NHACacheLayer, NHAStaticCache, copy_repeated
from ..plan import PlanSpec, build_plan
from .compare import nha_checkpoint_class
from .texts import load_heldout_tokens

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARM_STEPS = 2  # untimed decode steps first: the eager step that CUDA graphs capture after, and a first replay


def decode_room(decode_steps: int) -> int:
    """Positions a measured cache keeps beyond its context: the batch-1 steps, then as many on copied caches."""
    return 2 * (WARM_STEPS + decode_steps)


def check_options(positions: int, contexts, decode_steps: int = 16, rounds: int = 3, batch_sizes=(),
                  batch_contexts=None, **_) -> None:
    """One error line for options that cannot be measured on a model of `positions` positions (checked before the
    model is built or loaded)."""
    if not contexts or min(contexts) < 1:
        raise NHARetrofitError(f"context lengths must be >= 1, got {list(contexts)}")
    if decode_steps < 1 or rounds < 1:
        raise NHARetrofitError(f"decode steps and rounds must be >= 1, got {decode_steps} and {rounds}")
    room = decode_room(decode_steps)
    if max(contexts) + room > positions:
        raise NHARetrofitError(f"context {max(contexts)} + {room} decode positions exceeds the model's "
                               f"max_position_embeddings ({positions}); use contexts up to {positions - room}")
    if batch_sizes and min(batch_sizes) < 1:
        raise NHARetrofitError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    missing = [c for c in batch_contexts or () if c not in contexts]
    if batch_sizes and missing:
        raise NHARetrofitError(f"batch context {missing[0]} is not one of the contexts {sorted(contexts)}")


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
    """Bytes a generation cache holds in its layers: key/value tensors of full layers (as allocated for a static
    cache), NHA states."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, NHACacheLayer):
            total += layer.state_bytes()
        elif hasattr(layer, "tensors"):  # the layers of `NHAStaticCache`
            total += sum(t.numel() * t.element_size() for t in layer.tensors())
        elif getattr(layer, "keys", None) is not None:
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return total


def context_tokens(folder: Path | None, length: int, vocab_size: int, device) -> torch.Tensor:
    """`length` tokens of held-out text (repeated if short) when `folder` holds a tokenizer, else random ids."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder) if folder is not None else None
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


def free_memory(device: torch.device) -> None:
    """Give a CUDA device's freed blocks back, so that the next measurement starts from the same memory."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


class PeakMemory:
    """Peak bytes allocated on a CUDA device (weights included) over the phases between `start` and `read`; None
    elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = None

    def start(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self):
        if self.device.type == "cuda":
            self.peak = max(self.peak or 0, torch.cuda.max_memory_allocated(self.device))
        return self.peak


class NHADecoder:
    """NHA on `NHAStaticCache`: the prefill writes it, one-token steps update it in place (from a CUDA graph on
    CUDA)."""

    name = "nha"
    description = "NHAStaticCache; decode steps replayed from a CUDA graph on CUDA, eager elsewhere"

    def __init__(self, model):
        self.model = model

    def prefill(self, ids, room: int):
        """(static cache holding `ids` with room for `room` more tokens, the greedy next token [B, 1])."""
        cache = NHAStaticCache(self.model.config, ids.shape[0], ids.shape[1] + room, self.model.dtype, ids.device)
        out = self.model(ids, cache=cache, logits_to_keep=1)
        return cache, out.logits[:, -1:].argmax(-1)

    def step(self, cache, token, positions):
        return self.model(token, cache=cache, position_ids=positions, logits_to_keep=1).logits[:, -1:].argmax(-1)

    def repeated(self, cache, repeats: int):
        return cache.repeated(repeats)


class OriginalDecoder:
    """The original on transformers' `StaticCache`, filled from a dynamic-cache prefill (`prefill`, `to_static`); its
    one-token steps see a mask over the filled positions and are replayed from a `DecodeGraph` on CUDA (or, with
    `compiled`, run through torch.compile(mode="reduce-overhead")). `eager_step` decodes on the dynamic cache."""

    name = "original"

    def __init__(self, model, compiled: bool = False):
        self.model = model
        self.compiled = compiled
        self.forward = torch.compile(model.forward, mode="reduce-overhead") if compiled else model.forward
        self.description = ("transformers' StaticCache; decode steps through torch.compile(mode='reduce-overhead')"
                            if compiled else "transformers' StaticCache; decode steps replayed from a CUDA graph on "
                            "CUDA (the same capture as NHA's), eager elsewhere")

    def prefill(self, ids, room: int):
        """(transformers' dynamic cache holding `ids`, the greedy next token [B, 1]): `to_static` moves it."""
        out = self.model(ids, use_cache=True, logits_to_keep=1)
        return getattr(out, "cache", None) or out.past_key_values, out.logits[:, -1:].argmax(-1)

    def to_static(self, dynamic, length: int, room: int):
        """A `StaticCache` holding the first `length` positions of `dynamic`, with room for `room` more."""
        cache = self._static_cache(dynamic.layers[0].keys.shape[0], length + room, dynamic.layers[0].keys.device)
        for layer, filled in zip(cache.layers, dynamic.layers):
            layer.keys[:, :, :length].copy_(filled.keys[:, :, :length])
            layer.values[:, :, :length].copy_(filled.values[:, :, :length])
            layer.cumulative_length.fill_(length)
        return cache

    def eager_step(self, dynamic, token, positions):
        """A one-token step on the dynamic cache, eager: the original as transformers runs it by default (with the
        SDPA backends NHA's full layers decode with, not cuDNN's, which plans anew for every key length)."""
        with torch.nn.attention.sdpa_kernel(_DECODE_SDPA_BACKENDS) if token.is_cuda else contextlib.nullcontext():
            out = self.model(input_ids=token, position_ids=positions, use_cache=True, logits_to_keep=1,
                             **{_CACHE_ARGUMENT: dynamic})
        return out.logits[:, -1:].argmax(-1)

    def _static_cache(self, batch, length, device):
        config = self.model.config
        cache = StaticCache(config=config, max_cache_len=length)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        cache.early_initialization(batch, config.num_key_value_heads, head_dim, self.model.dtype, device)
        return cache

    def _forward(self, cache, token, positions):
        filled = cache.layers[0].cumulative_length  # the new token goes there: it sees every position up to it
        mask = torch.arange(cache.layers[0].max_cache_len, device=token.device) <= filled
        mask = mask.view(1, 1, 1, -1).expand(token.shape[0], 1, 1, -1)
        with torch.nn.attention.sdpa_kernel(_DECODE_SDPA_BACKENDS) if token.is_cuda else contextlib.nullcontext():
            return self.forward(input_ids=token, position_ids=positions, attention_mask=mask, use_cache=True,
                                logits_to_keep=1, **{_CACHE_ARGUMENT: cache})

    def step(self, cache, token, positions):
        if token.is_cuda and not self.compiled:
            if getattr(cache, "decode_graph", None) is None:  # kept on the cache, as `NHAStaticCache` keeps its own
                cache.decode_graph = DecodeGraph(token.shape[0], token.device)
            out = cache.decode_graph(lambda ids, pos, _: self._forward(cache, ids, pos), token, positions)
        else:
            out = self._forward(cache, token, positions)
        return out.logits[:, -1:].argmax(-1)

    def repeated(self, cache, repeats: int):
        batch, _, length, _ = cache.layers[0].keys.shape
        new = self._static_cache(batch * repeats, length, cache.layers[0].keys.device)
        for layer, source in zip(new.layers, cache.layers):
            for name in ("keys", "values", "cumulative_length"):
                copy_repeated(getattr(layer, name), getattr(source, name), repeats)
        return new


def decode_ms_per_step(step, cache, token, start: int, steps: int, clock: Clock) -> float:
    """Mean ms of `steps` greedy one-token steps `step(cache, token, positions)` after WARM_STEPS untimed ones (the
    tokens are fed back on the device, as generate does, with no host sync between steps)."""
    positions = torch.full((token.shape[0], 1), start, dtype=torch.long, device=token.device)

    def run(count):
        nonlocal token
        for _ in range(count):
            token = step(cache, token, positions)
            positions.add_(1)

    run(WARM_STEPS)
    _, ms = clock(lambda: run(steps))
    return ms / steps


def fits(fn, device: torch.device):
    """(fn(), True), or (None, False) when it ran out of device memory (freed again)."""
    try:
        return fn(), True
    except torch.OutOfMemoryError:
        free_memory(device)
        return None, False


class Bench:
    """The measurements of one model (NHA) and its original on one device; each method returns plain records and
    runs without autograd (gradients would keep every activation and switch the kernels to their training forms).

    Every measured prefill at batch 1 follows an untimed one of the same length by the same model: kernel compiles,
    cuDNN plans and cuBLAS heuristics for a new shape happen there, in whichever model meets the shape first."""

    def __init__(self, model, *, decode_steps: int, rounds: int, token_source: Path | None = None,
                 compile_original: bool = False, progress=None):
        self.model = model
        self.device = model.device
        self.decoders = {"original": OriginalDecoder(original_sharing_weights(model)), "nha": NHADecoder(model)}
        self.compiled_original = OriginalDecoder(self.decoders["original"].model, compiled=True) \
            if compile_original else None
        self.decode_steps, self.rounds = decode_steps, rounds
        self.batch_steps = min(decode_steps, max(2, decode_steps // 4))  # timed steps of a batch run (long steps)
        self.room = decode_room(decode_steps)
        self.clock = Clock(self.device)
        self.token_source = token_source
        self.progress = progress or (lambda *_: None)
        self.prefilled = {}  # (model name, context) -> (static cache, next token) kept for the batch runs
        self.positions_limit = model.config.max_position_embeddings

    def tokens(self, length: int):
        return context_tokens(self.token_source, length, self.model.config.vocab_size, self.device)

    def static_prefill(self, decoder, ids):
        """(static cache holding `ids` with room for the decode steps, the next token)."""
        prefilled, token = decoder.prefill(ids, self.room)
        return (decoder.to_static(prefilled, ids.shape[1], self.room) if isinstance(decoder, OriginalDecoder)
                else prefilled), token

    @torch.no_grad()
    def latency(self, length: int, keep: bool = False) -> list[dict]:
        """Batch 1 at `length` tokens, each model: prefill ms, decode ms per token (the original's also eager on
        its dynamic cache), cache bytes, peak memory (CUDA), or `fits: False`. With `keep`, the prefilled caches
        stay for `throughput` at this context."""
        ids = self.tokens(length)
        runs = {name: [] for name in self.decoders}
        for round_index in range(self.rounds + 1):  # round 0: the untimed first prefill of this length
            for name, decoder in self.decoders.items():
                if runs[name] is None:
                    continue
                last = round_index == self.rounds
                result, ok = fits(lambda: self._latency_once(decoder, ids, keep and last), self.device)
                runs[name] = None if not ok else runs[name] + [result] if round_index else []
                self.progress()
        records = []
        for name, results in runs.items():
            record = {"model": name, "context": length, "batch": 1, "fits": results is not None}
            if results:
                record.update({key: statistics.median(r[key] for r in results) for key in results[0]
                               if key.endswith("_ms") or key.endswith("_ms_per_token")})
                record["cache_bytes"] = results[-1]["cache_bytes"]
                record["peak_bytes"] = max(r["peak_bytes"] for r in results) if self.device.type == "cuda" else None
            records.append(record)
        return records

    def _latency_once(self, decoder, ids, keep: bool) -> dict:
        peak = PeakMemory(self.device)
        free_memory(self.device)
        peak.start()
        (prefilled, token), prefill_ms = self.clock(lambda: decoder.prefill(ids, self.room))
        peak.read()
        result = {"prefill_ms": prefill_ms}
        if isinstance(decoder, OriginalDecoder):
            result["eager_decode_ms_per_token"] = decode_ms_per_step(decoder.eager_step, prefilled, token,
                                                                     ids.shape[1], self.decode_steps, self.clock)
            prefilled = decoder.to_static(prefilled, ids.shape[1], self.room)
        cache = prefilled
        del prefilled
        free_memory(self.device)  # (the original's dynamic cache)
        peak.start()
        result["decode_ms_per_token"] = decode_ms_per_step(decoder.step, cache, token, ids.shape[1],
                                                           self.decode_steps, self.clock)
        result.update(cache_bytes=cache_bytes(cache), peak_bytes=peak.read())
        if keep:
            self.prefilled[decoder.name, ids.shape[1]] = (cache, token)
        return result

    @torch.no_grad()
    def compiled_latency(self, length: int) -> dict:
        """The original's decode ms per token at batch 1 through torch.compile, or the reason it failed."""
        record = {"model": "original, torch.compile", "context": length, "batch": 1}
        try:
            cache, token = self.static_prefill(self.compiled_original, self.tokens(length))
            start = time.perf_counter()
            record["decode_ms_per_token"] = decode_ms_per_step(self.compiled_original.step, cache, token, length,
                                                               self.decode_steps, self.clock)
            record["compile_and_decode_s"] = time.perf_counter() - start
            record["fits"] = True
        except torch.OutOfMemoryError:
            record["fits"] = False
        except Exception as error:  # noqa: BLE001 - torch.compile fails in many ways; the report says which
            record["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        free_memory(self.device)
        return record

    @torch.no_grad()
    def throughput(self, length: int, batch_sizes) -> list[dict]:
        """Decode tokens per second at each batch size, each model, from its batch-1 prefill at `length` (kept by
        `latency(length, keep=True)`): the sizes in order until one does not fit; then the largest batch that fits,
        by bisection between the last size that fit and the first that did not (to within a quarter)."""
        records = []
        for name, decoder in self.decoders.items():
            source = self.prefilled.pop((name, length), None)
            if source is None:  # the context itself did not fit
                continue
            fitted, failed = 0, None
            for batch in batch_sizes:
                record = self._throughput_once(decoder, source, length, batch)
                records.append(record)
                self.progress()
                if not record["fits"]:
                    failed = batch
                    break
                fitted = batch
            while failed is not None and failed - fitted > max(1, fitted // 4):
                middle = (fitted + failed) // 2
                record = self._throughput_once(decoder, source, length, middle)
                records.append(record)
                fitted, failed = (middle, failed) if record["fits"] else (fitted, middle)
            records.append({"model": name, "context": length, "largest_batch": fitted, "first_failing": failed})
            del source
            free_memory(self.device)
        return records

    def _throughput_once(self, decoder, source, length: int, batch: int) -> dict:
        record = {"model": decoder.name, "context": length, "batch": batch}

        def run():  # the source cache is copied (batch 1 too) and never advanced: it decoded its batch-1 steps
            cache, token = decoder.repeated(source[0], batch), source[1].expand(batch, 1).contiguous()
            return decode_ms_per_step(decoder.step, cache, token, length + WARM_STEPS + self.decode_steps,
                                      self.batch_steps, self.clock)

        ms, ok = fits(run, self.device)
        free_memory(self.device)
        record["fits"] = ok
        if ok:
            record.update(decode_ms_per_step=ms, tokens_per_s=1000 * batch / ms)
        return record

    @torch.no_grad()
    def longest_context(self, latency: list[dict]) -> list[dict]:
        """Per model, the longest context whose batch-1 prefill and decode steps fit: from the longest that fit in
        `latency` (unless a longer one there did not), doubling, then the model's positions."""
        records = []
        limit = self.positions_limit - self.room
        for name, decoder in self.decoders.items():
            rows = [r for r in latency if r["model"] == name]
            longest = max((r["context"] for r in rows if r["fits"]), default=0)
            failed = min((r["context"] for r in rows if not r["fits"] and r["context"] > longest), default=None)
            length = 2 * longest
            while failed is None and 0 < longest < limit:
                length = min(length, limit)
                _, ok = fits(lambda: self._latency_once(decoder, self.tokens(length), False), self.device)
                self.progress()
                longest, failed = (length, None) if ok else (longest, length)
                length *= 2
            records.append({"model": name, "longest_context": longest, "first_failing": failed,
                            "limited_by": "memory" if failed else "positions"})
        return records


def machine_facts(device: torch.device) -> dict:
    import transformers

    facts = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             "torch": torch.__version__, "transformers": transformers.__version__}
    if device.type == "cuda":
        facts["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        facts["cuda"] = torch.version.cuda
        try:
            import triton

            facts["triton"] = triton.__version__
        except ImportError:
            pass
    return facts


def run_benchmark(model, *, contexts, decode_steps: int = 16, rounds: int = 3, batch_sizes=(), batch_contexts=None,
                  longest: bool = False, compile_original: bool = False, token_source: Path | None = None,
                  progress: bool = False) -> dict:
    """Every measurement of `model` (an NHA model in eval mode) against its original: latency and memory per context
    at batch 1, decode throughput per batch size at `batch_contexts` (default: every context), the longest context
    (with `longest`). Returns the report (see `bench.report`)."""
    check_options(model.config.max_position_embeddings, contexts, decode_steps, rounds, batch_sizes, batch_contexts)
    contexts = sorted(contexts)
    batch_contexts = sorted(contexts if batch_contexts is None else batch_contexts)
    from tqdm.auto import tqdm

    total = 2 * (rounds + 1) * len(contexts) + 2 * len(batch_contexts) * len(batch_sizes)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress) as bar:
        bench = Bench(model, decode_steps=decode_steps, rounds=rounds, token_source=token_source,
                      compile_original=compile_original, progress=bar.update)
        latency, throughput, largest, compiled = [], [], [], []
        for length in contexts:
            keep = bool(batch_sizes) and length in batch_contexts
            latency += bench.latency(length, keep=keep)
            if keep:
                for record in bench.throughput(length, sorted(batch_sizes)):
                    (largest if "largest_batch" in record else throughput).append(record)
        if compile_original:
            compiled.append(bench.compiled_latency(contexts[0]))
        longest_records = bench.longest_context(latency) if longest else []
    return {
        "machine": machine_facts(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "windows": list(model.config.nha_windows),
        "num_slots": model.config.nha_num_slots,
        "decode": {name: decoder.description for name, decoder in bench.decoders.items()},
        "decode_steps": decode_steps,
        "rounds": rounds,
        "latency": latency,
        "original_compiled": compiled,
        "throughput": throughput,
        "largest_batch": largest,
        "longest_context": longest_records,
    }


def benchmark_checkpoint(folder, contexts=(512, 2048), *, device: str = "auto", dtype: str = "auto", **options) -> dict:
    """`run_benchmark` on the NHA checkpoint at `folder` (context tokens from its tokenizer when it has one)."""
    target = resolve_device(device)
    weights_dtype = resolve_dtype(dtype, target)
    model_class = nha_checkpoint_class(Path(folder))
    check_options(model_class.config_class.from_pretrained(folder).max_position_embeddings, contexts, **options)
    model = model_class.from_pretrained(folder, dtype=weights_dtype).eval().to(target)
    report = run_benchmark(model, contexts=contexts, token_source=Path(folder), **options)
    return {"model": {"name": Path(folder).name, "checkpoint": str(folder)}, **report}


def benchmark_random_weights(name_or_path: str, spec: PlanSpec, *, layers: int | None = None,
                             contexts=(512, 2048), device: str = "auto", dtype: str = "auto", **options) -> dict:
    """`run_benchmark` on a model built from a config alone (a named one or a config.json, `bench.random_weights`),
    converted with the plan `spec` asks for, random weights in `dtype`."""
    from ..bench.random_weights import random_nha_model, random_weights_config

    name, config = random_weights_config(name_or_path)
    if layers is not None and not 1 <= layers <= config["num_hidden_layers"]:
        raise NHARetrofitError(f"--layers {layers}: the model has 1..{config['num_hidden_layers']} layers")
    num_layers = layers or config["num_hidden_layers"]
    if spec.select == "retrieval":  # random weights hold no retrieval heads to rank; the cost of a plan depends on
        spec = dataclasses.replace(spec, select="even")  # how many layers are full, not on which
    plan = build_plan(num_layers, spec)
    check_options(config.get("max_position_embeddings") or 2048, contexts, **options)
    target = resolve_device(device)
    model = random_nha_model(config, plan, target, resolve_dtype(dtype, target), layers=layers)
    report = run_benchmark(model, contexts=contexts, **options)
    experts = getattr(model.config, "_experts_implementation", None) if hasattr(model.config, "num_experts") else None
    info = {"name": name, "random_weights": True, "layers": num_layers, "layers_of_config": config["num_hidden_layers"],
            "plan": plan.as_dict(), "plan_description": plan.describe(), "config": config}
    if experts:
        info["experts_implementation"] = experts
    return {"model": info, **report}
