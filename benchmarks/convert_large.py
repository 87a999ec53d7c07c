"""Memory-lean conversion of a real-size checkpoint: wall time and peak RSS of `nha-retrofit convert`.

Builds a checkpoint with the shapes of Meta-Llama-3-8B (random bf16 weights, the Hub's 4-shard layout and
index), then runs the CLI in a child process that reports its own peak RSS (VmHWM of its address space: unlike
getrusage's maxrss, it is not inherited from the parent across fork and exec).
Usage: python benchmarks/convert_large.py [--workdir /tmp/nha-bench] [--keep]
Writes benchmarks/results/convert_<name>.json. `write_checkpoint` also writes Qwen3-30B-A3B's layout (experts stored
one by one, as on the Hub), for benchmarks/train_large.py.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nha_retrofit.bench.random_weights import NAMED_CONFIGS  # noqa: E402

LLAMA3_8B = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001, attention_bias=False, mlp_bias=False,
)


def llama_tensors(config):
    """(name, shape) of every tensor, in the order the Hub checkpoint stores them."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    yield "model.embed_tokens.weight", (v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "self_attn.q_proj.weight", (h, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "mlp.gate_proj.weight", (i, h)
        yield p + "mlp.up_proj.weight", (i, h)
        yield p + "mlp.down_proj.weight", (h, i)
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


QWEN3_30B_A3B = NAMED_CONFIGS["qwen3-30b-a3b"]  # the published config, as `bench --random-weights` takes it


def qwen3_moe_tensors(config):
    """(name, shape) of every tensor of a Qwen3-MoE checkpoint as the Hub stores it (one tensor per expert)."""
    h, v, e = config["hidden_size"], config["vocab_size"], config["moe_intermediate_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (v, h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "self_attn.q_norm.weight", (d,)
        yield p + "self_attn.k_norm.weight", (d,)
        yield p + "mlp.gate.weight", (config["num_experts"], h)
        for expert in range(config["num_experts"]):
            yield p + f"mlp.experts.{expert}.gate_proj.weight", (e, h)
            yield p + f"mlp.experts.{expert}.up_proj.weight", (e, h)
            yield p + f"mlp.experts.{expert}.down_proj.weight", (h, e)
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


TENSORS = {"llama": llama_tensors, "qwen3_moe": qwen3_moe_tensors}


def write_checkpoint(folder: Path, config: dict, shards: int = 4, device: str = "cpu"):
    """Random bf16 weights (normal, std 0.02; norms too) of `config`'s shapes in `shards` safetensors files with
    the Hub's index; drawn on `device` (a GPU draws 8B values in well under a second)."""
    folder.mkdir(parents=True)
    tensors = list(TENSORS[config["model_type"]](config))
    sizes = [torch.Size(shape).numel() * 2 for _, shape in tensors]
    budget = sum(sizes) / shards
    groups, current, used = [], [], 0
    for (name, shape), size in zip(tensors, sizes):
        if current and used + size > budget and len(groups) < shards - 1:
            groups.append(current)
            current, used = [], 0
        current.append((name, shape))
        used += size
    groups.append(current)
    weight_map, generator = {}, torch.Generator(device).manual_seed(0)
    for index, group in enumerate(groups):
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {name: (torch.randn(shape, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()
                 for name, shape in group}
        save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        del shard
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text(json.dumps(config))


def run_cli(args: list[str], env: dict | None = None) -> tuple[float, float]:
    """`nha-retrofit ARGS` in a child process: (wall seconds, the child's own peak RSS in GB)."""
    child = (
        "import sys; from nha_retrofit.cli import app\n"
        "try:\n    app(sys.argv[1:], prog_name='nha-retrofit')\n"
        "except SystemExit as done:\n    assert not done.code, done.code\n"
        "peak = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
        "print('PEAK_KB', peak)"
    )
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", child, *args], check=True, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    print(run.stdout)
    return wall, int(run.stdout.split("PEAK_KB")[-1].split()[0]) * 1024 / 1e9


def machine() -> str:
    return (f"{platform.node()}: {os.cpu_count()} cores, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/nha-bench"))
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint for another run")
    args = parser.parse_args()
    source, output = args.workdir / "llama3-8b-shape", args.workdir / "llama3-8b-shape-nha"
    if not source.exists():
        start = time.perf_counter()
        write_checkpoint(source, LLAMA3_8B)
        print(f"wrote the source checkpoint in {time.perf_counter() - start:.0f} s")
    shutil.rmtree(output, ignore_errors=True)
    wall, peak_rss_gb = run_cli(["convert", str(source), "--full-layers", "4", "-o", str(output)])
    size_gb = sum(p.stat().st_size for p in output.glob("*.safetensors")) / 1e9
    result = {
        "model": "Meta-Llama-3-8B shapes, random bf16, 4 Hub shards", "plan": "4 full layers, w=64, M=64",
        "wall_s": round(wall, 1), "peak_rss_gb": round(peak_rss_gb, 2), "output_gb": round(size_gb, 2),
        "targets": {"wall_s": 120, "peak_rss_gb": 3}, "machine": machine(), "date": time.strftime("%Y-%m-%d"),
        "load_average_1m": os.getloadavg()[0],
    }
    print(json.dumps(result, indent=2))
    Path(__file__).parent.joinpath("results", "convert_llama3_8b.json").write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(output, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(source, ignore_errors=True)


if __name__ == "__main__":
    main()
