"""Host time of the eager decode step (batch 1 is host-bound: the GPU waits on launches), on the GPU machine.

Prints, in one process:
- 28 layers' eager decode steps (ms), windows 64 and 2048, with and without an attention mask; with --previous,
  alternating with another version of `nha_retrofit/ops/nha/fused_recurrent.py` (e.g. one taken from git history),
  so both see the same host noise;
- 28 layers' eager steps the way the model calls them, alternating: the gate (float, logsigmoid, divide) and the
  slot bias's cast in PyTorch before the step against the step given the gate logits and tau and a bf16 slot bias
  (the gate applied in the kernel);
- one step alone, the gate's ops (`g_proj`, float, logsigmoid, divide) and a full layer's cache concatenation +
  SDPA at 8K keys (native grouped-query attention, PyTorch's choice among every backend; us of host time per call):
  the parts of an NHA layer's decode against a full layer's.

Usage: PYTHONPATH=. python benchmarks/decode_host.py [--previous old_fused_recurrent.py] [--repeats 4]
(e.g. `git show REV:nha_retrofit/ops/nha/fused_recurrent.py > /tmp/old_fused_recurrent.py`)
"""

import argparse
import importlib.util
import statistics

import torch
import torch.nn.functional as F

from ops import HQ, D, H, M, B, decode_layers, decode_step, host_us
from nha_retrofit.ops.nha import fused_recurrent as decode
from nha_retrofit.ops.nha.gates import gate_log_alpha


def load_previous(path):
    """`path` (a fused_recurrent.py) as a module of the operator's package, so its relative imports resolve."""
    spec = importlib.util.spec_from_file_location("nha_retrofit.ops.nha.fused_recurrent_previous", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gate_routes(args, layers=28, window=64, tau=8.0):
    """Eager ms of `layers` decode steps (w=64, masked, bf16 slot bias): the gate in PyTorch, or in the step."""
    states, tokens, bias, mask = decode_layers(layers, window)
    bias = bias.bfloat16()  # a bf16 model's parameter
    logits = [torch.randn(B, 1, H, M, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    step = decode.nha_recurrent_step_triton

    def in_pytorch():
        for st, tok, f in zip(states, tokens, logits):
            step(**dict(tok, log_alpha=gate_log_alpha(f, tau)), window=window, scale=D**-0.5, state=st,
                 attention_mask=mask, slot_bias=bias.float())

    def in_step():
        for st, tok, f in zip(states, tokens, logits):
            step(**dict(tok, log_alpha=f), window=window, scale=D**-0.5, state=st, attention_mask=mask,
                 slot_bias=bias, gate_normalizer=tau)

    runs = {"gate in PyTorch": [], "gate in the step": []}
    for _ in range(args.repeats):
        for name, fn in zip(runs, (in_pytorch, in_step)):
            runs[name].append(host_us(fn, args.steps)[1] / 1e3)
    for name, ms in runs.items():
        print(f"{layers} layers eager, w={window}, mask yes, {name}: median {statistics.median(ms):.3f} ms "
              f"({', '.join(f'{x:.3f}' for x in ms)})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--previous", help="another decode.py to time against, alternating")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    versions = {"current": decode}
    if args.previous:
        versions["previous"] = load_previous(args.previous)

    for window in (64, 2048):
        states, tokens, bias, ones = decode_layers(28, window)
        for mask in (None, ones):
            runs = {name: [] for name in versions}
            for _ in range(args.repeats):
                for name, module in versions.items():
                    step = lambda: decode_step(module.nha_recurrent_step_triton, states, tokens, bias, mask, window)  # noqa: E731
                    runs[name].append(host_us(step, args.steps)[1] / 1e3)
            for name, ms in runs.items():
                print(f"28 layers eager, w={window}, mask {'yes' if mask is not None else 'no'}, {name}: median "
                      f"{statistics.median(ms):.3f} ms ({', '.join(f'{x:.3f}' for x in ms)})", flush=True)

    gate_routes(args)
    states, tokens, bias, _ = decode_layers(1, 64)
    for name, module in versions.items():
        step = lambda: decode_step(module.nha_recurrent_step_triton, states, tokens, bias, None, 64)  # noqa: E731
        print(f"one step alone, w=64, {name}: host {host_us(step, 300)[0]:.1f} us")
    x = torch.randn(B, 1, 4096, device="cuda", dtype=torch.bfloat16)
    gate = torch.nn.Linear(4096, H * M, bias=False, device="cuda", dtype=torch.bfloat16)
    print(f"gate ops: host {host_us(lambda: F.logsigmoid(gate(x).view(B, 1, H, M).float()) / 8, 300)[0]:.1f} us")
    q, k, v = (torch.randn(B, heads, 1, D, device="cuda", dtype=torch.bfloat16) for heads in (HQ, H, H))
    cache_k, cache_v = (torch.randn(B, H, 8192, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def full_layer():
        keys, values = torch.cat([cache_k, k], 2), torch.cat([cache_v, v], 2)
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    print(f"full layer's cache concatenation + SDPA, 8K keys: host {host_us(full_layer, 100)[0]:.1f} us")


if __name__ == "__main__":
    main()
