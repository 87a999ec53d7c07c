"""Outputs appear complete or not at all: written in a temporary sibling folder, renamed when done."""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .errors import NHARetrofitError


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def check_output_folder(dest: Path, overwrite: bool) -> None:
    """Refuse before any work starts, so a mistake costs nothing."""
    if dest.exists() and not overwrite:
        raise NHARetrofitError(f"output {dest} already exists; pass --overwrite to replace it")
    if dest.exists() and not dest.is_dir():
        raise NHARetrofitError(f"output {dest} exists and is not a folder")


@contextlib.contextmanager
def atomic_folder(dest: Path, overwrite: bool = False):
    """Yield a temporary folder beside `dest`; on success it replaces `dest` (kept until then), on error it goes."""
    dest = Path(dest)
    check_output_folder(dest, overwrite)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp's private 0700 would otherwise become the output's mode
    except OSError as error:
        raise NHARetrofitError(f"cannot write to {dest.parent}: {error.strerror}") from None
    try:
        yield tmp
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / "previous")
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(dest: Path):
    """Yield a temporary path beside `dest`; on success it replaces `dest`, on error it goes."""
    dest = Path(dest)
    if dest.is_dir():
        raise NHARetrofitError(f"output {dest} is a folder, expected a file path")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
        os.close(handle)
        os.chmod(name, 0o666 & ~current_umask())  # mkstemp's private 0600 would otherwise become the file's mode
    except OSError as error:
        raise NHARetrofitError(f"cannot write to {dest.parent}: {error.strerror}") from None
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
