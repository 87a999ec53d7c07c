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
