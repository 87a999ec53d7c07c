"""DeepSpeed ZeRO-3 through `accelerate launch --config_file recipes/accelerate/deepspeed_zero3.yaml` on one CPU
process (on CPUs accelerate counts one process under DeepSpeed whatever it launches, so one is what runs here): the
dry-run reports the sharding; a LoRA run with attention transfer and distillation, stopped after the transfer stage
and resumed from DeepSpeed's checkpoint, has the loss curve of one process without DeepSpeed, and the export
gathered from the partitions equals that process's export; a bf16 checkpoint trains LoRA in bf16."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ft_helpers import free_port, loss_curve, save_recipe, tiny_recipe, write_corpus, write_tiny_original
from nha_retrofit import PlanSpec, convert
from nha_retrofit.finetune import finetune

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow  # DeepSpeed launches: minutes on the CPU
ROOT = Path(__file__).resolve().parents[2]


def launch_zero3(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes/accelerate/deepspeed_zero3.yaml"), "--num_processes", "1", "--mixed_precision",
               "no", "--main_process_port", str(free_port()), "-m", "nha_retrofit.cli", "finetune", *args]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result


def test_zero3_resumed_run_matches_one_process_and_exports_the_same_model(tmp_path):
    """The MoE recipe's kind of run: LoRA on a checkpoint with full KV heads inside NHA layers (the default plan's
    kind), and the length curriculum, resumed before its long blocks."""
    data = write_corpus(tmp_path / "data")
    # ZeRO-3 partitions weights as they load: it trains a converted checkpoint
    model = convert(write_tiny_original(tmp_path / "orig"), tmp_path / "nha",
                    PlanSpec(full_kv_head_ids=((0, 1), (2, 0)), window=4, slots=4), log=lambda *_: None)
    sections = dict(model={"convert": None}, train={"trainable": "lora", "lora": {"r": 2}},
                    data={"long": {"seq_len": 64, "share": 0.5}})
    finetune(tiny_recipe(model, data, tmp_path / "one", **sections), log=lambda *_: None)
    recipe = save_recipe(tiny_recipe(model, data, tmp_path / "zero3", **sections), tmp_path / "zero3.yaml")

    launch_zero3(str(recipe), "--set", "train.stop_after_steps=2")  # the last transfer step: DeepSpeed's layout
    assert (tmp_path / "zero3" / "checkpoints" / "step-00000002" / "pytorch_model").is_dir()
    launch_zero3(str(recipe), "--resume")

    summary = json.loads((tmp_path / "zero3" / "summary.json").read_text())
    assert summary["plan"]["sharding"] == "zero3" and summary["plan"]["long_block_steps"] == 2
    expected, sharded = loss_curve(tmp_path / "one"), loss_curve(tmp_path / "zero3")
    assert [c[:2] for c in expected] == [c[:2] for c in sharded] and len(expected) == 6
    assert {c[1] for c in expected} == {"attention_transfer", "lm"}
    assert max(abs(a[2] - b[2]) for a, b in zip(expected, sharded)) < 1e-5, (expected, sharded)
    reference = load_file(tmp_path / "one" / "model" / "model.safetensors")
    exported = load_file(tmp_path / "zero3" / "model" / "model.safetensors")
    assert set(reference) == set(exported)
    assert max((reference[k] - exported[k]).abs().max().item() for k in reference) < 1e-5


def test_zero3_trains_lora_on_a_bf16_checkpoint(tmp_path):
    """bf16 weights, bf16 compute: peft's fp32 LoRA weights beside the bf16 gates would fail DeepSpeed's one-dtype
    check on flattening a parameter group; the run trains both stages and exports bf16 weights."""
    import torch
    from transformers import AutoModelForCausalLM

    data, original = write_corpus(tmp_path / "data"), write_tiny_original(tmp_path / "orig")
    AutoModelForCausalLM.from_pretrained(original, dtype=torch.bfloat16).save_pretrained(original)
    model = convert(original, tmp_path / "nha", PlanSpec(select="even", full_layers=1, window=4, slots=4), log=lambda *_: None)
    sections = dict(model={"convert": None}, train={"trainable": "lora", "lora": {"r": 2}, "precision": "bf16"})
    recipe = save_recipe(tiny_recipe(model, data, tmp_path / "zero3", **sections), tmp_path / "zero3.yaml")
    launch_zero3(str(recipe))

    losses = loss_curve(tmp_path / "zero3")
    assert {c[1] for c in losses} == {"attention_transfer", "lm"} and all(0 < c[2] < 20 for c in losses)
    exported = load_file(tmp_path / "zero3" / "model" / "model.safetensors")
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
