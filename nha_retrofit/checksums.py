"""A SHA-256 for every file a folder holds, written beside them and checked before they are read.

Converted checkpoints, exports and training checkpoints carry `CHECKSUMS` (relative path -> hex digest). A model
folder is checked against the files it lists (an evaluation may add records beside them later); a training
checkpoint must hold exactly the files it lists, so nothing planted in it is ever read.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from .errors import NHARetrofitError

CHECKSUMS = "nha_checksums.json"
_PIECE = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while piece := handle.read(_PIECE):
            digest.update(piece)
    return digest.hexdigest()


def hub_sha256(path: Path) -> str | None:
    """The SHA-256 the Hub reported for a file of a Hugging Face cache snapshot: large (LFS) files are stored as
    blobs named by it. None for a file the Hub gave no such hash for, or one outside a cache."""
    path = Path(path)
    if not path.is_symlink():
        return None
    name = path.resolve().name
    return name if _SHA256.match(name) else None


def folder_files(folder: Path) -> list[str]:
    """Every file under `folder` but the checksum record, as sorted relative paths."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file() and p.name != CHECKSUMS)


def write_checksums(folder: Path, known: dict[str, str] | None = None) -> None:
    """Record the digest of every file in `folder`; `known` gives digests already computed while writing."""
    known = known or {}
    digests = {name: known.get(name) or sha256_of(Path(folder) / name) for name in folder_files(folder)}
    (Path(folder) / CHECKSUMS).write_text(json.dumps(digests, indent=2) + "\n")


def checksums_of(folder: Path, files: list[str], written: dict[str, bytes]) -> bytes:
    """The checksum record of a copy of `folder` that holds `files` from it and `written` (name -> bytes) instead
    of its own files of those names; the digests already recorded for `files` are reused."""
    recorded = json.loads((Path(folder) / CHECKSUMS).read_text())
    digests = {name: recorded.get(name) or sha256_of(Path(folder) / name) for name in files}
    digests.update({name: hashlib.sha256(data).hexdigest() for name, data in written.items()})
    return (json.dumps(dict(sorted(digests.items())), indent=2) + "\n").encode()


def verify_checksums(folder: Path, *, exact: bool = False, required: bool = False) -> bool:
    """Check every listed file's digest (with `exact`, also that nothing unlisted is there). Returns False when the
    folder carries no record and `required` is off; raises NHARetrofitError naming the first difference."""
    folder = Path(folder)
    path = folder / CHECKSUMS
    if not path.is_file():
        if required:
            raise NHARetrofitError(f"{folder} has no {CHECKSUMS}: its files cannot be verified")
        return False
    try:
        digests = json.loads(path.read_text())
        assert isinstance(digests, dict) and all(isinstance(v, str) for v in digests.values())
    except (OSError, ValueError, AssertionError):
        raise NHARetrofitError(f"{path} is unreadable: {folder} cannot be verified") from None
    for name, expected in digests.items():
        file = folder / name
        if not file.resolve().is_relative_to(folder.resolve()) or not file.is_file():
            raise NHARetrofitError(f"{folder} lacks {name}, which {CHECKSUMS} lists")
        if sha256_of(file) != expected:
            hint = "" if required else f" (if you changed it on purpose, delete {path} to stop checking)"
            raise NHARetrofitError(f"{file} is corrupt: its SHA-256 differs from the one recorded when it was "
                                   f"written{hint}")
    if exact:
        unlisted = sorted(set(folder_files(folder)) - set(digests))
        if unlisted:
            raise NHARetrofitError(f"{folder} holds {unlisted[0]}, which was not written with it; it is not read")
    return True
