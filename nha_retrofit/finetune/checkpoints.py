"""Training checkpoints on disk: their folders, the run's own state as JSON, verification before a resume.

accelerate writes the weights (safetensors), the optimizer and the RNG states (read back with weights_only=True);
the schedule, the data position and the run's summary go to `TRAINING_STATE` as JSON, never through accelerate's
pickled custom state. `CHECKSUMS` lists every file written: a resume reads only a checkpoint whose files are exactly
those, unaltered, and falls back to the newest one that is. The pickles that FSDP and DeepSpeed add are read with
the classes they are known to hold and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
from pathlib import Path

import torch

from ..checksums import verify_checksums
from ..errors import NHARetrofitError

TRAINING_STATE = "run.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def list_checkpoints(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def write_training_state(folder: Path, state: dict) -> None:
    """`state` (numbers, strings, lists and dicts only) as JSON: floats round-trip exactly, nothing in it can run."""
    (folder / TRAINING_STATE).write_text(json.dumps(state, indent=2) + "\n")


def read_training_state(folder: Path) -> dict:
    try:
        return json.loads((folder / TRAINING_STATE).read_text())
    except (OSError, ValueError) as error:
        raise NHARetrofitError(f"cannot read {folder / TRAINING_STATE}: {error}") from None


def newest_verified(folder: Path, log) -> Path:
    """The newest checkpoint in `folder` whose files are exactly those written with it, unaltered; each one skipped
    is reported through `log`."""
    found = list_checkpoints(folder)
    if not found:
        raise NHARetrofitError(f"--resume: no checkpoint in {folder}")
    for checkpoint in reversed(found):
        try:
            verify_checksums(checkpoint, exact=True, required=True)
            _refuse_custom_state(checkpoint)
            _check_distributed_metadata(checkpoint)
        except NHARetrofitError as error:
            log(f"checkpoint {checkpoint.name} fails verification ({error}); trying the one before it")
            continue
        if checkpoint != found[-1]:
            log(f"resuming from {checkpoint.name}, the newest checkpoint that verifies")
        return checkpoint
    raise NHARetrofitError(f"--resume: no checkpoint in {folder} verifies; start again with --overwrite")


def _refuse_custom_state(checkpoint: Path) -> None:
    """accelerate would unpickle `custom_checkpoint_*.pkl` with weights_only=False; runs never write one."""
    planted = sorted(checkpoint.glob("custom_checkpoint_*"))
    if planted:
        raise NHARetrofitError(f"{checkpoint} holds {planted[0].name}, a pickle no run writes; it is not read")


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's `.metadata` (a plain pickle, which it loads unrestricted): only its own
    descriptions of tensors, shapes, dtypes and paths."""

    CLASSES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "PurePosixPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module, name):
        found = super().find_class(module, name) if module.startswith(("torch", "pathlib")) else None
        described = module == "torch.distributed.checkpoint.metadata" and isinstance(found, type)
        if (module, name) in self.CLASSES or described or isinstance(found, torch.dtype):
            return found
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def _check_distributed_metadata(checkpoint: Path) -> None:
    for path in sorted(checkpoint.rglob("*.metadata")):
        try:
            with open(path, "rb") as handle:
                _MetadataUnpickler(handle).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as error:
            raise NHARetrofitError(f"{path} is not checkpoint metadata ({error}); it is not read") from None


def deepspeed_state_classes() -> list:
    """The classes DeepSpeed pickles beside the tensors of a ZeRO checkpoint: its stage and the loss scaler."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler, DynamicLossScaler]


@contextlib.contextmanager
def weights_only_loading(classes=()):
    """Every torch.load inside (accelerate's, DeepSpeed's) reads tensors, plain containers and `classes` only: a
    pickle that names anything else is refused instead of run."""
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(list(classes)):
            yield
    finally:
        if previous is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous
