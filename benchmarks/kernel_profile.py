"""NHA forward + backward at the Llama-3-8B attention shape under a profiler (GPU).

Default: warms up (compiles every kernel), then runs one forward + backward inside a CUDA profiler range, so
Nsight Compute captures each kernel launch once:

    ncu --clock-control none --profile-from-start off --set full --import-source yes \
        -o prof python3 benchmarks/kernel_profile.py --T 32768
    ncu --import prof.ncu-rep --page details --csv > details.csv

`--kernel-times N`: GPU time per kernel over N forward + backward steps (torch.profiler), no Nsight needed.
`--host N`: the host's share: milliseconds per step the Python side takes to enqueue a forward + backward
(no synchronization inside; valid while the GPU keeps up, i.e. at short T) against the GPU's milliseconds per
step, then a cProfile of N steps (where the host time goes: Triton's launcher, PyTorch ops, autograd), each
Triton kernel's launch time, and the top-level PyTorch ops per step with their host time.
`--timeline N`: where the GPU idles within a step: over N steps (torch.profiler's kernel intervals), each step's span,
the time some kernel runs (intervals on every stream joined) and the idle gaps between kernels, the largest named.
`--forward-only`: the steps are inference forwards (no gradients: `chunk_fwd.inference_chunk`, no states kept).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ops import D, HQ, host_us, nha_inputs  # noqa: E402

from nha_retrofit.ops.nha.chunk import nha_attention_triton as nha_attention  # noqa: E402


def host_profile(step, n, label):
    """Host (enqueue) time against GPU time per step, then the top of a cProfile over n steps."""
    import cProfile
    import pstats

    from triton.testing import do_bench

    host_ms = host_us(step, n)[0] / 1e3
    gpu_ms = do_bench(step, warmup=5, rep=50, return_mode="median")
    print(f"# {label}: host {host_ms:.3f} ms per step to enqueue, {gpu_ms:.3f} ms per step end to end (median)")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    launch_costs(step, n)
    torch_ops(step, n)


def launch_costs(step, n):
    """Host time of each Triton kernel's launches per step (`launch.launch`, which every launch goes through,
    wrapped with a timer in each kernel module; Triton's own path costs more the more arguments it specializes)."""
    import collections
    import time

    from nha_retrofit.ops.nha import fused_recurrent
    from nha_retrofit.ops.nha.kernels import chunk_bwd_slots, chunk_bwd_window, chunk_fwd, chunk_scan, chunk_states
    from nha_retrofit.ops.utils import launch as fast_launch

    modules = (chunk_bwd_slots, chunk_bwd_window, chunk_fwd, chunk_scan, chunk_states, fused_recurrent)
    times = collections.defaultdict(list)
    launch = fast_launch.launch

    def timed(kernel, *args, **kwargs):
        start = time.perf_counter()
        launch(kernel, *args, **kwargs)
        times[kernel.fn.__name__].append(time.perf_counter() - start)

    for module in modules:
        module.launch = timed
    try:
        for _ in range(n):
            step()
    finally:
        for module in modules:
            module.launch = launch
    torch.cuda.synchronize()
    for name, ts in sorted(times.items(), key=lambda item: -sum(item[1])):
        print(f"launch {name:24s} {len(ts) // n} per step, median {sorted(ts)[len(ts) // 2] * 1e6:6.1f} us, "
              f"{sum(ts) / n * 1e6:7.1f} us per step")
    print(f"# Triton launches: {sum(map(sum, times.values())) / n * 1e3:.3f} ms of host time per step")


def torch_ops(step, n):
    """The aten ops a step calls (not those an aten op calls inside itself), counted and timed on the host per
    step."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    counts, times = collections.Counter(), collections.Counter()
    for event in prof.events():
        parent = event.cpu_parent
        if event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            counts[event.name] += 1
            times[event.name] += event.cpu_time_total
    print(f"# top-level aten ops per step ({sum(counts.values()) / n:.0f} calls, "
          f"{sum(times.values()) / n / 1e3:.3f} ms of host time):")
    for name, count in counts.most_common():
        print(f"op {name:48s} {count / n:5.1f} per step, {times[name] / n:7.1f} us per step")


def timeline(step, n, top=12):
    """Print each step's GPU span, busy time and idle time (kernel intervals of all streams joined), then the
    largest idle gaps with the kernels before and after them."""
    from torch.profiler import ProfilerActivity, profile

    cuda, label = torch.autograd.DeviceType.CUDA, "nha step"  # (the label also shows as a CUDA range: not a kernel)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            torch.cuda.synchronize()
            with torch.profiler.record_function(label):  # the range ends after the step's kernels
                step()
                torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == cuda and e.name != label)
    steps = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.name == label and e.device_type != cuda)
    spans = [[k for k in kernels if first <= k[0] <= last] for first, last in steps]
    gaps = []
    for ks in spans[1:] or spans:  # the first step may still warm caches
        busy, idle, end = 0.0, 0.0, ks[0][0]
        previous = ks[0][2]
        for start, stop, name in ks:
            if start > end:
                idle += start - end
                gaps.append((start - end, previous, name))
            busy += max(0.0, stop - max(start, end))
            if stop > end:
                end, previous = stop, name
        print(f"# step: span {(end - ks[0][0]) / 1e3:.3f} ms, kernels running {busy / 1e3:.3f} ms, "
              f"idle {idle / 1e3:.3f} ms over {len(ks)} kernels")
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"gap {gap:7.1f} us after {before[:60]:60s} before {after[:60]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--kernel-times", type=int, default=0, metavar="N")
    ap.add_argument("--host", type=int, default=0, metavar="N")
    ap.add_argument("--timeline", type=int, default=0, metavar="N")
    ap.add_argument("--forward-only", action="store_true")
    args = ap.parse_args()
    x = nha_inputs(args.T, True)
    leaves = [x[n] for n in ("q", "k", "v", "q_rope", "k_rope", "log_alpha", "slot_bias")]
    do = torch.randn(1, args.T, HQ, D, device="cuda", dtype=torch.bfloat16)

    def step():
        if args.forward_only:
            with torch.no_grad():
                nha_attention(*leaves[:6], args.window, D**-0.5, None, leaves[6])
            return
        o = nha_attention(*leaves[:6], args.window, D**-0.5, None, leaves[6])
        torch.autograd.grad(o, leaves, do)

    step()
    torch.cuda.synchronize()
    if args.host:
        host_profile(step, args.host, f"T={args.T}, w={args.window}")
        return
    if args.timeline:
        timeline(step, args.timeline)
        return
    if args.kernel_times:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.kernel_times):
                step()
            torch.cuda.synchronize()
        kind = "inference forward" if args.forward_only else "forward + backward"
        print(f"# T={args.T}, w={args.window}: {args.kernel_times} {kind} steps (totals)")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))
        return
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
