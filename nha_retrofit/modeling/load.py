"""Loading NHA checkpoints through nha_retrofit's own classes (no remote code needed when the package is here), and
the device and dtype a model is placed on. Evaluation, finetuning, the Hub upload and the bench load through here."""

import json
from pathlib import Path

import torch

from ..checksums import verify_checksums
from ..errors import NHARetrofitError
from .modeling_nha import NHA_MODEL_CLASSES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def nha_family(config: dict) -> str | None:
    """The original family (a key of NHA_MODEL_CLASSES) of an NHA checkpoint's config dict; None for any other
    config. An NHA config keeps its family's model_type and adds `nha_windows`; earlier versions wrote nha_<family>."""
    model_type = config.get("model_type", "")
    if model_type.startswith("nha_"):
        return model_type.removeprefix("nha_")
    return model_type if "nha_windows" in config else None


def nha_checkpoint_class(folder: Path):
    """The nha_retrofit model class of the NHA checkpoint at `folder` (a clear error for anything else)."""
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise NHARetrofitError(f"{folder} is not a checkpoint folder (no config.json)")
    config = json.loads(config_path.read_text())
    family = nha_family(config)
    if family not in NHA_MODEL_CLASSES:
        raise NHARetrofitError(f"{folder} is not an NHA checkpoint (model_type {config.get('model_type', '')!r})")
    return NHA_MODEL_CLASSES[family]


def load_nha_checkpoint(folder: Path, dtype=torch.float32):
    """The NHA checkpoint at `folder` in `dtype` on the CPU, in eval mode, after checking its files against the
    checksums written with them."""
    model_class = nha_checkpoint_class(folder)
    verify_checksums(folder)
    return model_class.from_pretrained(folder, dtype=dtype).eval()


def resolve_device(device: str) -> torch.device:
    """`auto`: CUDA if present, else the CPU; one error line for a device this machine does not have."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NHARetrofitError(f"device {device!r} asked for, but this machine has no CUDA device")
    try:
        return torch.device(device)
    except RuntimeError:
        raise NHARetrofitError(f"unknown device {device!r}; use auto, cpu or cuda[:N]") from None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, float32 on the CPU (where bfloat16 matmuls are slow)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise NHARetrofitError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_placement(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """(`resolve_device(device)`, `resolve_dtype(dtype, ...)`) in one call: checked before any weights are read."""
    target = resolve_device(device)
    return target, resolve_dtype(dtype, target)


def load_for_inference(folder, device: str = "auto", dtype: str = "auto"):
    """The NHA checkpoint at `folder` in eval mode on `device` in `dtype` (`resolve_placement`)."""
    target, weights_dtype = resolve_placement(device, dtype)
    return load_nha_checkpoint(Path(folder), weights_dtype).to(target)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
