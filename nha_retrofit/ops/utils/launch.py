"""Kernel launches with less host time than `kernel[grid](...)`, and the device buffers launches share.

Triton's launch path re-derives the kernel's specialization from every argument on every call (binding, the
alignment and value checks of each argument, the cache key), then calls the compiled kernel's launcher: 40-86 us
per launch in Triton 3.6 on an H200's host, against 0.1-0.3 ms of GPU time for the training step's kernels at
T = 4K, so a short step is host-bound. `launch` keeps the compiled kernel Triton returns per call signature and calls
its launcher directly. The signature holds all that Triton specializes on, and finer: the current device, the launch
options, each tensor's dtype and address mod 16, each runtime int's classes (int32 / int64 / uint64 range, whether
it is 1, whether 16 divides it), each runtime float's type, and every other argument (constexprs, keyword arguments,
bools, None) by value. So a launch whose ints change on every call (the decode step's growing mask stride, another
sequence length) reuses its kernel as Triton's own cache would.

A signature seen for the first time goes through Triton's own path, which compiles or finds the kernel; so does
every launch under the CPU interpreter, and while a launch hook is set (profilers such as proton use them).

A launch whose kernel needs more shared memory than the device has runs with one software-pipelining stage fewer
(down to 1; the same results, slower): each stage holds another copy of a loop's tiles in shared memory, and how
much depends on the compiler (Triton 3.6 gave the merged slot-backward key kernel 240 KB at 64-token chunks, over
the H200's 227 KB, where Triton 3.9 needed 104 KB), so the launch settings cannot rule it out beforehand.
"""

import logging
import math

import torch
import triton

try:
    from triton.compiler.compiler import CompiledKernel
except ImportError:  # pragma: no cover - a Triton without it takes the plain path
    CompiledKernel = None
try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover
    OutOfResources = ()

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton calls: a Stream object costs ~20 us
if _raw_stream is None:  # pragma: no cover
    def _raw_stream(device):
        return torch.cuda.current_stream(device).cuda_stream

MAX_SIGNATURES = 1024  # per process; past it the cache starts over (training with many sequence lengths)
_compiled = {}
_constexpr_positions = {}  # kernel -> the positions of its constexpr parameters (keyed by value when positional)
_stages_that_fit = {}  # (kernel, keyword arguments) -> the num_stages its launches take instead of the asked-for


def cdiv(a, b):
    """triton.cdiv for host code: Triton's is a constexpr function, 2.3-2.7 us per host call."""
    return -(-a // b)


def next_power_of_2(n):
    """triton.next_power_of_2 for host code (see `cdiv`): the smallest power of 2 >= n, for n >= 1."""
    return 1 << max(n - 1, 0).bit_length()


def _signature(kernel, device, args, kwargs):
    """The cache key of one call: everything Triton's specialization reads from it, and finer. (Built inline: at
    ~30 arguments per launch, a helper call per argument would cost as much as the launch.)"""
    constexprs = _constexpr_positions.get(kernel)
    if constexprs is None:
        constexprs = _constexpr_positions[kernel] = frozenset(
            i for i, param in enumerate(kernel.params) if param.is_constexpr)
    return (kernel, device,
            tuple((a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor)
                  else (int, a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63)
                  if type(a) is int and i not in constexprs
                  else float if type(a) is float and i not in constexprs
                  else (type(a), a) for i, a in enumerate(args)),
            tuple((name, type(value), value) for name, value in kwargs.items()))


def _hooked():
    """Whether a launch hook is set (Triton 3.6+ keeps each as a chain of calls, empty unless a tool adds one)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return True
    hooks = (getattr(runtime, name, None) for name in ("launch_enter_hook", "launch_exit_hook"))
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


def _fitting(kernel, grid, args, kwargs):
    """(kernel[grid](*args, **kwargs), the keyword arguments it ran with): one pipelining stage fewer while it needs
    more shared memory than the device has, remembered for the later launches with these keyword arguments."""
    asked = kwargs
    while True:
        try:
            return kernel[grid](*args, **kwargs), kwargs
        except OutOfResources as exc:
            stages = kwargs.get("num_stages", 1)
            if exc.name != "shared memory" or stages <= 1:
                raise
            kwargs = dict(kwargs, num_stages=stages - 1)
            _stages_that_fit[(kernel, tuple(asked.items()))] = stages - 1
            logging.getLogger(__name__).info("%s: %s; launched with %d stages", getattr(kernel, "__name__", kernel),
                                             exc, stages - 1)


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs), through the kept compiled kernel where its signature was seen."""
    if _stages_that_fit:  # (empty unless a launch overflowed the shared memory)
        stages = _stages_that_fit.get((kernel, tuple(kwargs.items())))
        kwargs = kwargs if stages is None else dict(kwargs, num_stages=stages)
    if CompiledKernel is None or not torch.cuda.is_available() or _hooked():
        _fitting(kernel, grid, args, kwargs)
        return
    device = torch.cuda.current_device()
    key = _signature(kernel, device, args, kwargs)
    entry = _compiled.get(key)
    if entry is None:
        compiled, ran = _fitting(kernel, grid, args, kwargs)
        if ran is not kwargs:  # (with fewer stages: the key later launches find after `_stages_that_fit`)
            kwargs, key = ran, _signature(kernel, device, args, ran)
        names = kernel.arg_names[len(args):]
        complete = all(name in kwargs for name in names)  # (a parameter left to its default: the plain path)
        if isinstance(compiled, CompiledKernel) and complete:
            if len(_compiled) >= MAX_SIGNATURES:
                _compiled.clear()  # (no per-hit bookkeeping, and safe beside launches from other threads)
            _compiled[key] = compiled, names
        return
    compiled, names = entry
    grid = tuple(grid) + (1,) * (3 - len(grid))
    stream = _raw_stream(device)
    # the launcher takes every parameter in order, the constexprs included (it skips them), as Triton's own call
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *(kwargs[name] for name in names))


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


_CONSTANTS = {}  # (value, dtype, device) -> the fill buffers handed out so far, the largest last


def constant(shape, value, dtype, device):
    """A read-only tensor of `shape` filled with `value`: a view of one cached buffer per (value, dtype, device), so
    a step without a mask or a slot bias launches no fill kernels (each costs ~20 us of host time). A buffer
    outgrown is kept, since a captured CUDA graph may still read it; during capture the fill is fresh (the cache
    must not hand out memory of the graph's private pool)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.full(shape, value, dtype=dtype, device=device)
    n = math.prod(shape)
    buffers = _CONSTANTS.setdefault((value, dtype, device), [])
    if not buffers or buffers[-1].numel() < n:
        buffers.append(torch.full((max(n, 2 * buffers[-1].numel() if buffers else 4096),), value, dtype=dtype,
                                  device=device))
    return buffers[-1][:n].view(shape)
