"""Finetuning under attack and damage: a pickle planted in a checkpoint never runs, altered or truncated checkpoint
files are found and the resume falls back to the newest checkpoint that verifies, a full disk is one line and leaves
nothing, an altered export is refused on load and on push, and the pushed record holds no path of this machine."""

import errno
import json
import os
import pickle
import shutil

import pytest
from safetensors import SafetensorError

from ft_helpers import tiny_recipe, write_corpus, write_tiny_original
from nha_retrofit.checksums import write_checksums
from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.modeling.load import load_nha_checkpoint
from nha_retrofit.finetune import finetune
from nha_retrofit.finetune.checkpoints import list_checkpoints, newest_verified
from nha_retrofit.hub import prepare_upload

quiet = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    model, data = write_tiny_original(root / "orig"), write_corpus(root / "data")
    full = tiny_recipe(model, data, root / "full")
    finetune(full, **quiet)
    return model, data, losses(root / "full"), root / "full" / "model"


def losses(folder):
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["stage"], r["loss"]) for r in lines if "loss" in r]


def assert_same_curve(resumed, uninterrupted):
    assert [r[:2] for r in resumed] == [r[:2] for r in uninterrupted]
    assert max(abs(a[2] - b[2]) for a, b in zip(resumed, uninterrupted)) <= 1e-6


class Hostile:
    """Unpickling this runs a shell command that leaves `marker` behind."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def stopped_run(world, folder, keep=2):
    """A run stopped after step 4 with checkpoints at steps 2 and 4."""
    model, data = world[:2]
    recipe = tiny_recipe(model, data, folder, train={"keep_checkpoints": keep, "stop_after_steps": 4})
    finetune(recipe, **quiet)
    recipe["train"]["stop_after_steps"] = None
    found = list_checkpoints(folder / "checkpoints")
    assert [p.name for p in found] == ["step-00000002", "step-00000004"][-keep:]
    return recipe, found[-1]


def test_pickle_planted_in_a_checkpoint_never_runs(world, tmp_path):
    """accelerate unpickles its custom state with weights_only=False: the run's own state is JSON instead, and a
    `custom_checkpoint_0.pkl` is refused unread even when the attacker rewrites the checksums to match."""
    recipe, latest = stopped_run(world, tmp_path / "run", keep=1)
    assert not list(latest.glob("*custom*"))
    marker = tmp_path / "ran"
    (latest / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps(Hostile(marker)))
    write_checksums(latest)
    said = []
    with pytest.raises(NHARetrofitError, match="no checkpoint in .* verifies"):
        finetune(recipe, resume=True, log=said.append)
    assert any("holds custom_checkpoint_0.pkl, a pickle no run writes; it is not read" in line for line in said)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["optimizer.bin", "random_states_0.pkl"])
def test_hostile_pickle_in_place_of_accelerate_state_is_refused(world, tmp_path, name):
    recipe, latest = stopped_run(world, tmp_path / "run", keep=1)
    marker = tmp_path / "ran"
    (latest / name).write_bytes(pickle.dumps(Hostile(marker)))
    write_checksums(latest)
    if name == "optimizer.bin":
        with pytest.raises(NHARetrofitError, match=r"cannot load checkpoint .*step-00000004: Weights only load failed"):
            finetune(recipe, resume=True, **quiet)
    else:  # accelerate skips RNG states it cannot read
        finetune(recipe, resume=True, **quiet)
    assert not marker.exists()


def test_distributed_checkpoint_metadata_is_read_with_its_own_classes_only(tmp_path):
    """FSDP's shards come with torch.distributed.checkpoint's `.metadata`, a pickle torch loads unrestricted: it is
    checked first, so a hostile one is refused and its checkpoint skipped."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(1, 3)).sum().backward()
    optimizer.step()
    for step in (2, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group: one process saves everything
            dcp.save({"model": layer.state_dict(), "optim": optimizer.state_dict()},
                     checkpoint_id=tmp_path / f"step-{step:08d}" / "pytorch_model_fsdp_0")
        write_checksums(tmp_path / f"step-{step:08d}")
    marker = tmp_path / "ran"
    latest = tmp_path / "step-00000004"
    (latest / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    write_checksums(latest)
    said = []
    assert newest_verified(tmp_path, said.append) == tmp_path / "step-00000002"
    assert f"it names posix.system" in said[0] and "it is not read" in said[0] and not marker.exists()


def flip_bytes(path, offset=-4096, count=4096, seed=0):
    import random

    data = bytearray(path.read_bytes())
    start = offset % len(data)
    data[start : start + count] = random.Random(seed).randbytes(min(count, len(data) - start))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "planted"])
def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(world, tmp_path, damage):
    recipe, latest = stopped_run(world, tmp_path / "run")
    marker = tmp_path / "ran"
    if damage == "flipped":
        flip_bytes(latest / "model.safetensors")
    elif damage == "truncated":
        os.truncate(latest / "optimizer.bin", (latest / "optimizer.bin").stat().st_size // 2)
    else:
        (latest / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps(Hostile(marker)))
    said = []
    assert finetune(recipe, resume=True, log=said.append)["steps"] == 6
    reason = {"flipped": "model.safetensors is corrupt", "truncated": "optimizer.bin is corrupt",
              "planted": "holds custom_checkpoint_0.pkl, which was not written with it"}[damage]
    assert any(f"checkpoint step-00000004 fails verification" in line and reason in line for line in said), said
    assert "resuming from step-00000002, the newest checkpoint that verifies" in said
    assert_same_curve(losses(tmp_path / "run"), world[2])
    assert not marker.exists()


def test_resume_with_no_checkpoint_that_verifies(world, tmp_path):
    recipe, latest = stopped_run(world, tmp_path / "run", keep=1)
    flip_bytes(latest / "model.safetensors")
    with pytest.raises(NHARetrofitError, match="--resume: no checkpoint in .* verifies; start again with --overwrite"):
        finetune(recipe, resume=True, **quiet)


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)'),
    RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0: "
                 "file write failed"),
], ids=["OSError", "SafetensorError", "RuntimeError"])
def test_full_disk_while_saving_is_one_line_and_leaves_nothing(world, tmp_path, monkeypatch, error):
    from accelerate import Accelerator

    model, data = world[:2]
    real = Accelerator.save_state
    calls = {"n": 0}

    def failing(self, output_dir=None, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            real(self, output_dir, **kwargs)  # the files are there, then the disk is full
            raise error
        return real(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", failing)
    recipe = tiny_recipe(model, data, tmp_path / "run")
    reason = "file write failed" if isinstance(error, RuntimeError) else "No space left on device"
    with pytest.raises(NHARetrofitError, match=rf"cannot save checkpoint .*step-00000004: {reason}; "
                                               r"the previous checkpoint .*step-00000002 is intact"):
        finetune(recipe, **quiet)
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000002"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    monkeypatch.setattr(Accelerator, "save_state", real)
    assert finetune(recipe, resume=True, **quiet)["steps"] == 6
    assert_same_curve(losses(tmp_path / "run"), world[2])


def test_altered_export_is_refused_on_load_and_on_push(world, tmp_path):
    export = tmp_path / "model"
    shutil.copytree(world[3], export)
    load_nha_checkpoint(export)
    flip_bytes(export / "model.safetensors", offset=(export / "model.safetensors").stat().st_size // 2)
    for load in (load_nha_checkpoint, lambda folder: prepare_upload(folder, "me/tiny-nha")):
        with pytest.raises(NHARetrofitError, match=r"model.safetensors is corrupt: its SHA-256 differs"):
            load(export)


def test_pushed_record_holds_no_path_of_this_machine(world):
    record = json.loads(prepare_upload(world[3], "me/tiny-nha").written["nha_conversion.json"])
    text = json.dumps(record)
    root = str(world[3].parents[1])
    assert root not in text and '"/' not in text and "~" not in text
    recipe = record["finetune"]["recipe"]
    assert "output_dir" not in recipe["train"] and "files" not in recipe["data"] and "path" not in recipe["model"]
    assert recipe["train"]["lr"] == 1e-3 and record["finetune"]["steps"] == 6 and record["plan"]["num_slots"] == 4
    assert record["finetune"]["after"]["eval_ppl"] > 0 and "source" not in record
