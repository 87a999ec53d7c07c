"""Prefill and decode speed, memory and batch throughput of an NHA model against its original at its best, side by
side on one device (the paths: `decoders.py`).

Each context is measured at batch 1 in rounds: an untimed prefill of each model first (kernel compiles, cuDNN plans
and cuBLAS heuristics for a new shape happen there), then `rounds` timed rounds, NHA and the original in alternating
order. Every record keeps its rounds, and reports their median and range. Every speed-up is against the fastest
baseline at that context. Batch throughput continues from the last round's caches, copied into caches of B sequences
(`NHAStaticCache.repeated`). A context or batch that does not fit (CUDA out of memory) is recorded as such and the run
goes on. Every measurement runs without autograd (gradients would keep every activation and switch the kernels to
their training forms).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..eval.texts import load_heldout_tokens
from ..modeling.decoding import kv_cache_dtype
from ..modeling.load import device_name
from .decoders import COMPILED, EAGER, EVERY_WINDOW_FULL, NHA, Original, StaticDecoder, full_windows_decoder
from .memory import cache_bytes, largest_batch, static_bytes_per_sequence
from .options import COMPILED_WARM_STEPS, WARM_STEPS, check_options, decode_room
from .timing import Clock, PeakMemory, decode_ms_per_step, fits, free_memory, spread

TIMED = ("prefill_ms", "decode_ms_per_token")


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


def failure(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


class Bench:
    """The measurements of one NHA model and its original (on the same tensors) on one device; each method returns
    plain records."""

    def __init__(self, model, *, decode_steps: int, rounds: int, token_source: Path | None = None,
                 compile_original: bool = True, kv_cache_dtype=None, progress=None):
        self.model = model
        self.device = model.device
        self.nha = StaticDecoder(NHA, model, kv_cache_dtype)
        self.full = full_windows_decoder(model)
        self.original = Original(model, compile_original and self.device.type == "cuda")
        self.paths = {NHA: self.nha.description,
                      EAGER: "transformers' dynamic cache, eager steps, PyTorch's choice among every SDPA backend"}
        if self.original.compiled is not None:
            self.paths[COMPILED] = ("transformers' StaticCache, steps through torch.compile(mode='reduce-overhead'), "
                                    "compiled for every context")
        self.paths[EVERY_WINDOW_FULL] = self.full.description
        self.baselines = [path for path in self.paths if path != NHA]
        self.graph_baselines = [path for path in (COMPILED, EVERY_WINDOW_FULL) if path in self.paths
                                and (path == COMPILED or self.full.graph)]
        self.decode_steps, self.rounds = decode_steps, rounds
        self.batch_steps = min(decode_steps, max(2, decode_steps // 4))  # timed steps of a batch run (long steps)
        self.room = decode_room(decode_steps)
        self.clock = Clock(self.device)
        self.token_source = token_source
        self.progress = progress or (lambda *_: None)
        self.kept = {}  # (path, context) -> (static cache, next token) kept for the batch runs
        self.positions_limit = model.config.max_position_embeddings

    def tokens(self, length: int):
        return context_tokens(self.token_source, length, self.model.config.vocab_size, self.device)

    def decode(self, step, cache, token, length: int, warm_steps: int = WARM_STEPS) -> float:
        return decode_ms_per_step(step, cache, token, length, self.decode_steps, self.clock, warm_steps)

    @torch.no_grad()
    def latency(self, length: int, keep: bool = False) -> list[dict]:
        """Batch 1 at `length` tokens, every path: prefill ms (where the path prefills), decode ms per token, cache
        bytes, peak memory (CUDA), each the median of the rounds with its range; or `fits: False`, or the error.
        With `keep`, the last round's static caches stay for `throughput` at this context."""
        ids = self.tokens(length)
        results = {path: [] for path in self.paths}
        runs = [self.nha_once, self.original_once]
        for round_index in range(self.rounds + 1):  # round 0: the untimed first prefill of this length
            for run in runs if round_index % 2 == 1 else runs[::-1]:
                for path, result in run(ids, round_index == 0, keep and round_index == self.rounds).items():
                    if isinstance(results[path], list):
                        results[path] = result if not isinstance(result, dict) else results[path] + [result]
                self.progress()
        return [self.latency_record(path, length, outcome) for path, outcome in results.items()]

    def latency_record(self, path: str, length: int, outcome) -> dict:
        """One path's record from its rounds (a list of dicts), or from why it has none (None: out of memory; a str:
        the error)."""
        record = {"model": path, "context": length, "batch": 1, "fits": isinstance(outcome, list)}
        if isinstance(outcome, str):
            record["error"] = outcome
        if not isinstance(outcome, list) or not outcome:
            return record
        rounds = {key: [r[key] for r in outcome] for key in TIMED if key in outcome[0]}
        for key, values in rounds.items():
            summary = spread(values)
            record[key], record[f"{key}_range"] = summary["median"], [summary["min"], summary["max"]]
        record["rounds"] = rounds
        record["cache_bytes"] = outcome[-1]["cache_bytes"]
        peaks = [r["peak_bytes"] for r in outcome if r.get("peak_bytes") is not None]
        record["peak_bytes"] = max(peaks) if peaks else None
        return record

    def nha_once(self, ids, warm: bool, keep: bool) -> dict:
        """{NHA: one round's measurements, or None when it does not fit}; a warm-up round only prefills."""
        length = ids.shape[1]

        def run():
            peak = PeakMemory(self.device)
            free_memory(self.device)
            peak.start()
            (cache, token), prefill_ms = self.clock(lambda: self.nha.prefill(ids, self.room))
            if warm:
                return {}
            result = {"prefill_ms": prefill_ms, "decode_ms_per_token": self.decode(self.nha.step, cache, token, length),
                      "cache_bytes": cache_bytes(cache), "peak_bytes": peak.read()}
            if keep:
                self.kept[NHA, length] = (cache, token)
            return result

        result, ok = fits(run, self.device)
        return {} if warm and ok else {NHA: result}

    def original_once(self, ids, warm: bool, keep: bool, eager_only: bool = False) -> dict:
        """{baseline path: one round's measurements, None (does not fit) or the error}: one prefill of the original
        on its dynamic cache, its eager steps there, then the same keys and values copied into each static path."""
        length = ids.shape[1]
        peak = PeakMemory(self.device)
        free_memory(self.device)
        peak.start()
        prefilled, ok = fits(lambda: self.clock(lambda: self.original.prefill(ids)), self.device)
        if not ok:
            return {path: None for path in self.baselines}
        (dynamic, token), prefill_ms = prefilled
        if warm:
            return {}
        results = {}
        eager = {"prefill_ms": prefill_ms, "cache_bytes": cache_bytes(dynamic)}
        decoded, ok = fits(lambda: self.decode(self.original.eager_step, dynamic, token, length), self.device)
        results[EAGER] = {**eager, "decode_ms_per_token": decoded, "peak_bytes": peak.read()} if ok else None
        if eager_only:
            return results
        if COMPILED in self.paths and self.original.compiled is not None:
            results[COMPILED] = self.compiled_once(dynamic, token, length)
        full, ok = fits(lambda: self.full.filled_from(dynamic, length, self.room), self.device)
        del dynamic
        free_memory(self.device)
        if ok:
            decoded, ok = fits(lambda: self.decode(self.full.step, full, token, length), self.device)
        results[EVERY_WINDOW_FULL] = {"decode_ms_per_token": decoded, "cache_bytes": cache_bytes(full)} if ok else None
        if ok and keep:
            self.kept[EVERY_WINDOW_FULL, length] = (full, token)
        return results

    def compiled_once(self, dynamic, token, length: int):
        """The compiled path's round, None when it does not fit, or why torch.compile failed (then not tried again)."""
        try:
            static = self.original.static_from(dynamic, length, self.room)
            start = time.perf_counter()
            ms = self.decode(self.original.compiled_step, static, token, length, COMPILED_WARM_STEPS)
            return {"decode_ms_per_token": ms, "cache_bytes": cache_bytes(static),
                    "compile_and_decode_s": time.perf_counter() - start}
        except torch.OutOfMemoryError:
            self.original.static = None
            free_memory(self.device)
            return None
        except Exception as error:  # noqa: BLE001 - torch.compile fails in many ways; the report says which
            self.original.compiled = None
            return failure(error)

    @torch.no_grad()
    def throughput(self, length: int, batch_sizes) -> list[dict]:
        """Decode tokens per second at each batch size, NHA and the original every window full, from their batch-1
        caches at `length` (kept by `latency(length, keep=True)`): the sizes in order until one does not fit; then
        the largest batch that fits, by bisection between the last size that fit and the first that did not (to
        within a quarter)."""
        records = []
        self.original.static = None  # the compiled path's cache is not needed any more
        for decoder in (self.nha, self.full):
            source = self.kept.pop((decoder.name, length), None)
            if source is None:  # the context itself did not fit
                continue
            fitted, failed = 0, None
            for batch in batch_sizes:
                record = self.throughput_once(decoder, source, length, batch)
                records.append(record)
                self.progress()
                if not record["fits"]:
                    failed = batch
                    break
                fitted = batch
            while failed is not None and failed - fitted > max(1, fitted // 4):
                middle = (fitted + failed) // 2
                record = self.throughput_once(decoder, source, length, middle)
                records.append(record)
                fitted, failed = (middle, failed) if record["fits"] else (fitted, middle)
            records.append({"model": decoder.name, "context": length, "largest_batch": fitted,
                            "first_failing": failed})
            del source
            free_memory(self.device)
        return records

    def throughput_once(self, decoder, source, length: int, batch: int) -> dict:
        record = {"model": decoder.name, "context": length, "batch": batch}

        def run():  # the source cache is copied (batch 1 too) and never advanced: it decoded its batch-1 steps
            cache, token = decoder.repeated(source[0], batch), source[1].expand(batch, 1).contiguous()
            return decode_ms_per_step(decoder.step, cache, token, length + WARM_STEPS + self.decode_steps,
                                      self.batch_steps, self.clock, WARM_STEPS)

        ms, ok = fits(run, self.device)
        free_memory(self.device)
        record["fits"] = ok
        if ok:
            record.update(decode_ms_per_step=ms, tokens_per_s=1000 * batch / ms)
        return record

    @torch.no_grad()
    def longest_context(self, latency: list[dict]) -> list[dict]:
        """NHA's and the original's longest context whose batch-1 prefill and decode steps fit (the original's
        eager: its prefill is every baseline's): from the longest that fit in `latency` (unless a longer one there
        did not), doubling, then the model's positions."""
        records = []
        limit = self.positions_limit - self.room
        measure = {NHA: lambda ids: self.nha_once(ids, False, False)[NHA],
                   EAGER: lambda ids: self.original_once(ids, False, False, eager_only=True)[EAGER]}
        for name, once in measure.items():
            rows = [r for r in latency if r["model"] == name]
            longest = max((r["context"] for r in rows if r["fits"]), default=0)
            failed = min((r["context"] for r in rows if not r["fits"] and r["context"] > longest), default=None)
            length = 2 * longest
            while failed is None and 0 < longest < limit:
                length = min(length, limit)
                ok = once(self.tokens(length)) is not None
                self.progress()
                longest, failed = (length, None) if ok else (longest, length)
                length *= 2
            records.append({"model": name, "longest_context": longest, "first_failing": failed,
                            "limited_by": "memory" if failed else "positions"})
        return records

    def memory_accounting(self, latency: list[dict], contexts) -> list[dict]:
        """Per batch context and cache (NHA's in the model's dtype and in float8, the original every window full):
        bytes per sequence and, on CUDA, the largest batch the device's memory holds (`memory.py`)."""
        config, dtype = self.model.config, self.model.dtype
        total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
        caches = [(NHA, config, None), (NHA, config, torch.float8_e4m3fn), (EVERY_WINDOW_FULL, self.full.model.config,
                                                                           None)]
        records = []
        for length in contexts:
            row = next((r for r in latency if r["model"] == NHA and r["context"] == length and r["fits"]), None)
            fixed = (row["peak_bytes"] - row["cache_bytes"]) if row and row.get("peak_bytes") is not None else None
            for path, path_config, kv_dtype in caches:
                per_sequence = static_bytes_per_sequence(path_config, length + self.room, dtype, kv_dtype)
                records.append({"model": path, "context": length,
                                "kv_cache_dtype": str(kv_dtype or dtype).removeprefix("torch."),
                                "bytes_per_sequence": per_sequence,
                                "largest_batch": largest_batch(total, fixed, per_sequence)
                                if total is not None and fixed is not None else None})
        return records


def machine_facts(device: torch.device) -> dict:
    import transformers

    facts = {"device": device_name(device), "torch": torch.__version__, "transformers": transformers.__version__}
    if device.type == "cuda":
        facts["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        facts["cuda"] = torch.version.cuda
        try:
            import triton

            facts["triton"] = triton.__version__
        except ImportError:
            pass
    return facts


def machine_tag(name: str) -> str:
    """The short name result files carry: the accelerator's model ("h100" of "NVIDIA H100 80GB HBM3", "a100" of
    "NVIDIA A100-SXM4-80GB"), else the name's last word ("cpu")."""
    model = re.search(r"\b([A-Z]+\d{2,4}[A-Z]?)\b", name)
    return (model.group(1) if model else name.split()[-1]).lower()


def dense_weight_bytes(model, original) -> dict | None:
    """{"nha": ..., "original": ...}: the bytes of each model's parameters, which a dense model's decode step reads
    once per step; None for a mixture of experts (a step reads only the experts its tokens are routed to)."""
    if hasattr(model.config, "num_experts"):
        return None
    return {name: sum(p.numel() * p.element_size() for p in m.parameters()) for name, m in (("nha", model),
                                                                                        ("original", original))}


def speedups(latency: list[dict], baselines, weight_bytes: dict | None = None) -> list[dict]:
    """Per context: NHA's prefill and decode speed-up against the fastest baseline that fits (named). With
    `weight_bytes` ({"nha": ..., "original": ...}: what a dense model's step reads besides its cache), the decode
    speed-up's bound from the bytes each step reads: (original's weights + the baseline's cache) / (NHA's weights +
    NHA's cache)."""
    records = []
    for length in sorted({r["context"] for r in latency}):
        rows = [r for r in latency if r["context"] == length and r["fits"]]
        nha = next((r for r in rows if r["model"] == NHA), None)
        record = {"context": length}
        for key in TIMED:
            candidates = [r for r in rows if r["model"] in baselines and r.get(key) is not None]
            if nha is None or not candidates:
                continue
            fastest = min(candidates, key=lambda r: r[key])
            record[key] = {"baseline": fastest["model"], "baseline_ms": fastest[key], "nha_ms": nha[key],
                           "speedup": fastest[key] / nha[key]}
            if key == "decode_ms_per_token" and weight_bytes:
                record[key]["bytes_bound"] = ((weight_bytes["original"] + fastest["cache_bytes"])
                                              / (weight_bytes["nha"] + nha["cache_bytes"]))
        records.append(record)
    return records


def batch_speedups(throughput: list[dict], largest: list[dict], baseline: str) -> list[dict]:
    """Per batch context: NHA's best decode tokens per second (at any batch that fits) against the baseline's, and
    both largest batches."""
    records = []
    for length in sorted({r["context"] for r in throughput}):
        best = {name: max((r["tokens_per_s"] for r in throughput if r["model"] == name and r["context"] == length
                           and r["fits"]), default=None) for name in (NHA, baseline)}
        if None in best.values():
            continue
        batches = {r["model"]: r["largest_batch"] for r in largest if r["context"] == length}
        records.append({"context": length, "baseline": baseline, "nha_tokens_per_s": best[NHA],
                        "baseline_tokens_per_s": best[baseline], "speedup": best[NHA] / best[baseline],
                        "nha_largest_batch": batches.get(NHA), "baseline_largest_batch": batches.get(baseline)})
    return records


def baseline_warnings(latency: list[dict], graph_paths) -> list[str]:
    """A line per context where one of the original's graph paths decodes slower than its eager steps: that path is
    not at its best (a broken capture, a recompiling graph), and a speed-up against it would be flattering."""
    warnings = []
    for length in sorted({r["context"] for r in latency}):
        rows = {r["model"]: r for r in latency if r["context"] == length and r.get("decode_ms_per_token")}
        eager = rows.get(EAGER)
        for path in graph_paths:
            if eager is not None and path in rows and rows[path]["decode_ms_per_token"] > eager["decode_ms_per_token"]:
                warnings.append(f"at context {length}, the original's path '{path}' decodes at "
                                f"{rows[path]['decode_ms_per_token']:.2f} ms per token, slower than its eager steps "
                                f"({eager['decode_ms_per_token']:.2f}): that baseline is not at its best")
    return warnings


def run_benchmark(model, *, contexts, decode_steps: int = 16, rounds: int = 3, batch_sizes=(), batch_contexts=None,
                  longest: bool = False, compile_original: bool = True, kv_cache: str = "auto",
                  token_source: Path | None = None, progress: bool = False) -> dict:
    """Every measurement of `model` (an NHA model in eval mode) against its original: latency and memory per context
    at batch 1, decode throughput per batch size at `batch_contexts` (default: every context), the longest context
    (with `longest`). Returns the report (see `report.py`)."""
    check_options(model.config.max_position_embeddings, contexts, decode_steps, rounds, batch_sizes, batch_contexts,
                  kv_cache)
    contexts = sorted(contexts)
    batch_contexts = sorted(contexts if batch_contexts is None else batch_contexts) if batch_sizes else []
    from tqdm.auto import tqdm


    total = 2 * (rounds + 1) * len(contexts) + 2 * len(batch_contexts) * len(batch_sizes)
    with tqdm(total=total, desc="bench", unit="run", disable=not progress) as bar:
        bench = Bench(model, decode_steps=decode_steps, rounds=rounds, token_source=token_source,
                      compile_original=compile_original, kv_cache_dtype=kv_cache_dtype(kv_cache),
                      progress=bar.update)
        latency, throughput, largest = [], [], []
        for length in contexts:
            keep = length in batch_contexts
            latency += bench.latency(length, keep=keep)
            if keep:
                for record in bench.throughput(length, sorted(batch_sizes)):
                    (largest if "largest_batch" in record else throughput).append(record)
        longest_records = bench.longest_context(latency) if longest else []
    return {
        "machine": machine_facts(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(bench.nha.kv_cache_dtype or model.dtype).removeprefix("torch."),
        "windows": list(model.config.nha_windows),
        "num_slots": model.config.nha_num_slots,
        "paths": bench.paths,
        "baselines": bench.baselines,
        "throughput_baseline": EVERY_WINDOW_FULL,
        "decode_steps": decode_steps,
        "rounds": rounds,
        "round_order": "alternating: NHA first in rounds 1, 3, ..., the original first in rounds 2, 4, ...",
        "latency": latency,
        "speedups": speedups(latency, bench.baselines, dense_weight_bytes(model, bench.original.model)),
        "warnings": baseline_warnings(latency, bench.graph_baselines),
        "throughput": throughput,
        "largest_batch": largest,
        "batch_speedups": batch_speedups(throughput, largest, EVERY_WINDOW_FULL),
        "memory_accounting": bench.memory_accounting(latency, batch_contexts or contexts),
        "longest_context": longest_records,
    }
