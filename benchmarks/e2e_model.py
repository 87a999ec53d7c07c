"""End-to-end check of the model path on CUDA: a converted Llama-3-8B-shaped NHA model (random bf16 weights)
runs forward+backward at 8K tokens through the Triton kernels and through the plain-PyTorch chunked form; the
logits and gradients must agree within bf16 tolerance (random weights; on a converted model's real weights two bf16
paths drift apart far more, so `real_weights_check.py` measures each against fp32 instead). Also times prefill and
cached decode, beside the original Llama's eager decode with the same weights on its dynamic cache (PyTorch's choice
among every SDPA backend, native grouped-query attention), in rounds alternating in order with NHA's.

Usage (GPU machine): PYTHONPATH=. python benchmarks/e2e_model.py [--layers 8] [--tokens 8192]
Writes benchmarks/results/e2e_model_<gpu>.json (the card's model, e.g. h200). With --memory it only prints the peak
memory of a training step with and without gradient checkpointing; with --decode only the alternating decode rounds
(--profile: where their host time goes); neither writes the file.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nha_retrofit.bench.engine import machine_tag
from nha_retrofit.modeling.configuration_nha import NHALlamaConfig
from nha_retrofit.modeling.decoding import one_token_step, prefill
from nha_retrofit.ops import KERNELS_AVAILABLE
from nha_retrofit.modeling.modeling_nha import NHALlamaForCausalLM


def llama3_8b_config(layers: int) -> NHALlamaConfig:
    full = {layers // 8 * i + layers // 16 for i in range(4)} if layers >= 8 else {0}
    return NHALlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        nha_windows=[None if i in full else 64 for i in range(layers)], nha_num_slots=64,
    )


def build_on_gpu(model_class, config):
    """The model built on the GPU in bf16 (no multi-GB CPU initialisation)."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return model_class(config)
    finally:
        torch.set_default_dtype(torch.float32)


def timed(fn, repeats=3):
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return result, sorted(times)[len(times) // 2]


def train_attention_only(model):
    """Only attention trains (the paper's setting): keeps memory small."""
    for layer in model.model.layers:
        for name, param in layer.named_parameters():
            param.requires_grad_(name.startswith("self_attn."))
    model.model.embed_tokens.requires_grad_(False)
    model.lm_head.requires_grad_(False)


def forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if "self_attn" in n and p.grad is not None}
    return out.logits.float(), grads


def decode_ms_per_token(model, ids, steps=20):
    """Median eager ms of one cached decode step after a prefill of `ids` (model, cache and sampling overheads
    included, as `generate` would pay them; batch 1)."""
    times = []
    with torch.no_grad():
        cache, _ = prefill(model, ids)
        token = ids[:, -1:]
        for step in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            one_token_step(model, token, torch.full_like(token, ids.shape[1] + step), cache)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[steps // 2]


def decode_rounds(model, original, ids, rounds):
    """{"NHA": [...], "original": [...]}: `rounds` measurements of each (`decode_ms_per_token`), NHA first in odd
    rounds and the original first in even ones, so both see the same host noise (this host's eager decode varies by
    up to 2x between runs)."""
    out = {"NHA": [], "original": []}
    for index in range(rounds):
        for name in ("NHA", "original") if index % 2 == 0 else ("original", "NHA"):
            out[name].append(decode_ms_per_token(model if name == "NHA" else original, ids))
    return out


def ratios(rounds):
    return [a / b for a, b in zip(rounds["NHA"], rounds["original"])]


def profile_decode_step(model, ids, name, steps=10):
    """torch.profiler's table of 10 eager decode steps, by self CPU time: where the host time goes."""
    with torch.no_grad():
        cache, _ = prefill(model, ids)
        token = ids[:, -1:]
        positions = torch.full_like(token, ids.shape[1])
        one_token_step(model, token, positions, cache)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for step in range(steps):
                one_token_step(model, token, positions + 1 + step, cache)
            torch.cuda.synchronize()
    print(f"== {name}: {steps} decode steps, host time by op")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def original_model(model):
    """The original Llama with `model`'s weights (NHA's gate projections and slot offsets dropped)."""
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rope_parameters")
    config = LlamaConfig(**{name: getattr(model.config, name) for name in fields})
    original = build_on_gpu(LlamaForCausalLM, config).eval()
    loaded = original.load_state_dict(model.state_dict(), strict=False)
    assert not loaded.missing_keys, loaded.missing_keys
    return original


def peak_training_gib(model, ids, checkpointing):
    """Peak GPU memory (GiB above what is allocated before) of one forward + backward, with or without gradient
    checkpointing as the trainer enables it (`use_reentrant=False`)."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(ids, labels=ids, use_cache=False).loss.backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30
    finally:
        model.gradient_checkpointing_disable()
        model.zero_grad(set_to_none=True)


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--memory", action="store_true",
                        help="only print the peak memory of a training step with and without gradient checkpointing")
    parser.add_argument("--decode", action="store_true",
                        help="only print the eager decode ms/token, NHA against the original")
    parser.add_argument("--rounds", type=int, default=5, help="alternating decode rounds of 20 steps, NHA and original")
    parser.add_argument("--profile", action="store_true",
                        help="with --decode: also print where the host time of 10 decode steps goes (torch.profiler)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_on_gpu(NHALlamaForCausalLM, llama3_8b_config(args.layers))
    train_attention_only(model)
    ids = torch.randint(0, 128256, (1, args.tokens), device="cuda")
    assert KERNELS_AVAILABLE, "Triton kernels did not import"
    if args.memory:
        for checkpointing in (True, False):
            peak_training_gib(model, ids, checkpointing)  # compiles and warms the allocator
            print(f"tokens={args.tokens} checkpointing={checkpointing}: peak "
                  f"{peak_training_gib(model, ids, checkpointing):.2f} GiB above the weights")
        return
    if args.decode:
        original = original_model(model)
        rounds = decode_rounds(model, original, ids, args.rounds)
        print(f"decode ms/token, {args.layers} layers, {args.tokens}-token prompt, rounds: " + "; ".join(
            f"{name} {', '.join(f'{x:.2f}' for x in ms)}" for name, ms in rounds.items()))
        print("ratio NHA / original per round: " + ", ".join(f"{x:.3f}" for x in ratios(rounds)))
        if args.profile:
            profile_decode_step(model, ids, "NHA")
            profile_decode_step(original, ids, "original")
        return

    os.environ["NHA_RETROFIT_KERNELS"] = "all"  # training and prefill through the chunk kernels
    (kernel_logits, kernel_grads), kernel_s = timed(lambda: forward_backward(model, ids))
    os.environ["NHA_RETROFIT_KERNELS"] = "0"  # the same model through the plain-PyTorch chunked form
    (torch_logits, torch_grads), torch_s = timed(lambda: forward_backward(model, ids), repeats=1)
    os.environ["NHA_RETROFIT_KERNELS"] = "all"

    grad_errors = {n: relative(kernel_grads[n], torch_grads[n]) for n in torch_grads}
    worst = max(grad_errors, key=grad_errors.get)
    with torch.no_grad():
        _, prefill_s = timed(lambda: model(ids, use_cache=True))
    original = original_model(model)  # the same weights without the NHA parts: every layer full attention
    rounds = decode_rounds(model, original, ids, args.rounds)
    result = {
        "machine": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
        "tokens": args.tokens, "windows": model.config.nha_windows,
        "logits_rel_err": relative(kernel_logits, torch_logits), "worst_grad": worst,
        "worst_grad_rel_err": grad_errors[worst],
        "fwd_bwd_s_kernels": kernel_s, "fwd_bwd_s_pytorch": torch_s, "prefill_s": prefill_s,
        "decode_ms_per_token_eager": statistics.median(rounds["NHA"]),
        "original_decode_ms_per_token_eager": statistics.median(rounds["original"]),
        "decode_ratio_per_round": [round(x, 3) for x in ratios(rounds)],
    }
    print(json.dumps(result, indent=2))
    ok = result["logits_rel_err"] < 2e-2 and result["worst_grad_rel_err"] < 5e-2
    print("AGREE" if ok else "DISAGREE")
    folder = Path(os.environ.get("OUT") or Path(__file__).parent / "results")  # $OUT: another output folder
    (folder / f"e2e_model_{machine_tag(result['machine'])}.json").write_text(json.dumps(result, indent=2) + "\n")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
