"""The one-token read of a static cache (full layers and full KV heads) on one GPU: the shipped grouped matmuls
(`nha_cache.attend_stored`) against two forms through PyTorch's scaled_dot_product_attention with the real-token mask,
its native GQA (`enable_gqa`) and each KV head's query heads as that head's query positions (equal head counts, no
GQA), each under the SDPA backends a decode step allows (`modeling_nha._DECODE_SDPA_BACKENDS`: flash, memory-efficient,
math; cuDNN's SDPA plans anew for every key length) and under every backend, and against FlexAttention's decoding
kernel (compiled, native GQA, the mask as a score_mod), and against the Triton split-KV read that a float8 cache
takes (`ops/stored_attention`). An SDPA form with `enable_gqa` and a mask falls back to the
math kernel, which copies every key and value once per query head, unless cuDNN takes it: timed alone with every
backend it read 32K positions of 8 kv heads in 58 us against the grouped matmuls' 102, and inside the decode step it
took 1.8 ms per full layer (docs/benchmarks.md). So a form is judged in the step, not alone.

Alone: each read captured in a CUDA graph (ten reads per replay), as a decode step replays it; 4 query heads per kv
head, head dim 128, bf16, batch 1; 1 / 4 / 8 kv heads (a layer's full heads, or a full layer of Llama-3-8B) at 4K and
32K positions; each form's largest difference from the grouped matmuls. `--in-step`: each form as the cache read of
Llama-3-8B's decode step (random bf16 weights, batch 1, CUDA graph), with 5 full layers and with 40 full KV heads in
11 layers (`PLANS`); ms per token, and each form's first-step logits against the grouped matmuls'. Medians and ranges
over rounds in alternating order. Writes benchmarks/results/stored_read[_in_step]_<gpu>.json.

    python benchmarks/stored_read.py [--kv-heads 1,4,8] [--lengths 4096,32768] [--rounds 5]
    python benchmarks/stored_read.py --in-step --lengths 32768 --rounds 3 [--plans layers5]
        [--forms grouped_matmuls,flex_attention]
"""

import argparse
import functools
import json
import os
import statistics
import sys
from unittest import mock

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from nha_retrofit.bench.engine import machine_tag  # noqa: E402
from nha_retrofit.modeling.modeling_nha import _DECODE_SDPA_BACKENDS  # noqa: E402
from nha_retrofit.modeling.nha_cache import attend_stored  # noqa: E402
from nha_retrofit.ops.stored_attention import split_kv_stored_attention  # noqa: E402
from nha_retrofit.plan import PlanSpec  # noqa: E402

GROUPS, HEAD_DIM = 4, 128
# --in-step plans on Llama-3-8B's 32 layers: 5 whole layers evenly (random weights cannot be probed), and 40 full KV
# heads grouped 3-4 to a layer in 11 layers, as the retrieval probe groups SmolLM2-135M's strongest heads
HEADS_IN_11_LAYERS = ([(layer, head) for layer in (6, 7, 9, 15, 16, 18, 19) for head in range(4)]
                      + [(layer, head) for layer in (21, 22, 23, 24) for head in range(3)])
PLANS = {"layers5": PlanSpec(select="even"), "heads40in11": PlanSpec(full_kv_head_ids=HEADS_IN_11_LAYERS)}
READS_PER_REPLAY, REPLAYS = 10, 20


def sdpa_enable_gqa(query, keys, values, real, scale):
    """[B, 1, HQ, D] against [B, H, L, D]: SDPA's native GQA."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), keys, values, attn_mask=real[:, None, None, :], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def sdpa_heads_as_queries(query, keys, values, real, scale):
    """[B, H, G, D] against [B, H, L, D]: a KV head's G query heads as its G query positions."""
    batch, _, q_heads, head_dim = query.shape
    grouped = query.reshape(batch, keys.shape[1], q_heads // keys.shape[1], head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, attn_mask=real[:, None, None, :],
                                                           scale=scale)
    return out.reshape(batch, 1, q_heads, values.shape[-1])


def flex_decode(query, keys, values, real, scale):
    """[B, 1, HQ, D] against [B, H, L, D]: FlexAttention (compiled on CUDA: its split-KV decoding kernel for one query
    position), native GQA; the unfilled and padded positions masked in a score_mod that reads `real` as it is at each
    replay (a block mask would fix which blocks are read when it is built)."""
    def masked(score, batch, head, query_index, key_index):
        return torch.where(real[batch, key_index], score, -float("inf"))

    attend = _compiled_flex() if query.is_cuda else flex_attention
    out = attend(query.transpose(1, 2), keys, values, score_mod=masked, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


EVERY_BACKEND = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]


def under(backends, read):
    """`read` with SDPA limited to `backends` (inside the decode step too, which sets its own)."""
    def limited(*args):
        with sdpa_kernel(backends):
            return read(*args)
    return limited


FORMS = {"grouped_matmuls": attend_stored}
for _name, _read in (("sdpa_enable_gqa", sdpa_enable_gqa), ("sdpa_heads_as_queries", sdpa_heads_as_queries)):
    FORMS[f"{_name}:decode_backends"] = under(_DECODE_SDPA_BACKENDS, _read)
    FORMS[f"{_name}:every_backend"] = under(EVERY_BACKEND, _read)
FORMS["flex_attention"] = flex_decode
FORMS["split_kv_triton"] = split_kv_stored_attention  # the float8 cache's read, here on the bf16 cache


def graphed(read, args):
    """A CUDA graph of READS_PER_REPLAY reads, after a warm-up on a side stream (as graph capture needs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            read(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(READS_PER_REPLAY):
            read(*args)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def microseconds_per_read(graph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * READS_PER_REPLAY)


def time_alone(args) -> dict:
    """Each form alone, captured in a CUDA graph: microseconds per read at each KV head count and length."""
    forms = {name: FORMS[name] for name in args.forms.split(",")}
    generator = torch.Generator(device="cuda").manual_seed(0)
    copy_source = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    copy_graph = graphed(lambda: copy_source.clone(), ())
    bandwidth = 2 * copy_source.numel() / (microseconds_per_read(copy_graph) * 1e-6)  # read + write, bytes/s
    records = []
    for kv_heads in map(int, args.kv_heads.split(",")):
        for length in map(int, args.lengths.split(",")):
            def draw(*shape):
                return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16)

            query = draw(1, 1, kv_heads * GROUPS, HEAD_DIM)
            keys, values = draw(1, kv_heads, length, HEAD_DIM), draw(1, kv_heads, length, HEAD_DIM)
            real = torch.ones(1, length, dtype=torch.bool, device="cuda")
            real[:, -7:] = False  # the unfilled tail of a static cache
            args_ = (query, keys, values, real, HEAD_DIM**-0.5)
            reference = attend_stored(*args_).float()
            differences = {name: (form(*args_).float() - reference).abs().max().item()
                           for name, form in forms.items()}
            graphs = {name: graphed(form, args_) for name, form in forms.items()}
            times = {name: [] for name in forms}
            for round_index in range(args.rounds):
                order = list(forms) if round_index % 2 == 0 else list(reversed(forms))
                for name in order:
                    times[name].append(microseconds_per_read(graphs[name]))
            cache_bytes = 2 * keys.numel() * keys.element_size()
            for name, values_us in times.items():
                record = {"form": name, "kv_heads": kv_heads, "query_heads": kv_heads * GROUPS, "length": length,
                          "us": statistics.median(values_us), "us_range": [min(values_us), max(values_us)],
                          "cache_bytes": cache_bytes, "floor_us": cache_bytes / bandwidth * 1e6,
                          "max_abs_difference_from_grouped_matmuls": differences[name]}
                records.append(record)
                print(f"{name:38s} kv heads {kv_heads} length {length:6d}: {record['us']:7.1f} us "
                      f"[{record['us_range'][0]:.1f}, {record['us_range'][1]:.1f}], floor {record['floor_us']:.1f}")
    return {"groups": GROUPS, "head_dim": HEAD_DIM, "reads_per_replay": READS_PER_REPLAY,
            "copy_bandwidth_bytes_per_s": bandwidth, "records": records}


def time_in_step(args) -> dict:
    """Each form as the static cache's read inside the decode step of Llama-3-8B's shape (random bf16 weights, batch
    1, the shipped CUDA-graph path), under each plan: ms per token (`bench.timing.decode_arms`)."""
    from nha_retrofit.bench.decoders import NHA, StaticDecoder
    from nha_retrofit.bench.random_weights import NAMED_CONFIGS, random_nha_model
    from nha_retrofit.bench.timing import Clock, decode_arms, free_memory
    from nha_retrofit.modeling import nha_cache
    from nha_retrofit.plan import build_plan

    config = NAMED_CONFIGS["llama3-8b"]
    forms = {name: FORMS[name] for name in args.forms.split(",")}
    arms = {name: functools.partial(mock.patch.object, nha_cache, "attend_stored", form)
            for name, form in forms.items()}
    plans = {}
    for name in args.plans.split(","):
        plan = build_plan(config["num_hidden_layers"], PLANS[name], kv_heads=config["num_key_value_heads"])
        model = random_nha_model(config, plan, "cuda", torch.bfloat16)
        decoder, clock = StaticDecoder(NHA, model), Clock(model.device)
        records = []
        for length in map(int, args.lengths.split(",")):
            record = decode_arms(decoder, length, arms, args.rounds, args.steps, clock)
            records.append(record)
            for form in forms:
                print(f"{name} {length}: {form:38s} {record[form]['median']:6.2f} ms per token "
                      f"[{record[form]['min']:.2f}, {record[form]['max']:.2f}]")
        plans[name] = {"plan": plan.describe(), "contexts": records}
        del model, decoder
        free_memory(torch.device("cuda"))
    return {"model": "llama3-8b random bf16", "batch": 1, "steps": args.steps, "plans": plans}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-step", action="store_true", help="time the forms inside the decode step, per plan")
    parser.add_argument("--plans", default=",".join(PLANS), help="--in-step: comma-separated, of " + ", ".join(PLANS))
    parser.add_argument("--steps", type=int, default=64, help="--in-step: timed steps per round")
    parser.add_argument("--forms", default=",".join(FORMS), help="comma-separated, the first the reference "
                        "in the step, of " + ", ".join(FORMS))
    parser.add_argument("--kv-heads", default="1,4,8")
    parser.add_argument("--lengths", default="4096,32768")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if not set(args.forms.split(",")) <= set(FORMS):
        raise SystemExit(f"--forms: of {', '.join(FORMS)}")
    if not torch.cuda.is_available():
        raise SystemExit("stored_read.py times reads on a CUDA GPU")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bfloat16",
              "rounds": args.rounds, "round_order": "alternating: the forms in turn, reversed every other round",
              **(time_in_step(args) if args.in_step else time_alone(args))}
    scope = "_in_step" if args.in_step else ""
    path = os.path.join(args.out_dir, f"stored_read{scope}_{machine_tag(result['device'])}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
