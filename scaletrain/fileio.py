"""Atomic file writes and sha256 checksums: the one copy of that logic in the project.

A write goes to a hidden temporary name beside the target (``.NAME.tmp-PID``), is flushed and
fsynced, then renamed over the target with ``os.replace``: a reader sees the old file or the whole
new one, never a partial one, and a crash leaves at most a ``.*.tmp-*`` file behind (shard
directories clear those with ``--overwrite``). No third-party imports (no torch, no numpy).

Modes: files written here get the usual mode of a new file (``0666`` less the umask, so ``0644`` under
the common ``022``). Libraries that write through a temporary file of their own create it ``0600``
(safetensors' ``save_file`` does); :func:`default_mode` gives such a file the mode ``open()`` would have
given it, so exported models and checkpoints are readable by whoever may read the directory.
:func:`replace_dir` swaps a directory written beside its target (e.g. one evaluation's record) in one step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import shutil
from pathlib import Path

CHUNK = 1 << 22  # bytes read at a time when hashing a file


def temp_path(path: str | Path) -> Path:
    """The temporary name a write to ``path`` goes through (same directory, so the rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def fsync_file(path: str | Path) -> None:
    """Flush a file written by other means (e.g. a numpy memory map) to disk."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def replace_synced(tmp: str | Path, path: str | Path) -> None:
    """fsync ``tmp`` (written elsewhere, e.g. through a memory map), then rename it over ``path``."""
    fsync_file(tmp)
    os.replace(tmp, path)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary name, fsync, rename)."""
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` as UTF-8 to ``path`` atomically (temporary name, fsync, rename)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def umask() -> int:
    """The process's umask, read without changing it where Linux tells it (``/proc/self/status``, so
    no other thread can see a zero umask in between); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def default_mode(path: str | Path) -> None:
    """Give ``path`` (a file, or a directory and everything under it) at least the mode a plain ``open()``
    or ``mkdir()`` would have given it under the current umask: ``0644`` / ``0755`` under ``022``. Bits the
    file already has are kept; a restrictive umask (``077``) keeps files private."""
    mask = umask()
    path = Path(path)
    todo = [path]
    if path.is_dir() and not path.is_symlink():
        todo += [p for p in path.rglob("*") if not p.is_symlink()]
    for p in todo:
        st = p.stat()
        want = st.st_mode & 0o7777 | ((0o777 if p.is_dir() else 0o666) & ~mask)
        if want != st.st_mode & 0o7777:
            os.chmod(p, want)


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is not available."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def replace_dir(tmp: str | Path, path: str | Path) -> None:
    """Put the finished directory ``tmp`` (written beside ``path``) in the place of ``path``. Where the
    kernel can swap two names atomically, a reader sees the old directory or the new one, never neither;
    elsewhere the old one is renamed aside first and removed after (a crash in between leaves it as
    ``.NAME.old-PID``)."""
    tmp, path = Path(tmp), Path(path)
    if not path.exists():
        os.replace(tmp, path)
        return
    if _exchange(tmp, path):
        shutil.rmtree(tmp)  # now the old directory
        return
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's contents, read in chunks (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()
