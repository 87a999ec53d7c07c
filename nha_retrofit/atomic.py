"""Outputs appear complete or not at all: written in a temporary sibling folder, renamed when done.

A temporary name carries the host and process id that write it, so the next run removes what a killed run left.
A disk that fills up or fails mid-write is one error line, with nothing left behind.
"""

import contextlib
import errno
import glob
import os
import re
import shutil
import socket
import sys
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


_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO)


def disk_failure(error: BaseException) -> str | None:
    """Why a write failed when `error` is the disk's doing (full, over quota, read-only, I/O error), else None.
    torch and safetensors report these as RuntimeError or SafetensorError carrying the system's message."""
    from safetensors import SafetensorError

    if isinstance(error, OSError):
        return error.strerror if error.errno in _DISK_ERRORS else None
    if not isinstance(error, (RuntimeError, SafetensorError)):
        return None
    text = str(error)
    reason = next((os.strerror(code) for code in _DISK_ERRORS if os.strerror(code) in text), None)
    if reason is None and "file write failed" in text:  # torch.save
        reason = "file write failed"
    return reason


def temporary_prefix(dest: Path, kind: str = "tmp") -> str:
    return f".{dest.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(dest: Path, log=None) -> None:
    """Remove the temporary folders beside `dest` that runs on this host left when they were killed, saying so."""
    dest = Path(dest)
    own = re.compile(rf"^\.{re.escape(dest.name)}\.(?:tmp|old)-{re.escape(socket.gethostname())}-(\d+)-")
    for path in dest.parent.glob(f".{glob.escape(dest.name)}.*-*"):
        match = own.match(path.name)
        if match is None or _running(int(match.group(1))):
            continue
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0
        shutil.rmtree(path, ignore_errors=True)
        (log or _stderr)(f"removed {path} ({size / 1e6:.0f} MB), left by a run that was killed")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def honour_umask(folder: Path) -> None:
    """Give `folder` and everything in it the modes the umask gives new files and folders: writers that go through
    mkstemp/mkdtemp (safetensors' save_file, tempfile) would otherwise leave them private to this user."""
    umask = current_umask()
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def atomic_folder(dest: Path, overwrite: bool = False, log=None):
    """Yield a temporary folder beside `dest`; on success it replaces `dest` (kept until then), on error it goes.
    Without `overwrite`, a `dest` that another run finished meanwhile is kept and this run fails."""
    dest = Path(dest)
    check_output_folder(dest, overwrite)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(dest, log)
        tmp = Path(tempfile.mkdtemp(prefix=temporary_prefix(dest), dir=dest.parent))
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp's private 0700 would otherwise become the output's mode
    except OSError as error:
        raise NHARetrofitError(f"cannot write to {dest.parent}: {error.strerror}") from None
    try:
        yield tmp
        honour_umask(tmp)
        if overwrite and dest.exists():
            old = Path(tempfile.mkdtemp(prefix=temporary_prefix(dest, "old"), dir=dest.parent))
            os.replace(dest, old / "previous")
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            _rename_new(tmp, dest)
    except Exception as error:
        reason = disk_failure(error)
        if reason is None:
            raise
        raise NHARetrofitError(f"cannot write {dest}: {reason}; nothing was written") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _rename_new(tmp: Path, dest: Path) -> None:
    """Rename `tmp` to `dest`, which must not exist: the kernel refuses to replace a folder that holds files, so
    the check and the rename are one step."""
    try:
        os.rename(tmp, dest)
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        raise NHARetrofitError(
            f"output {dest} appeared while this run was writing it (another run?); it is kept, this run's result "
            "is discarded"
        ) from None


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
