"""Operator benchmark on one GPU: the NHA Triton kernel against SDPA causal, fla windowed attention and fla GSA.

Llama-3-8B attention shapes (HQ=32, H=8, D=128), batch 1, bf16, M=64; T = 2K..64K; forward and forward+backward
medians through triton.testing.do_bench (NHA also replayed from a CUDA graph, `nha_graph`: the GPU's time without
the host's launches); plus the decode step for 28 layers (eager and CUDA-graph replay) and
the bytes / FLOP floors. Writes benchmarks/results/ops_<gpu>.json (records {impl, T, window, mode, ms}; <gpu> the
card's model, e.g. h200) and benchmarks/results/ops_<gpu>.md.

    python benchmarks/ops.py [--lengths 2048,4096,...] [--out-dir benchmarks/results]
    python benchmarks/ops.py --parts --skip nha_graph,sdpa,fla_window,fla_gsa,decode   # each stage at 32K
    python benchmarks/ops.py --merge run.json gsa.json --out-dir D   # one table from two runs

fla's columns need fla-core and einops (on a machine without network: `pip download fla-core einops --no-deps -d
.whl` beside it, then `pip install --no-index --no-deps --target /tmp/fla-site .whl/*.whl` there and /tmp/fla-site on
PYTHONPATH). fla's GSA tunes for ~5 minutes on first use: run it once alone first (`--skip
nha,nha_graph,sdpa,fla_window,decode --lengths 32768`), so the full table finds its tuned kernels.
"""

import argparse
import json
import os
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from nha_retrofit.ops.nha.chunk import nha_attention_triton as nha_attention  # noqa: E402
from nha_retrofit.ops.nha.fused_recurrent import nha_recurrent_step_triton  # noqa: E402
from nha_retrofit.ops.nha.state import NHAState  # noqa: E402
from nha_retrofit.bench.engine import machine_tag  # noqa: E402

HQ, H, D, M, B = 32, 8, 128, 64, 1
BW = 4.3e12  # device-to-device copy, bytes read + written (KINDS.md, H200)
MMA = 7.9e14  # bf16 matrix product on random data (KINDS.md, H200)


def floors(T, w, mode):
    """(bytes floor ms, FLOP floor ms) for the NHA operator."""
    el = 2
    bytes_fwd = el * (2 * T * HQ * D + 3 * T * H * D + T * H * M + T * HQ * D)  # q, q_rope, k, k_rope, v, gates, o
    flops_fwd = 4 * T * HQ * min(w, T) * D + 4 * T * HQ * M * D + 4 * T * H * M * D
    if mode == "fwd":
        b, f = bytes_fwd, flops_fwd
    else:  # backward reads inputs, o, dO and writes every gradient: about 2.5x; 2.5x the FLOPs
        b, f = bytes_fwd * 3.5, flops_fwd * 3.5
    return b / BW * 1e3, f / MMA * 1e3


def nha_inputs(T, requires_grad):
    g = torch.Generator(device="cuda").manual_seed(T)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    x = dict(q=r(B, T, HQ, D), k=r(B, T, H, D), v=r(B, T, H, D), q_rope=r(B, T, HQ, D), k_rope=r(B, T, H, D),
             log_alpha=(F.logsigmoid(r(B, T, H, M).float() * 3) / 8).to(torch.bfloat16),
             slot_bias=torch.full((HQ,), -4.0, device="cuda"))
    for t in x.values():
        t.requires_grad_(requires_grad)
    return x


def bench(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def host_us(fn, calls):
    """(host us per call, wall us per call) of `calls` back-to-back calls, after a warm-up: the host's share is the
    time to enqueue them (valid while the GPU keeps up)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * host / calls, 1e6 * (time.perf_counter() - start) / calls


def graph_replay_ms(step):
    """Median ms of `step` captured in one CUDA graph and replayed: the GPU's own time, without the host's."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compilation, allocator) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return bench(graph.replay)


def run_nha(T, w, mode, graphed=False):
    """NHA forward (no grad) or forward+backward; `graphed`: the CUDA-graph replay time (no host overhead)."""
    x = nha_inputs(T, mode != "fwd")
    args = [x[n] for n in ("q", "k", "v", "q_rope", "k_rope", "log_alpha")]
    do = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    leaves = args + [x["slot_bias"]]

    def step():
        with torch.set_grad_enabled(mode != "fwd"):
            o = nha_attention(*args, w, D**-0.5, None, x["slot_bias"])
            return o if mode == "fwd" else torch.autograd.grad(o, leaves, do)

    return graph_replay_ms(step) if graphed else bench(step)


def run_sdpa(T, mode):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, HQ, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    if mode == "fwd":
        with torch.no_grad():
            return bench(f)
    for t in (q, k, v):
        t.requires_grad_(True)
    do = torch.randn(B, HQ, T, D, device="cuda", dtype=torch.bfloat16)
    return bench(lambda: torch.autograd.grad(f(), (q, k, v), do))


def run_fla_window(T, w, mode):
    from fla.ops.attn.parallel import parallel_attn

    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    f = lambda: parallel_attn(q, k, v, scale=D**-0.5, window_size=w)  # noqa: E731
    if mode == "fwd":
        with torch.no_grad():
            return bench(f)
    for t in (q, k, v):
        t.requires_grad_(True)
    do = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    return bench(lambda: torch.autograd.grad(f(), (q, k, v), do))


def run_fla_gsa(T, mode):
    from fla.ops.gsa import chunk_gsa

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    f_ = torch.randn(B, T, H, M, device="cuda", dtype=torch.bfloat16, generator=g)
    s = (1 - F.logsigmoid(f_.float()).exp()).to(torch.bfloat16)
    gg = (F.logsigmoid(f_.float()) / 8).to(torch.bfloat16)
    f = lambda: chunk_gsa(q, k, v, s, gg, scale=D**-0.5)[0]  # noqa: E731
    if mode == "fwd":
        with torch.no_grad():
            return bench(f)
    for t in (q, k, v, s, gg):
        t.requires_grad_(True)
    do = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
    return bench(lambda: torch.autograd.grad(f(), (q, k, v, s, gg), do))


def decode_layers(layers, window, device="cuda"):
    """`layers` NHA layers' decode inputs, batch 1: (states with a full window and filled slots, one token each,
    the slot bias, an all-ones attention mask)."""
    g = torch.Generator(device=device).manual_seed(4)
    r = lambda *s: torch.randn(*s, device=device, generator=g, dtype=torch.bfloat16)  # noqa: E731
    states, tokens = [], []
    for _ in range(layers):
        st = NHAState(
            slot_keys=torch.randn(B, H, M, D, device=device, generator=g),
            slot_values=torch.randn(B, H, M, D, device=device, generator=g),
            slots_filled=torch.ones(B, dtype=torch.bool, device=device),
            window_keys=r(B, window, H, D), window_keys_rope=r(B, window, H, D), window_values=r(B, window, H, D),
            window_log_alpha=F.logsigmoid(torch.randn(B, window, H, M, device=device, generator=g)) / 8,
            window_mask=torch.ones(B, window, dtype=torch.bool, device=device),
        )
        states.append(st)
        tokens.append(dict(q=r(B, 1, HQ, D), k=r(B, 1, H, D), v=r(B, 1, H, D), q_rope=r(B, 1, HQ, D),
                           k_rope=r(B, 1, H, D), log_alpha=(F.logsigmoid(r(B, 1, H, M).float()) / 8)))
    bias = torch.full((HQ,), -4.0, device=device)
    mask = torch.ones(B, window + 1, dtype=torch.long, device=device)
    return states, tokens, bias, mask


def decode_step(step_fn, states, tokens, bias, mask, window):
    """One decode step of every layer through `step_fn` (a `nha_recurrent_step_triton`): the outputs."""
    return [step_fn(**tok, window=window, scale=D**-0.5, state=st, attention_mask=mask, slot_bias=bias)[0]
            for st, tok in zip(states, tokens)]


def run_decode(layers=28, window=64):
    """Per-token time of the decode step for `layers` NHA layers (full window, filled slots), batch 1: eager and
    graph-replayed. Each step updates the states in place (the ring's oldest entry absorbed and overwritten), so
    a replay is a real generation step, state update included."""
    states, tokens, bias, mask = decode_layers(layers, window)

    def step():
        return decode_step(nha_recurrent_step_triton, states, tokens, bias, mask, window)

    step()
    torch.cuda.synchronize()
    return bench(step), graph_replay_ms(step)


def parts(T=32768, w=64):
    """Time each stage of the NHA kernel path separately (forward stages, window backward, slot backward)."""
    from nha_retrofit.ops.nha.kernels import chunk_fwd, chunk_states
    from nha_retrofit.ops.nha.kernels.chunk_bwd_slots import slot_backward_triton
    from nha_retrofit.ops.nha.kernels.chunk_bwd_window import window_dkv, window_dq
    from nha_retrofit.ops.nha.kernels.chunk_inputs import Prepared
    from nha_retrofit.ops.nha.kernels.settings import state_segment

    x = nha_inputs(T, False)
    prepare = lambda window, training=False: Prepared(  # noqa: E731
        x["q"], x["k"], x["v"], x["q_rope"], x["k_rope"], x["log_alpha"], window, None, x["slot_bias"], training)
    p = prepare(w)  # the forward stages as inference runs them
    out = {}
    out["prepare"] = bench(lambda: prepare(w))
    segment = state_segment(p.nch, p.settings)  # the inference forward's states: segment-local, or scanned whole
    states_of = (lambda q: chunk_states.local_kv_states(q, segment)) if segment else chunk_states.kv_states
    out["kv_states"] = bench(lambda: states_of(p))
    out["fused fwd, window only"] = bench(lambda: chunk_fwd.forward(p, D**-0.5, False))
    out["fwd total (states + fused)"] = bench(lambda: chunk_fwd.forward(p, D**-0.5, True))
    for window, q in ((w, p), (0, prepare(0))):  # the fused kernel alone: its states computed once, outside
        states = states_of(q)
        with mock.patch.object(chunk_fwd, "local_kv_states" if segment else "kv_states",
                               lambda *args, **kwargs: states):
            out[f"fused fwd alone, w={window}"] = bench(lambda: chunk_fwd.forward(q, D**-0.5, True))
    p = prepare(w, True)  # the backward stages as training runs them
    out["fwd total, training chunks"] = bench(lambda: chunk_fwd.forward(p, D**-0.5, True))
    o, lse, states, residual = chunk_fwd.forward(p, D**-0.5, True)
    do = torch.randn_like(o)
    delta = torch.empty_like(lse)
    out["window dq, delta formed"] = bench(lambda: window_dq(p, do, lse, delta, D**-0.5, (o, residual)))
    out["slot bwd"] = bench(lambda: slot_backward_triton(p, do, lse, delta, D**-0.5, states, delta_whole=True))
    out["window dkv"] = bench(lambda: window_dkv(p, do, lse, delta, D**-0.5))
    for k, v in out.items():
        print(f"parts T={T} w={w}: {k:28s} {v:8.3f} ms", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,4096,8192,16384,32768,65536")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--skip", default="", help="comma list of impls to skip")
    ap.add_argument("--gsa-lengths", default="8192,32768")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which fla_gsa is skipped")
    ap.add_argument("--parts", action="store_true", help="also time each stage at T=32K")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="time nothing: merge these runs' records (later files win for the same impl, T, window, "
                    "mode; e.g. a separate fla_gsa run) into --out-dir, for --device")
    ap.add_argument("--device", default="NVIDIA H200", help="the machine named in a --merge table")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.merge:
        merge_runs(args.merge, args.out_dir, lengths, args.device)
        return
    skip = set(args.skip.split(",")) if args.skip else set()
    try:
        import fla  # noqa: F401
    except ImportError:
        print("fla not importable: fla_window and fla_gsa skipped", flush=True)
        skip |= {"fla_window", "fla_gsa"}
    records = []

    def save():  # after every measurement: a run killed by a time limit keeps what it measured
        os.makedirs(args.out_dir, exist_ok=True)
        device = torch.cuda.get_device_name()
        stem = os.path.join(args.out_dir, f"ops_{machine_tag(device)}")
        with open(stem + ".json", "w") as f:
            json.dump(records, f, indent=1)
        md = table(records, lengths, device)
        with open(stem + ".md", "w") as f:
            f.write(md)
        return md

    def record(impl, T, window, mode, fn):
        if impl in skip:
            return
        try:
            ms = fn()
        except Exception as exc:  # noqa: BLE001 - a missing baseline must not stop the run
            print(f"{impl} T={T} w={window} {mode}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            ms = None
        records.append(dict(impl=impl, T=T, window=window, mode=mode, ms=ms))
        print(f"{impl:12s} T={T:6d} w={str(window):5s} {mode:7s} {ms if ms is None else round(ms, 3)}", flush=True)
        save()
        torch.cuda.empty_cache()

    t_start = time.time()
    if args.parts:
        for k, v in parts().items():
            records.append(dict(impl="part: " + k, T=32768, window=64, mode="part", ms=v))
    for T in lengths:
        for mode in ("fwd", "fwd+bwd"):
            for w in (64, 512):
                record("nha", T, w, mode, lambda: run_nha(T, w, mode))
            # the same step replayed from a CUDA graph: the GPU's time alone (short sequences are host-bound)
            record("nha_graph", T, 64, mode, lambda: run_nha(T, 64, mode, graphed=True))
            record("sdpa", T, None, mode, lambda: run_sdpa(T, mode))
            for w in (64, 512):
                record("fla_window", T, w, mode, lambda: run_fla_window(T, w, mode))
            for w in (64, 512):
                fb, ff = floors(T, w, mode)
                records.append(dict(impl="floor_bytes", T=T, window=w, mode=mode, ms=fb))
                records.append(dict(impl="floor_flops", T=T, window=w, mode=mode, ms=ff))
    for w in [] if "decode" in skip else (64, 512, 2048):  # the step's cost grows with the window it reads
        eager, graphed = run_decode(window=w)
        records.append(dict(impl="nha_decode_28L_eager", T=None, window=w, mode="decode", ms=eager))
        records.append(dict(impl="nha_decode_28L_graph", T=None, window=w, mode="decode", ms=graphed))
        save()
        print(f"decode 28 layers, w={w}: eager {eager:.3f} ms, graph replay {graphed:.3f} ms")
    # fla's GSA autotunes many kernels on first use (minutes): last, and only while time is left
    for T in [t for t in lengths if str(t) in args.gsa_lengths.split(",") and "fla_gsa" not in skip]:
        for mode in ("fwd", "fwd+bwd"):
            if time.time() - t_start > args.deadline:
                print(f"fla_gsa T={T} {mode}: skipped (deadline)")
                continue
            record("fla_gsa", T, 64, mode, lambda: run_fla_gsa(T, mode))
    print(f"bench wall {time.time() - t_start:.0f} s")
    print(save())


def merge_runs(paths, out_dir, lengths, device):
    """Write the records of several runs as one ops_<gpu>.json / .md (later files win for the same key)."""
    merged = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f):
                merged[(r["impl"], r["T"], r["window"], r["mode"])] = r
    records = list(merged.values())
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"ops_{machine_tag(device)}")
    with open(stem + ".json", "w") as f:
        json.dump(records, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table(records, lengths, device))


def table(records, lengths, device):
    get = {(r["impl"], r["T"], r["window"], r["mode"]): r["ms"] for r in records}
    cols = [("nha", 64), ("nha", 512), ("nha_graph", 64), ("sdpa", None), ("fla_window", 64), ("fla_window", 512),
            ("fla_gsa", 64), ("floor_bytes", 64), ("floor_flops", 64)]
    fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    lines = [f"# NHA operator benchmark ({device}, bf16, HQ=32 H=8 D=128 M=64, batch 1, median ms)", "",
             "fwd+bwd (fwd in brackets)", "",
             "| T | " + " | ".join(f"{i} w={w}" if w else i for i, w in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for T in lengths:
        cells = [f"{fmt(get.get((i, T, w, 'fwd+bwd')))} ({fmt(get.get((i, T, w, 'fwd')))})" for i, w in cols]
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
    extra = [r for r in records if r["impl"].startswith("part: ")]
    if extra:
        lines += ["", "Stages at T=32K, w=64:", ""]
        lines += [f"- {r['impl']} T={r['T']} {r['mode']}: {fmt(r['ms'])} ms" for r in extra]
    dec = [r for r in records if r["mode"] == "decode"]
    if dec:
        lines += ["", "Decode step, 28 layers (Llama-3-8B attention shape), batch 1, M=64:", ""]
        lines += [f"- {r['impl']} w={r['window']}: {r['ms']:.3f} ms" for r in dec]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
