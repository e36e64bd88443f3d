"""Durable files: every file flashdraft writes is whole or absent after a crash, and can be
checked against a sha256 later (checkpoints, cache shards, manifests); a write that does not
fit on the disk is one clear error, not a traceback or a partial file (`DiskFullError`); and
an output has one writer at a time (`OutputLock`)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flashdraft.errors import FlashdraftError


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: a rename survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask. Linux reports it in /proc (a read, no change); elsewhere it is set
    and restored at once, the only portable way to read it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def write_atomic(path: Path, write: Callable[[Path], Any], what: str = "", needed: int | None = None) -> None:
    """`write(tmp)` writes the content to a temporary name; it is fsynced and renamed onto
    `path`, so readers see the old file or the whole new one, never a part. The file gets
    the mode a plain `open` would give it (0666 less the umask): safetensors' `save_file`
    creates files 0600, which a server running as another user cannot read.

    A write that does not fit raises `DiskFullError` naming `what` ("" : the file's name) and
    `needed` bytes (None: at least what was written); the temporary file is removed on any
    failure, so no part of it lingers."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with disk_full_is_an_error(tmp, what or path.name, needed):
            write(tmp)
            os.chmod(tmp, 0o666 & ~current_umask())
            fsync_path(tmp)
            os.replace(tmp, path)
    except DiskFullError as e:
        e.path = path  # the file the user knows; its .tmp is gone
        tmp.unlink(missing_ok=True)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, what: str = "") -> None:
    data = text.encode()
    write_atomic(path, lambda tmp: tmp.write_bytes(data), what, len(data))


def write_json_atomic(path: Path, data: Any, indent: int = 2, what: str = "") -> None:
    write_text_atomic(path, json.dumps(data, indent=indent) + "\n", what)


# -- a full disk --------------------------------------------------------------------------

# the errors a write gets when the data does not fit: the filesystem is full, the user's quota
# is spent, or the file would pass the filesystem's or the process's (ulimit -f) size limit
DISK_FULL = {
    errno.ENOSPC: "no space left on the device (ENOSPC)",
    errno.EDQUOT: "disk quota exceeded (EDQUOT)",
    errno.EFBIG: "file too large for the filesystem or the process's file-size limit (EFBIG)",
}


def disk_full_errno(error: BaseException) -> int | None:
    """The errno of a write that failed for lack of space, else None: an OSError's own, or the
    one safetensors' writer names in its message ("... (os error 28)")."""
    if isinstance(error, OSError):
        return error.errno if error.errno in DISK_FULL else None
    found = re.search(r"\(os error (\d+)\)", str(error))
    return int(found[1]) if found and int(found[1]) in DISK_FULL else None


def format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{int(size)} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem that holds `path` (or would: its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


class DiskFullError(FlashdraftError):
    """A write that did not fit: one line naming the file, what it held, roughly how many bytes it
    needed and how much is free. `then` (what to do) may be set by a caller that knows more,
    e.g. how much the rest of the run needs or that train resumes with --resume."""

    def __init__(self, path: Path, what: str, needed: int | None, code: int, at_least: bool = False) -> None:
        self.path, self.what, self.needed, self.code, self.at_least = Path(path), what, needed, code, at_least
        self.free = free_bytes(self.path)
        self.then = "free space (or use another --out) and re-run the same command"
        super().__init__(str(path))

    def __str__(self) -> str:
        need = ""
        if self.needed is not None:
            need = f"{'at least' if self.at_least else 'about'} {format_bytes(self.needed)} needed"
        free = f"{format_bytes(self.free)} free" if self.free is not None else ""
        sizes = "; ".join(s for s in (need, free) if s)
        return (
            f"{self.path}: {DISK_FULL[self.code]} while writing {self.what}"
            + (f" ({sizes})" if sizes else "")
            + f"; {self.then}"
        )


@contextmanager
def disk_full_is_an_error(path: Path, what: str, needed: int | None = None) -> Iterator[None]:
    """Inside, a write that fails for lack of space raises `DiskFullError` naming `path`, `what`
    and `needed` bytes (None: what `path` had reached when it failed, as "at least")."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        code = disk_full_errno(e)
        if code is None:
            raise
        at_least = needed is None
        if at_least:
            try:
                needed = Path(path).stat().st_size
            except OSError:
                needed = None
        raise DiskFullError(path, what, needed, code, at_least) from None


def append_whole(fd: int, data: bytes, path: Path, what: str) -> None:
    """Append `data` to the open file `fd` and fsync it, or leave the file as it was: a write
    that does not fit is cut back off (no partial line for a reader to trip on) and raises
    `DiskFullError`."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        with disk_full_is_an_error(path, what, len(data)):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
    except BaseException:
        os.ftruncate(fd, start)
        raise


def nbytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) dict/list: the size of a checkpoint file, roughly."""
    if hasattr(obj, "element_size") and hasattr(obj, "nelement"):
        return obj.element_size() * obj.nelement()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


class _ErrorKeeping:
    """A binary file that remembers the OSError its write raised: torch.save turns that error into
    a RuntimeError ("unexpected pos ...") that no longer says the disk is full."""

    def __init__(self, file) -> None:
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.file.flush()


def torch_save(obj: Any, path: Path) -> None:
    """torch.save into `path`, a full disk raising the OSError that says so."""
    import torch

    with open(path, "wb") as f:
        keeping = _ErrorKeeping(f)
        try:
            torch.save(obj, keeping)
        except RuntimeError:
            if keeping.error is not None:
                raise keeping.error from None
            raise


# -- one writer per output ---------------------------------------------------------------------


def _holder(text: str) -> dict[str, str]:
    """{"pid": ..., "host": ...} of a lock file's text ("pid N" alone in files of older runs)."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key in ("pid", "host") and value:
            fields[key] = value.strip()
    return fields


def _describe(holder: dict[str, str]) -> str:
    if not holder:
        return "pid and host not written yet"
    return f"pid {holder.get('pid', '?')}" + (f" on host {holder['host']}" if "host" in holder else "")


def _running_here(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        return True  # another user's process, or an unreadable pid: assume it runs
    return True


class OutputLock:
    """One writer per output: an exclusive flock on a lock file that names its holder (pid, host).

    A second writer is refused with a FlashdraftError naming the holder and the lock. The kernel
    drops a flock when its process dies, so a killed writer blocks nobody: its lock file, still
    naming it, is taken over with a message. `release` removes the file."""

    def __init__(self, path: Path, output: Path, writer: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": str(os.getpid()), "host": socket.gethostname()}
        while True:
            file = open(self.path, "a+")
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = _holder(self.path.read_text())
                except OSError:
                    holder = {}
                file.close()
                raise FlashdraftError(
                    f"{output}: another {writer} ({_describe(holder)}) is writing it (lock {self.path}); "
                    f"wait for it to finish, stop it, or use another --out"
                ) from None
            # the holder may have released and removed the file between our open and flock: the
            # lock we got is then on a file nobody else will open; start again on the new one
            try:
                current = os.stat(self.path).st_ino == os.fstat(file.fileno()).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            file.close()
        file.seek(0)
        left = _holder(file.read())
        if left and left != me:
            if left.get("host", me["host"]) == me["host"]:  # lock files of older runs name no host
                why = "no longer running" if not _running_here(left.get("pid", "")) else "its pid now another process's"
            else:
                why = (
                    "it no longer holds the lock; if it still runs there, this filesystem does not share locks "
                    "between hosts: stop one of the two"
                )
            print(f"{output}: taking over the lock {self.path} left by {_describe(left)} ({why})", flush=True)
        file.seek(0)
        file.truncate()
        file.write(f"pid {me['pid']}\nhost {me['host']}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        """Remove the lock file, then unlock (a writer that opened it before the removal sees,
        once it has the flock, that the path no longer names its file, and starts again)."""
        if self._file is None:
            return
        self.path.unlink(missing_ok=True)
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def read_jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield (location, row) for every non-blank line of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise FlashdraftError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise FlashdraftError(f"{path}:{number}: expected a JSON object, found {type(row).__name__}")
            yield f"{path}:{number}", row
