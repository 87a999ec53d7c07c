"""Training checkpoints on disk: their folders, the run's own state as JSON, verification before a resume.

accelerate writes the weights (safetensors), the optimizer and the RNG states (read back with weights_only=True);
the schedule, the data position and the run's summary go to `TRAINING_STATE` as JSON, never through accelerate's
pickled custom state. `CHECKSUMS` lists every file written: a resume reads only a checkpoint whose files are exactly
those, unaltered, and falls back to the newest one that is.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

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


@contextlib.contextmanager
def weights_only_loading():
    """Every torch.load inside (accelerate's, DeepSpeed's) reads tensors and plain containers only: a pickle that
    names anything else is refused instead of run."""
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous
