"""Atomic file writes and sha256 checksums: the one copy of that logic in the project.

A write goes to a hidden temporary name beside the target (``.NAME.tmp-PID``), is flushed and
fsynced, then renamed over the target with ``os.replace``: a reader sees the old file or the whole
new one, never a partial one, and a crash leaves at most a ``.*.tmp-*`` file behind (shard
directories clear those with ``--overwrite``). No third-party imports (no torch, no numpy).
"""
from __future__ import annotations

import hashlib
import os
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
