"""The multi-process path: two CPU processes under torchrun (accelerate: MULTI_CPU, DDP over gloo) trains the same curve as one
process with the same global batch, checkpoints, and exports once."""

import json
import os
import subprocess
import sys

import pytest

from ft_helpers import loss_curve, save_recipe, tiny_recipe, write_corpus, write_tiny_original
from nha_retrofit.finetune import finetune


@pytest.mark.slow
def test_two_cpu_processes_match_one(tmp_path):
    model, data = write_tiny_original(tmp_path / "orig"), write_corpus(tmp_path / "data")
    single = tiny_recipe(model, data, tmp_path / "one", train={"batch_size": 2})
    finetune(single, log=lambda *_: None)
    double = tiny_recipe(model, data, tmp_path / "two", train={"batch_size": 1})
    path = save_recipe(double, tmp_path / "two.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    # torchrun sets RANK/WORLD_SIZE; accelerate sees two CPU processes and uses DDP over gloo (MULTI_CPU)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
               "-m", "nha_retrofit.cli", "finetune", str(path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = ([loss for *_, loss in loss_curve(tmp_path / run)] for run in ("one", "two"))
    assert len(one) == len(two) == 6
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-4, (one, two)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["plan"]["processes"] == 2 and summary["tokens"] == 384
    assert (tmp_path / "two" / "model" / "model.safetensors").is_file()
