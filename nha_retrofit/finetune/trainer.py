"""The finetuning loop (accelerate): stages, checkpoints, resume, evaluation, metrics, export.

Works the same in one process (CPU or GPU) and under `accelerate launch` (DDP, FSDP2, DeepSpeed ZeRO-3). Every
process reads the same packed-block stream and takes its own slice of each global micro-batch, so the data
position is one number per run and resuming is exact. A checkpoint (trainable weights, optimizer, schedule, data
position, RNG states, the run's summary so far) is written into a temporary folder that is renamed `step-NNNNNNNN`
only when complete, with a SHA-256 for each of its files (`checkpoints`); older ones are removed after that, so a
failed save keeps the previous one, and a resume reads the newest one that verifies.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import platform
import shutil
import time
from pathlib import Path

import torch

from ..atomic import disk_failure
from ..checksums import write_checksums
from ..errors import NHARetrofitError
from . import stages
from .checkpoints import (deepspeed_state_classes, list_checkpoints, newest_verified, read_training_state,
                          weights_only_loading, write_training_state)
from .data import load_blocks
from .memory import GIB, project_memory
from .model import (count_parameters, fp32_except_frozen_matrices, frozen_matrices, load_model, meta_model,
                    model_config, resolve_source, select_trainable, trainable_in)
from .recipe import Recipe, load_recipe

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}


class RunState:
    """What a checkpoint holds besides accelerate's own files and the schedule (in `checkpoints.TRAINING_STATE`)."""

    def __init__(self, data):
        self.data = data
        self.step = 0
        self.tokens = 0
        self.elapsed_s = 0.0
        self.summary: dict = {}

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "elapsed_s": self.elapsed_s, "summary": self.summary,
                "data": self.data.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens, self.elapsed_s = state["step"], state["tokens"], state["elapsed_s"]
        self.summary = state["summary"]
        self.data.load_state_dict(state["data"])


def lr_lambda(recipe: Recipe, transfer_steps: int, lm_steps: int):
    """Absolute learning rate at a global step: each stage warms up and decays on its own."""
    t = recipe.train

    def at(step: int) -> float:
        if step < transfer_steps:
            peak, start, length = recipe.stages.attention_transfer.lr or t.lr, 0, transfer_steps
        else:
            peak, start, length = recipe.stages.lm.lr or t.lr, transfer_steps, lm_steps
        i = step - start
        warmup = min(t.warmup_steps, max(length - 1, 0))
        if i < warmup:
            return peak * (i + 1) / (warmup + 1)
        if t.schedule == "constant" or length - warmup <= 1:
            return peak
        progress = min((i - warmup) / (length - warmup - 1), 1.0)
        floor = t.min_lr_ratio
        if t.schedule == "linear":
            return peak * (1 - (1 - floor) * progress)
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

    return at


def machine_description() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads ({os.cpu_count()} cores)"


def _precision(value: str) -> str:
    if value == "auto":
        return "bf16" if torch.cuda.is_available() else "no"
    return {"fp32": "no"}.get(value, value)


def launch_sharding() -> str:
    """How `accelerate launch` shards this run, from its environment: "fsdp", "zero3" or "none" (one process, DDP;
    ZeRO stages 1-2 keep whole weights too)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "zero3" if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3") == "3" else "none"
    return "fsdp" if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" else "none"


def _sharding(acc) -> str:
    from accelerate.utils import DistributedType

    if acc.distributed_type == DistributedType.FSDP:
        return "fsdp"
    if acc.distributed_type == DistributedType.DEEPSPEED:
        return "zero3" if acc.state.deepspeed_plugin.zero_stage == 3 else "none"
    return "none"


def peak_memory_gib() -> float | None:
    """The most memory PyTorch has allocated on this process's GPU so far (None on CPU)."""
    return round(torch.cuda.max_memory_allocated() / GIB, 2) if torch.cuda.is_available() else None


def measured_peak_gib(folder: Path) -> float | None:
    """The highest peak of GPU memory a run in `folder` logged, if any."""
    path = folder / METRICS
    if not path.is_file():
        return None
    peaks = [json.loads(line).get("peak_gib") for line in path.read_text().splitlines() if line]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None


class NonFinite(Exception):
    """A loss or gradient norm that is not finite on some process (the run stops, saving the last good state)."""


class Run:
    """One finetuning run, from a validated recipe."""

    def __init__(self, recipe: Recipe, *, resume=False, overwrite=False, log=print):
        self.recipe, self.resume, self.overwrite, self.log = recipe, resume, overwrite, log
        self.out = Path(recipe.train.output_dir)
        self.checkpoints = self.out / CHECKPOINTS

    # ------------------------------------------------------------------------------------------------ planning
    def plan(self, accelerator_processes: int) -> dict:
        r = self.recipe
        self.source = resolve_source(r.model)
        self.config = model_config(self.source)
        dtype = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None)
        self.source_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype  # the checkpoint's
        limit = getattr(self.config, "max_position_embeddings", None)
        for key, length in (("data.seq_len", r.data.seq_len), ("data.long.seq_len", r.data.long.seq_len)):
            if limit is not None and length > limit:
                raise NHARetrofitError(
                    f"recipe key {key}: {length} exceeds the model's max_position_embeddings {limit}"
                )
        per_step = r.data.seq_len * r.train.batch_size * r.train.grad_accum * accelerator_processes
        self.tokens_per_step = per_step
        self.transfer_steps = math.ceil(r.stages.attention_transfer.tokens / per_step)
        self.lm_steps = math.ceil(r.stages.lm.tokens / per_step)
        self.long_steps = round(self.lm_steps * r.data.long.share) if r.data.long.seq_len else 0
        self.total_steps = self.transfer_steps + self.lm_steps
        return {
            "model": str(self.source.folder),
            "converted_on_the_fly": not self.source.converted,
            "full_layers": [i for i, w in enumerate(self.config.nha_windows) if w is None],
            "full_kv_heads": self.config.nha_full_kv_head_pairs,
            "windows": sorted({w for w in self.config.nha_windows if w is not None}),
            "processes": accelerator_processes,
            "tokens_per_step": per_step,
            "attention_transfer_steps": self.transfer_steps,
            "lm_steps": self.lm_steps,
            "long_block_steps": self.long_steps,
            "total_steps": self.total_steps,
            "total_tokens": self.total_steps * per_step,
        }

    def _check_sharding(self, sharding: str) -> None:
        if sharding == "zero3" and not self.source.converted:
            path = self.recipe.model.path
            raise NHARetrofitError(
                f"recipe key model.path: under DeepSpeed ZeRO-3 the weights are partitioned as they load, so {path} "
                f"cannot be converted on the fly; convert it first (nha-retrofit convert {path} -o FOLDER) and set "
                f"model.path to FOLDER and model.convert to null"
            )

    def _tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.source.folder)
        except (OSError, ValueError, TypeError) as error:
            raise NHARetrofitError(f"no usable tokenizer in {self.source.folder}: {str(error).splitlines()[0]}") from None

    def _check_output(self, log):
        existing = list_checkpoints(self.checkpoints)
        if self.resume:
            return newest_verified(self.checkpoints, log)
        if existing or (self.out / METRICS).exists():
            if not self.overwrite:
                raise NHARetrofitError(
                    f"{self.out} already holds a run; pass --resume to continue it or --overwrite to start again"
                )
        return None

    # ------------------------------------------------------------------------------------------------ memory
    def project_memory(self, model, processes: int, sharding: str) -> dict:
        """Projected GiB per process (`memory.py`) for `model` (a skeleton or the real model, trainable set applied)."""
        trainable, total = count_parameters(model)
        teacher = 0
        if sharding != "zero3":  # the originals of trained projections, kept for the teacher
            teacher = sum(p.numel() for n, p in model.named_parameters()
                          if p.requires_grad and not stages.is_gate_parameter(n) and "lora_" not in n)
        compute = {"fp32": torch.float32, "fp16": torch.float16}.get(self.recipe.train.precision, torch.bfloat16)
        lossless = self.source_dtype == compute  # `auto` projects a GPU's bf16
        low = sum(p.numel() for p in frozen_matrices(model)) if lossless else 0
        return project_memory(self.config, self.recipe, trainable, total, processes=processes, sharding=sharding,
                              teacher_values=teacher, low_precision_values=low, teacher_bytes=2 if lossless else 4)

    # ------------------------------------------------------------------------------------------------ dry run
    def dry_run(self) -> dict:
        from accelerate import PartialState

        state = PartialState()
        # under `accelerate launch` on CPUs the state may not join the launched processes: count those
        processes = max(state.num_processes, int(os.environ.get("WORLD_SIZE", "1")))
        plan = self.plan(processes)
        plan["sharding"] = launch_sharding()
        self._check_sharding(plan["sharding"])
        tokenizer = self._tokenizer()
        data = load_blocks(self.recipe.data, tokenizer, progress=state.is_main_process)
        skeleton = select_trainable(meta_model(self.source), self.recipe.train)
        trainable, total = count_parameters(skeleton)
        plan.update(trainable_parameters=trainable, total_parameters=total, data=data.describe())
        if data.train_tokens is not None:
            plan["epochs"] = round(plan["total_tokens"] / data.train_tokens, 3)
        plan["memory_per_gpu_gib"] = self.project_memory(skeleton, processes, plan["sharding"])
        try:
            self._check_output(self.log)
        except NHARetrofitError as refusal:
            if self.resume:
                raise
            plan["output_dir"] = str(refusal)  # a dry run writes nothing: it says what the real run will need
        measured = measured_peak_gib(self.out)
        if measured is not None:
            plan["measured_peak_gib"] = measured
        return plan

    # ------------------------------------------------------------------------------------------------ training
    def setup(self) -> RunState:
        """Everything before the first step: accelerator, data, model and trainable set, optimizer and schedule, the
        teacher's originals, the checkpoint hooks; resumes from the last checkpoint with `resume`."""
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, set_seed

        r = self.recipe
        if r.train.threads:
            torch.set_num_threads(r.train.threads)
        handlers = [DistributedDataParallelKwargs(find_unused_parameters=r.stages.attention_transfer.tokens > 0)]
        log_with = None
        if r.train.tensorboard:
            from accelerate.utils import is_tensorboard_available

            if not is_tensorboard_available():
                raise NHARetrofitError("recipe key train.tensorboard: install tensorboard (pip install tensorboard)")
            log_with = "tensorboard"
        with contextlib.suppress(AttributeError):  # a second run in one process may change the precision
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state()  # keeps PartialState (the process group)
        precision = _precision(r.train.precision)
        acc = Accelerator(mixed_precision=precision, kwargs_handlers=handlers, log_with=log_with,
                          gradient_accumulation_steps=r.train.grad_accum,
                          project_dir=str(self.out))
        self.acc = acc
        self.sharding = _sharding(acc)
        plan = self.plan(acc.num_processes)
        plan["sharding"] = self.sharding
        self._check_sharding(self.sharding)
        last = self._check_output(self.log if acc.is_main_process else lambda *_: None)
        if acc.is_main_process:
            self.log(f"plan: {json.dumps(plan)}")
        set_seed(r.train.seed)
        tokenizer = self._tokenizer()
        data = load_blocks(r.data, tokenizer, progress=acc.is_main_process)
        if acc.is_main_process:
            self.log(f"data: {data.describe()}")
        compute_dtype = _COMPUTE_DTYPES[precision]
        # frozen matrices stay in the compute dtype when the checkpoint holds them in it (nothing lost), else fp32
        model = load_model(self.source, compute_dtype if self.source_dtype == compute_dtype else torch.float32)
        if r.train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = select_trainable(model, r.train)
        if self.sharding == "zero3":  # DeepSpeed keeps its own fp32 master copy of the partitioned weights
            model = trainable_in(model, compute_dtype)
        else:
            model = fp32_except_frozen_matrices(model)
        trainable, total = count_parameters(model)
        plan["memory_per_gpu_gib"] = self.project_memory(model, acc.num_processes, self.sharding)
        if acc.is_main_process:
            self.log(f"trainable parameters: {trainable:,} of {total:,} ({r.train.trainable})")
            self.log(f"memory: projected {plan['memory_per_gpu_gib']['total']} GiB per process "
                     f"({json.dumps(plan['memory_per_gpu_gib'])})")
        # two parameter groups: what attention transfer trains (the gates), and what only the LM stage trains
        gates, rest = [], []
        for name, param in model.named_parameters():
            if param.requires_grad:
                (gates if stages.is_gate_parameter(name) else rest).append(param)
        groups = [{"params": params} for params in (gates, rest) if params]
        self.has_lm_only_params = bool(rest)
        if r.train.optimizer == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=1.0, betas=tuple(r.train.betas), weight_decay=r.train.weight_decay)
        else:
            optimizer = torch.optim.SGD(groups, lr=1.0, momentum=r.train.betas[0], weight_decay=r.train.weight_decay)
        schedule = lr_lambda(r, self.transfer_steps, self.lm_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        if acc.state.deepspeed_plugin is not None:  # no dataloader is prepared: tell DeepSpeed the batch geometry
            ds_config = acc.state.deepspeed_plugin.deepspeed_config
            ds_config["train_micro_batch_size_per_gpu"] = r.train.batch_size
            ds_config["gradient_clipping"] = r.train.max_grad_norm
        model, optimizer = acc.prepare(model, optimizer)
        unwrapped = acc.unwrap_model(model)
        from accelerate.utils import DistributedType

        # the teacher must stay the original: keep the original values of trained projections (before any resume).
        # ZeRO-3 keeps each parameter's values in a partition of its own, which the teacher cannot swap.
        self.teacher_exact = True
        if acc.distributed_type != DistributedType.DEEPSPEED:
            kept = stages.snapshot_teacher(unwrapped, None if precision == "no" else compute_dtype)
            if kept and acc.is_main_process:
                self.log(f"teacher: original values of {kept:,} trained parameters kept beside them")
        elif any(p.requires_grad and not stages.is_gate_parameter(n) and "lora_" not in n
                 for n, p in unwrapped.named_parameters()):
            self.teacher_exact = False
            if r.stages.lm.tokens and r.stages.lm.distill_weight > 0:
                raise NHARetrofitError(
                    f"recipe key stages.lm.distill_weight: under DeepSpeed the teacher (the original model) is "
                    f"exact only with train.trainable: lora or gates, not {r.train.trainable}"
                )
        run = RunState(data)
        trainable_names = {n for n, p in model.named_parameters() if p.requires_grad}

        def keep_trainable(models, weights, output_dir):  # checkpoints hold only what training changes
            for state in weights:
                for key in [k for k in state if k not in trainable_names]:
                    del state[key]

        acc.register_save_state_pre_hook(keep_trainable)
        self.model, self.unwrapped, self.optimizer, self.scheduler = model, unwrapped, optimizer, scheduler
        self.run, self.data = run, data

        if self.acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            for stale in self.checkpoints.glob(".tmp-*") if self.checkpoints.is_dir() else []:
                shutil.rmtree(stale, ignore_errors=True)
            if not self.resume:
                if self.checkpoints.exists():
                    shutil.rmtree(self.checkpoints)
                (self.out / METRICS).unlink(missing_ok=True)
        acc.wait_for_everyone()

        if last is not None:
            start = time.monotonic()
            # plain and DDP checkpoints hold only the trainable weights; FSDP / DeepSpeed write their own layouts
            try:
                deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
                with weights_only_loading(deepspeed_state_classes() if deepspeed else ()):
                    acc.load_state(str(last), **({} if self.sharding != "none" else {"strict": False}))
            except (OSError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as error:
                raise NHARetrofitError(f"cannot load checkpoint {last}: {str(error).splitlines()[0]}") from None
            state = read_training_state(last)
            run.load_state_dict(state["run"])
            scheduler.load_state_dict(state["scheduler"])
            saved = run.summary.get("plan", {})
            for key in ("tokens_per_step", "attention_transfer_steps", "long_block_steps"):
                if key in saved and saved[key] != plan[key]:
                    raise NHARetrofitError(
                        f"--resume: the run in {self.out} was started with {key} {saved[key]}, the recipe now gives "
                        f"{plan[key]} (batch size, accumulation, processes, seq_len, data.long or stage tokens changed)"
                    )
            run.summary["plan"] = plan
            self._truncate_metrics(run.step)
            self._write_metrics({"step": run.step, "resume_s": round(time.monotonic() - start, 2)})
            if acc.is_main_process:
                self.log(f"resumed from {last} (step {run.step}, {run.tokens:,} tokens)")
        else:
            run.summary = {"machine": machine_description(), "plan": plan, "trainable": self.recipe.train.trainable,
                           "trainable_parameters": trainable,
                           "total_parameters": total, "data": data.describe()}
        return run

    def train(self) -> RunState:
        run = self.setup()
        if not self.resume:
            if self.acc.is_main_process:
                self.log("eval: before training, the NHA model and the original")
            run.summary["before"] = self._evaluate(self.data, heldout=self.recipe.eval.before, original=True)
        if self.recipe.train.tensorboard:
            self.acc.init_trackers("finetune")
        self._loop(self.data, run)
        if self.recipe.train.tensorboard:
            self.acc.end_training()
        return run

    def _truncate_metrics(self, step: int):
        path = self.out / METRICS
        if self.acc.is_main_process and path.is_file():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
            path.write_text("".join(line + "\n" for line in kept))

    def _write_metrics(self, record: dict):
        if self.acc.is_main_process:
            with open(self.out / METRICS, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            if self.recipe.train.tensorboard:
                self.acc.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])

    def _evaluate(self, data, heldout: bool, original: bool = False) -> dict:
        """Held-out blocks (CE, KL to the teacher) and, when asked, the recipe's held-out texts."""
        from ..eval.perplexity import perplexity
        from ..eval.texts import load_heldout_tokens

        e, result, shown = self.recipe.eval, {}, self.acc.is_main_process
        with self.acc.autocast():
            if data.eval_blocks.shape[0]:
                result.update(stages.evaluate_blocks(self.unwrapped, data.eval_blocks, self.recipe.train.batch_size,
                                                     kl=self.teacher_exact, progress=shown))
                result["eval_ppl"] = math.exp(result["eval_ce"])
                if original:
                    teacher = stages.evaluate_blocks(self.unwrapped, data.eval_blocks, self.recipe.train.batch_size,
                                                     teacher=True, progress=shown)
                    result["original_eval_ppl"] = math.exp(teacher["eval_ce"])
            if heldout and e.heldout_texts:
                tokenizer = self._tokenizer()
                for name in e.heldout_texts:
                    ids = load_heldout_tokens(tokenizer, name, e.heldout_max_tokens)
                    kwargs = dict(chunk_len=e.heldout_chunk_len, max_tokens=e.heldout_max_tokens, progress=shown)
                    result[f"{name}_ppl"] = perplexity(self.unwrapped, ids, **kwargs)
                    if original:
                        with stages.teacher_mode(self.unwrapped):
                            result[f"{name}_original_ppl"] = perplexity(self.unwrapped, ids, **kwargs)
        if self.acc.is_main_process and result:
            self.log("eval: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()))
        return result

    def _all_finite(self, *values) -> bool:
        bad = torch.tensor([0.0 if all(math.isfinite(float(v)) for v in values) else 1.0], device=self.acc.device)
        return bool(self.acc.reduce(bad, reduction="sum").item() == 0)

    def stage_at(self, step: int) -> str:
        return "attention_transfer" if step < self.transfer_steps else "lm"

    def micro_batches(self, step: int) -> list[torch.Tensor]:
        """This process's blocks for each micro-step of optimizer step `step`: in the LM stage's last
        `long_block_steps`, fewer blocks of data.long.seq_len tokens (the same tokens per step)."""
        r = self.recipe
        long = step >= self.total_steps - self.long_steps
        world, rank = self.acc.num_processes, self.acc.process_index
        bs = r.train.batch_size // r.data.long_factor if long else r.train.batch_size
        return [self.data.next_blocks(world * bs, long)[rank * bs : (rank + 1) * bs].to(self.acc.device)
                for _ in range(r.train.grad_accum)]

    def optimizer_step(self, stage: str, batches: list[torch.Tensor]) -> dict:
        """One optimizer step of `stage` over this process's micro-batches: forward, backward and clipping through
        accelerate (accumulation, no_sync, loss scaling, DeepSpeed), the schedule's step. Returns the step's losses
        averaged over micro-steps and processes, the learning rate and the gradient norm. Raises NonFinite."""
        r, acc, lm = self.recipe, self.acc, self.recipe.stages.lm
        self.model.train()
        totals: dict = {}
        transfer = stage == "attention_transfer"
        grad_norm = lr = None
        acc.step = 0  # accelerate's micro-step counter: sync on this step's last micro-step, whatever happened before
        with stages.attention_transfer_mode(self.unwrapped) if transfer else \
                stages.long_position_transfer(self.unwrapped) if lm.transfer_weight > 0 else \
                contextlib.nullcontext(()) as modules:
            for blocks in batches:
                with acc.accumulate(self.model):
                    with acc.autocast():
                        if transfer:
                            loss, metrics = stages.attention_transfer_loss(
                                self.model, modules, blocks, through_outputs=self.sharding == "fsdp")
                        else:
                            loss, metrics = stages.lm_loss(
                                self.model, self.unwrapped, blocks, ce_weight=lm.ce_weight,
                                distill_weight=lm.distill_weight, temperature=lm.temperature,
                                transfer_weight=lm.transfer_weight, transfer_modules=modules,
                            )
                    if not self._all_finite(loss.item()):
                        raise NonFinite("loss")
                    acc.backward(loss)
                    metrics["loss"] = loss.item()
                    for key, value in metrics.items():
                        totals[key] = totals.get(key, 0.0) + value / len(batches)
                    if acc.sync_gradients and r.train.max_grad_norm > 0:
                        norm = acc.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                                                   r.train.max_grad_norm)
                        grad_norm = float(norm) if norm is not None else None
                        if grad_norm is not None and not self._all_finite(grad_norm):
                            raise NonFinite("gradient norm")
                    if acc.sync_gradients:
                        lr = self.scheduler.get_last_lr()[0]
                    self.optimizer.step()  # a no-op until the last micro-step
                    self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        record = {k: acc.reduce(torch.tensor(v, device=acc.device), reduction="mean").item()
                  for k, v in sorted(totals.items())}
        record["lr"] = lr
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        return record

    def _loop(self, data, run: RunState):
        from tqdm.auto import tqdm

        r, acc = self.recipe, self.acc
        bar = tqdm(total=self.total_steps, initial=run.step, desc="finetune", unit="step",
                   disable=not acc.is_main_process)
        start = time.monotonic() - run.elapsed_s
        last_saved = run.step if run.step else None
        while run.step < self.total_steps:
            stage = self.stage_at(run.step)
            if run.step == self.transfer_steps > 0:
                self._fresh_lm_only_state()
            data_at_start = data.state_dict()
            try:
                metrics = self.optimizer_step(stage, self.micro_batches(run.step))
            except NonFinite as error:
                data.load_state_dict(data_at_start)
                self._stop_non_finite(run, stage, str(error), last_saved)
            run.step += 1
            run.tokens += self.tokens_per_step
            run.elapsed_s = time.monotonic() - start
            record = {"step": run.step, "stage": stage, **metrics, "tokens": run.tokens,
                      "elapsed_s": round(run.elapsed_s, 3)}
            if torch.cuda.is_available():
                record["peak_gib"] = peak_memory_gib()
            if run.step % r.train.log_every == 0 or run.step == self.total_steps:
                self._write_metrics(record)
            bar.update(1)
            bar.set_postfix(stage=stage[:8], loss=f"{record['loss']:.4f}")
            final = run.step == self.total_steps
            if r.train.eval_every and run.step % r.train.eval_every == 0 and not final:
                self._write_metrics({"step": run.step, **self._evaluate(data, heldout=False)})
            if final:
                run.summary["after"] = self._evaluate(data, heldout=True)
                run.summary.update(steps=run.step, tokens=run.tokens, wall_time_s=round(run.elapsed_s, 1))
                if torch.cuda.is_available():
                    run.summary["peak_gib"] = peak_memory_gib()
                self._write_metrics({"step": run.step, **run.summary["after"]})
            stop = r.train.stop_after_steps is not None and run.step >= r.train.stop_after_steps and not final
            if final or stop or (r.train.checkpoint_every and run.step % r.train.checkpoint_every == 0):
                self.save_checkpoint(run.step)
                last_saved = run.step
            if stop:
                bar.close()
                if acc.is_main_process:
                    self.log(f"stopped after step {run.step} (train.stop_after_steps); continue with --resume")
                return
        bar.close()

    def _fresh_lm_only_state(self) -> None:
        """Before the LM stage's first step under DeepSpeed: Adam starts afresh (step 0) for what only the LM stage
        trains, as in one process, where those parameters had no gradient and so no state during attention transfer.
        DeepSpeed keeps flat fp32 tensors per parameter group and steps them through the transfer stage with zero
        gradients: their moments stay zero but their step count (and so Adam's bias correction) advances. The state
        whose moments are all zero is what never had a gradient; the two groups keep it apart from the gates'."""
        from accelerate.utils import DistributedType

        if not self.has_lm_only_params or self.acc.distributed_type != DistributedType.DEEPSPEED:
            return
        inner = self.optimizer
        while hasattr(inner, "optimizer"):  # accelerate's wrapper, then DeepSpeed's, around the torch optimizer
            inner = inner.optimizer
        for param, state in list(inner.state.items()):
            moments = [state[key] for key in ("exp_avg", "exp_avg_sq") if key in state]
            if moments and not any(bool(torch.any(m)) for m in moments):
                del inner.state[param]

    def _stop_non_finite(self, run: RunState, stage: str, what: str, last_saved):
        if last_saved != run.step:
            self.save_checkpoint(run.step)
        raise NHARetrofitError(
            f"non-finite {what} at step {run.step + 1} ({stage}); stopped. The last good state (step {run.step}) is "
            f"saved in {self.checkpoints}; lower the learning rate (e.g. --set train.lr=...) and pass --resume"
        )

    def save_checkpoint(self, step: int) -> Path:
        """accelerate.save_state and the run's state into a temporary folder, then the checksums, renamed when
        complete; older ones removed after. A failed write (a full disk) removes the temporary folder and keeps the
        previous checkpoint. The time it took goes to the metrics."""
        acc = self.acc
        began = time.monotonic()
        final = self.checkpoints / f"step-{step:08d}"
        tmp = self.checkpoints / f".tmp-step-{step:08d}"
        previous = list_checkpoints(self.checkpoints)
        if acc.is_main_process:
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        self._on_every_process(lambda: acc.save_state(str(tmp)), tmp, final, previous)

        def complete():
            if acc.is_main_process:
                write_training_state(tmp, {
                    "step": step, "tokens": self.run.tokens, "recipe": json.loads(json.dumps(self.recipe.as_dict(),
                                                                                            default=str)),
                    "run": self.run.state_dict(), "scheduler": self.scheduler.state_dict()})
                write_checksums(tmp)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)

        self._on_every_process(complete, tmp, final, previous)
        if acc.is_main_process:
            for old in list_checkpoints(self.checkpoints)[: -self.recipe.train.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        self._write_metrics({"step": step, "checkpoint_s": round(time.monotonic() - began, 2)})
        return final

    def _on_every_process(self, write, tmp: Path, final: Path, previous: list[Path]) -> None:
        """Run `write` on each process; if it failed on any (a full disk: torch, safetensors and DeepSpeed each
        report it their own way), remove the temporary folder and stop with one line."""
        acc = self.acc
        failure = None
        try:
            write()
        except Exception as error:  # noqa: BLE001 - every process must reach the reduction below
            failure = error
        failed = torch.tensor([1.0 if failure else 0.0], device=acc.device)
        if acc.reduce(failed, reduction="sum").item() == 0:
            return
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None and disk_failure(failure) is None:
            raise failure
        reason = disk_failure(failure) if failure else "failed on another process"
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        raise NHARetrofitError(f"cannot save checkpoint {final}: {reason}; {kept}")

    # ------------------------------------------------------------------------------------------------ after
    def finish(self) -> dict:
        """After training: the merged export (timed), the quality table and summary.json; returns the summary, or
        where a run stopped early (train.stop_after_steps) resumes."""
        summary = dict(self.run.summary)
        if "after" not in summary:
            return {"stopped_at_step": self.run.step, "checkpoints": str(self.checkpoints)}
        if self.recipe.export.enabled:
            from .export import export_merged

            folder = Path(self.recipe.export.folder or self.out / "model")
            summary["export"] = str(folder)
            began = time.monotonic()
            export_merged(self, folder, summary)
            summary["export_s"] = round(time.monotonic() - began, 1)
        if self.acc.is_main_process:
            self.log(quality_table(summary))
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        self.acc.wait_for_everyone()
        return summary


def quality_table(summary: dict) -> str:
    """Held-out perplexity before and after finetuning, against the original (markdown)."""
    before, after = summary.get("before", {}), summary.get("after", {})
    rows = [("held-out blocks (training distribution)", before.get("original_eval_ppl"), before.get("eval_ppl"),
             after.get("eval_ppl"))]
    for key in sorted(before):
        if key.endswith("_original_ppl"):
            name = key[: -len("_original_ppl")]
            rows.append((name, before[key], before.get(f"{name}_ppl"), after.get(f"{name}_ppl")))
    lines = [f"\nheld-out perplexity after {summary.get('tokens', 0):,} tokens, {summary.get('wall_time_s', 0):.0f} s "
             f"({summary.get('machine', '')})",
             "| text | original | converted, before | after | after / original |", "|---|---|---|---|---|"]
    for name, original, first, last in rows:
        if original and first and last:
            lines.append(f"| {name} | {original:.2f} | {first:.2f} | {last:.2f} | {last / original:.3f} |")
    return "\n".join(lines)


def interrupted_note(recipe: Recipe, command: str) -> str:
    """What an interrupted run leaves: its last checkpoint and the command that continues from it."""
    checkpoints = list_checkpoints(Path(recipe.train.output_dir) / CHECKPOINTS)
    if not checkpoints:
        return (f"interrupted before the first checkpoint (one every {recipe.train.checkpoint_every} steps): "
                f"nothing to resume, `{command} --overwrite` starts again")
    return f"interrupted: the last checkpoint is {checkpoints[-1]}; continue with `{command} --resume`"


def finetune(recipe, overrides=(), *, resume=False, dry_run=False, overwrite=False, log=print):
    """Run a finetuning recipe (a YAML path, a dict, or a Recipe). Returns the dry-run plan, or a summary dict
    with the exported folder. Resumes from the last checkpoint with `resume=True`."""
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, list(overrides))
    run = Run(recipe, resume=resume, overwrite=overwrite, log=log)
    if dry_run:
        return run.dry_run()
    run.train()
    return run.finish()


with contextlib.suppress(Exception):  # quiet accelerate's "no distributed environment" info lines
    import logging

    logging.getLogger("accelerate").setLevel(logging.WARNING)
