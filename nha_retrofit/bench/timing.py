"""How the bench times and sizes a run: wall-clock milliseconds with the device drained, peak device memory, decode
steps fed back on the device, out-of-memory sizes recorded as such, and medians with their range over rounds."""

import gc
import statistics
import time

import torch


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


def decode_ms_per_step(step, cache, token, start: int, steps: int, clock: Clock, warm_steps: int) -> float:
    """Mean ms of `steps` greedy one-token steps `step(cache, token, positions)` after `warm_steps` untimed ones (the
    tokens are fed back on the device, as generate does, with no host sync between steps)."""
    positions = torch.full((token.shape[0], 1), start, dtype=torch.long, device=token.device)

    def run(count):
        nonlocal token
        for _ in range(count):
            token = step(cache, token, positions)
            positions.add_(1)

    run(warm_steps)
    _, ms = clock(lambda: run(steps))
    return ms / steps


ARM_WARM_STEPS = 8  # untimed steps before each timed round of `decode_arms`


def decode_arms(decoder, length: int, arms: dict, rounds: int, steps: int, clock: Clock, log=print) -> dict:
    """One context's decode under each of `arms` ({name: a function returning a context manager that changes the
    step}), batch 1, on `decoder`'s path (a CUDA graph on CUDA), in alternating order: an untimed round first (each
    arm compiles and captures on a fresh prefill, and its first step's logits are kept), then `rounds` timed rounds
    of `steps` steps after a fresh prefill each. {"context", "rounds" (ms per step), each arm's `spread`, and
    "first_step_logits": each arm's against the first arm's}."""
    from ..modeling.decoding import one_token_step

    model = decoder.model
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=model.device)
    names = list(arms)
    times, first = {name: [] for name in names}, {}
    for round_index in range(rounds + 1):
        for name in names if round_index % 2 else names[::-1]:
            free_memory(model.device)
            with arms[name]():
                cache, token = decoder.prefill(ids, steps + ARM_WARM_STEPS)
                if round_index == 0:
                    start = time.perf_counter()
                    positions = torch.full((1, 1), length, dtype=torch.long, device=model.device)
                    first[name] = one_token_step(model, token, positions, cache).logits.float()
                    log(f"{length}: {name} first step (compile, capture) {time.perf_counter() - start:.1f} s")
                else:
                    times[name].append(decode_ms_per_step(decoder.step, cache, token, length, steps, clock,
                                                           ARM_WARM_STEPS))
            del cache
    reference = first[names[0]]
    record = {"context": length, "rounds": times, **{name: spread(times[name]) for name in names}}
    record["first_step_logits"] = {
        name: {"max_abs_difference": (first[name] - reference).abs().max().item(),
               "max_abs": reference.abs().max().item(),
               "same_argmax": bool((first[name].argmax(-1) == reference.argmax(-1)).all())}
        for name in names[1:]}
    return record


def fits(fn, device: torch.device):
    """(fn(), True), or (None, False) when it ran out of device memory (freed again). Running out while a CUDA
    graph is instantiated raises a plain `torch.AcceleratorError`, not `torch.OutOfMemoryError`."""
    try:
        return fn(), True
    except (torch.OutOfMemoryError, torch.AcceleratorError) as error:
        if not isinstance(error, torch.OutOfMemoryError) and "out of memory" not in str(error):
            raise
        free_memory(device)
        return None, False


def spread(values) -> dict:
    """The median of a measurement's rounds and its range: {"median", "min", "max"}."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
