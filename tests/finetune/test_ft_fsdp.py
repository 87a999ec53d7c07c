"""FSDP2 through `accelerate launch --config_file recipes/accelerate/fsdp.yaml` on two CPU processes (gloo): the
same loss curve as one process with the same global batch, through the attention-transfer stage and distillation
with trained projections (the teacher's in-place swap of sharded values); a sharded checkpoint, a resume from it,
and a merged export gathered from the shards, equal to the one-process export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fsdp_on_cpu
from ft_helpers import free_port, loss_curve, save_recipe, tiny_recipe, write_corpus, write_tiny_original
from nha_retrofit.finetune import finetune

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fsdp_on_two_cpu_processes_matches_one_and_resumes_from_shards(tmp_path):
    """Trained projections with distillation (the teacher swaps sharded values in place) on the default plan's kind
    (full KV heads inside NHA layers) with the GPU recipes' length curriculum, and LoRA (peft under FSDP2, adapters
    merged at export) on whole full layers, in one launch."""
    model, data = write_tiny_original(tmp_path / "orig"), write_corpus(tmp_path / "data")
    heads = dict(model={"convert": {"full_kv_head_ids": [[0, 1], [2, 0]], "window": 4, "slots": 4}},
                 data={"long": {"seq_len": 64, "share": 0.5}},
                 stages={"attention_transfer": {"tokens": 256}, "lm": {"tokens": 512, "distill_weight": 1.0}})
    variants = {"attention": ({}, heads, 4), "lora": ({"trainable": "lora", "lora": {"r": 2}}, {}, 2)}
    recipes = []
    for name, (train, sections, batch) in variants.items():  # the same global batch: `batch` on one process
        finetune(tiny_recipe(model, data, tmp_path / f"{name}-one", train={**train, "batch_size": batch}, **sections),
                 log=lambda *_: None)
        recipes.append(save_recipe(tiny_recipe(model, data, tmp_path / f"{name}-two",
                                               train={**train, "batch_size": batch // 2}, **sections),
                                   tmp_path / f"{name}.yaml"))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes/accelerate/fsdp.yaml"), "--num_processes", "2", "--main_process_port",
               str(free_port()), fsdp_on_cpu.__file__, "3", *map(str, recipes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    original = load_file(tmp_path / "orig" / "model.safetensors")
    for name in variants:
        one, two = tmp_path / f"{name}-one", tmp_path / f"{name}-two"
        summary = json.loads((two / "summary.json").read_text())
        assert summary["plan"]["sharding"] == "fsdp" and summary["plan"]["processes"] == 2
        assert summary["plan"]["long_block_steps"] == (2 if name == "attention" else 0)
        expected, sharded = loss_curve(one), loss_curve(two)
        assert [c[:2] for c in expected] == [c[:2] for c in sharded] and len(expected) == 6
        assert max(abs(a[2] - b[2]) for a, b in zip(expected, sharded)) < 1e-5, (name, expected, sharded)
        records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
        assert any(r.get("resume_s") is not None and r["step"] == 3 for r in records)  # resumed from step 3's shards
        final = two / "checkpoints" / "step-00000006"
        for folder in ("pytorch_model_fsdp_0", "optimizer_0"):  # torch.distributed.checkpoint: a file per process
            assert {p.name for p in (final / folder).glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}

        reference = load_file(one / "model" / "model.safetensors")
        exported = load_file(two / "model" / "model.safetensors")
        assert set(reference) == set(exported) == set(original) | {k for k in reference if "g_proj" in k
                                                                    or "slot_bias" in k}
        assert max((reference[k] - exported[k]).abs().max().item() for k in reference) < 1e-5
        assert not torch.equal(original["model.layers.0.self_attn.q_proj.weight"],
                               exported["model.layers.0.self_attn.q_proj.weight"])  # trained (LoRA merged in)
