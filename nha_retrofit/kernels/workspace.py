"""Device buffers that kernels share from one launch to the next."""

import torch

_COUNTERS = {}  # (device, stream) -> int32 zeros


def counters(device, size):
    """At least `size` int32 zeros on `device` for the current stream, for kernels that count or signal in them and
    leave them at zero when they finish (the decode step's completion counters, the chained scan's tickets and
    flags): launches on one stream run one after the other, so they can share them, without a zero fill per launch
    (`torch.zeros`: ~50 us of host time each on the H200's host, under cProfile). Another stream gets its own."""
    # the raw stream handle, as Triton's launcher reads it (torch.cuda.current_stream builds a Stream object: ~10 us)
    key = (device, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else None)
    buffer = _COUNTERS.get(key)
    if buffer is None or buffer.numel() < size:
        buffer = _COUNTERS[key] = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
    return buffer
