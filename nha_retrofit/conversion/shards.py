"""Checkpoint files: find and check the weight shards, copy them, and add one shard with the new NHA tensors.

Conversion never materialises the model: the original shards are read once to hash them (and, without a hash from
the Hub, to check their values finite) and copied byte for byte by the kernel, so memory stays flat, and the gate
projections, computed one k_proj at a time, go into one extra shard. The output is sharded like the Hub: `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`.
"""

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..checksums import hub_sha256
from ..errors import NHARetrofitError

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_NAMES = ("pytorch_model.bin", "model.pt", "model.bin")
_PIECE = 1 << 22  # a multiple of every element size
# a float is NaN or infinite when its exponent bits are all ones: (element type of its bits, exponent mask)
_EXPONENT_BITS = {"F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80), "F32": (np.uint32, 0x7F800000),
                  "F64": (np.uint64, 0x7FF0000000000000)}


@dataclass
class Checkpoint:
    """Where each tensor of a checkpoint lives."""

    folder: Path
    weight_map: dict  # tensor name -> file name inside folder
    pickled: bool = False

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def _safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file, after checking the file holds every byte it announces."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as error:
        raise NHARetrofitError(f"{path} is not a readable safetensors file ({error})") from None
    end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
    if path.stat().st_size < 8 + length + end:
        raise NHARetrofitError(f"{path} is truncated: {path.stat().st_size} bytes, its header needs {8 + length + end}")
    return header


def find_checkpoint(folder: Path, allow_pickle: bool = False) -> Checkpoint:
    """Read the index (or the single file) and check that every named shard and tensor is there."""
    folder = Path(folder)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = _read_index(index)
    elif (folder / "model.safetensors").is_file():
        weight_map = {name: "model.safetensors" for name in _tensor_names(folder / "model.safetensors")}
    elif (folder / PICKLE_INDEX).is_file() or any((folder / name).is_file() for name in PICKLE_NAMES):
        if not allow_pickle:
            raise NHARetrofitError(
                f"{folder} has only pickle weights (.bin/.pt), which can run code when loaded; convert them to "
                "safetensors first, or pass --allow-pickle to load them with torch.load(weights_only=True)"
            )
        return _pickle_checkpoint(folder)
    else:
        raise NHARetrofitError(f"{folder} has no weights ({SAFETENSORS_INDEX} or model.safetensors)")
    for file in set(weight_map.values()):
        path = folder / file
        if not path.is_file():
            raise NHARetrofitError(f"shard {file} named by {SAFETENSORS_INDEX} is missing from {folder}")
        present = set(_tensor_names(path))
        absent = [name for name, where in weight_map.items() if where == file and name not in present]
        if absent:
            raise NHARetrofitError(f"{SAFETENSORS_INDEX} places {absent[0]} in {file}, which does not hold it")
    return Checkpoint(folder, weight_map)


def _read_index(index: Path) -> dict:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as error:
        raise NHARetrofitError(f"{index} is not a valid index ({error})") from None
    if not weight_map:
        raise NHARetrofitError(f"{index} names no tensors")
    return weight_map


def _tensor_names(path: Path) -> list[str]:
    return [name for name in _safetensors_header(path) if name != "__metadata__"]


def _pickle_checkpoint(folder: Path) -> Checkpoint:
    if (folder / PICKLE_INDEX).is_file():
        weight_map = _read_index(folder / PICKLE_INDEX)
    else:
        file = next(name for name in PICKLE_NAMES if (folder / name).is_file())
        weight_map = {name: file for name in _load_pickle(folder / file)}
    missing = [file for file in set(weight_map.values()) if not (folder / file).is_file()]
    if missing:
        raise NHARetrofitError(f"shard {missing[0]} named by {PICKLE_INDEX} is missing from {folder}")
    return Checkpoint(folder, weight_map, pickled=True)


def _load_pickle(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # torch raises many types for a bad or unsafe pickle
        raise NHARetrofitError(f"cannot load {path} safely with weights_only=True: {str(error).splitlines()[0]}") from None


class TensorReader:
    """Read single tensors from a checkpoint without loading whole shards."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self._pickles = {}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.checkpoint.weight_map:
            raise NHARetrofitError(f"the checkpoint has no tensor {name}")
        path = self.checkpoint.folder / self.checkpoint.weight_map[name]
        if self.checkpoint.pickled:
            if path not in self._pickles:
                self._pickles = {path: _load_pickle(path)}  # one pickle shard at a time
            return self._pickles[path][name]
        with safe_open(path, framework="pt") as handle:
            return handle.get_tensor(name)


def write_sharded(checkpoint: Checkpoint, new_tensors: dict, output: Path) -> dict[str, str]:
    """Copy the original shards (pickles become safetensors) and add `new_tensors` as one more shard, with an index.

    A shard the Hub gave a SHA-256 for is checked against it as it is copied; one without (a local folder) has each
    tensor checked finite instead. Returns the SHA-256 of each shard written."""
    files = checkpoint.files
    total = len(files) + 1
    names = {file: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, file in enumerate(files)}
    gates_file = f"model-{total:05d}-of-{total:05d}.safetensors"
    digests = {}
    for file, new_name in names.items():
        source = checkpoint.folder / file
        if checkpoint.pickled:
            state = _load_pickle(source)
            check_finite(state.items(), source)
            save_file({k: v.contiguous() for k, v in state.items()}, output / new_name, metadata={"format": "pt"})
            del state
            continue
        expected = hub_sha256(source)
        digests[new_name] = _read_checked(source, check_values=expected is None)
        if expected is not None and digests[new_name] != expected:
            raise NHARetrofitError(f"{source} is corrupt: its SHA-256 differs from the one the Hub gave for it")
        shutil.copyfile(os.path.realpath(source), output / new_name)
    save_file({k: v.contiguous() for k, v in new_tensors.items()}, output / gates_file, metadata={"format": "pt"})
    weight_map = {name: names[file] for name, file in checkpoint.weight_map.items()}
    weight_map.update({name: gates_file for name in new_tensors})
    total_size = sum(
        entry["data_offsets"][1] - entry["data_offsets"][0]
        for file in {*names.values(), gates_file}
        for name, entry in _safetensors_header(output / file).items()
        if name != "__metadata__"
    )
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (output / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return digests


def _read_checked(source: Path, check_values: bool) -> str:
    """The SHA-256 of `source`, read 4 MiB at a time (memory stays flat); with `check_values`, every floating-point
    tensor's values are checked finite as they stream through."""
    header = _safetensors_header(source) if check_values else {}
    spans = sorted((entry["data_offsets"], name, _EXPONENT_BITS[entry["dtype"]]) for name, entry in header.items()
                   if name != "__metadata__" and entry["dtype"] in _EXPONENT_BITS)
    digest = hashlib.sha256()
    with open(source, "rb") as reader:

        def read(length: int, bits=None, name=None) -> None:
            while length > 0:
                piece = reader.read(min(length, _PIECE))
                if not piece:
                    return
                digest.update(piece)
                length -= len(piece)
                if bits is not None and _any_exponent_all_ones(piece, *bits):
                    raise NHARetrofitError(f"{source} is corrupt: tensor {name} holds non-finite values")

        if spans:
            start = 8 + struct.unpack("<Q", reader.read(8))[0]
            reader.seek(0)
            read(start)
            for (begin, end), name, bits in spans:
                if start + begin < reader.tell():
                    raise NHARetrofitError(f"{source} is not a valid safetensors file: tensor {name} overlaps another")
                read(start + begin - reader.tell())
                read(end - begin, bits, name)
        read(source.stat().st_size - reader.tell())
    return digest.hexdigest()


def _any_exponent_all_ones(data: bytes, element, mask: int) -> bool:
    """Whether any float in `data` is NaN or infinite, from its bits (one pass, no torch threads to wake)."""
    return int(np.bitwise_and(np.frombuffer(data, dtype=element), mask).max()) == mask


def check_finite(tensors, source: Path) -> None:
    """Refuse a NaN or infinity in a floating-point tensor: what corrupted bytes in a weight most often read as."""
    for name, tensor in tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NHARetrofitError(f"{source} is corrupt: tensor {name} holds non-finite values")
