"""Where shard bytes come from: a local directory, an ``http(s)://`` URL, or a ``pipe:`` command.

``data.shards`` (and ``scaletrain data stats|verify``) take any of:

* a directory written by ``prepare``;
* ``https://host/path/to/shards`` (or ``http://``): the manifest is ``URL/manifest.json`` and shard
  ``NAME`` is ``URL/NAME``. A block is one HTTP Range request (the stream's one-seek-per-block
  access; other ranks' blocks cost a range of their length header only);
* ``pipe:COMMAND`` as in WebDataset, where ``{name}`` in COMMAND is replaced by the file's name
  (shell-quoted): ``pipe:cat /data/shards/{name}``, ``pipe:curl -fsS https://host/shards/{name}``. The
  command writes the whole file to stdout (exit status 0); the manifest is read with
  ``name=manifest.json``. A pipe cannot seek, so each shard is fetched whole, its size and sha256
  checked against the manifest, and kept in the cache (below) or, without one, in memory (least
  recently used shards dropped beyond ``cache_max_gb``).

Transient failures (connection refused/reset, timeouts, HTTP 5xx/429/408, a short body, a pipe
command exiting non-zero) are retried with exponential backoff (0.5 s, 1 s, 2 s, ... capped at 30 s)
up to ``retries`` times and ``max_seconds`` in all; then, or at once for a permanent error (HTTP 404),
``ScaletrainError`` names the URL or command. With ``cache_dir``, whole shards are downloaded once
into that directory (atomic: temporary name, sha256 checked, rename; named by content hash, so
several datasets and processes can share it) and read from there; the least recently used files go
when the directory holds more than ``cache_max_gb``. Every block read from any source is checked
against its manifest CRC-32 by ``scaletrain.data.shards.read_block``.
"""
from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shlex
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import CorruptShardError, ScaletrainError

log = logging.getLogger(__name__)

HTTP_PREFIXES = ("http://", "https://")
PIPE_PREFIX = "pipe:"
_CHUNK = 1 << 20


def is_remote(spec) -> bool:
    return isinstance(spec, str) and (spec.startswith(HTTP_PREFIXES) or spec.startswith(PIPE_PREFIX))


@dataclass(frozen=True)
class FetchOptions:
    """How remote shards are fetched (``data.fetch_*`` and ``data.cache_*`` in the config)."""

    retries: int = 8  # tries after the first one for a transient error
    max_seconds: float = 300.0  # give up after this long in all (first try included)
    timeout: float = 30.0  # seconds per HTTP request (connect or read stall); pipe commands: max_seconds
    cache_dir: str = ""  # whole shards downloaded here ("" = none: HTTP range reads / pipe shards in memory)
    cache_max_gb: float = 4.0  # least recently used shards leave the cache (or memory) beyond this


def fetch_options(data_cfg) -> FetchOptions:
    """The ``data`` section's fetch and cache keys."""
    return FetchOptions(int(data_cfg.fetch_retries), float(data_cfg.fetch_max_seconds), float(data_cfg.fetch_timeout),
                        str(data_cfg.cache_dir), float(data_cfg.cache_max_gb))


class _Transient(Exception):
    """A failure worth retrying that is not an OSError (short range body, pipe exit status)."""


def _transient(e: BaseException) -> bool:
    if isinstance(e, urllib.error.HTTPError):
        return e.code >= 500 or e.code in (408, 429)
    return isinstance(e, (_Transient, OSError, http.client.HTTPException))  # URLError, timeouts, resets


def _describe(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def with_retries(what: str, fn, opts: FetchOptions):
    """``fn()``, retried on transient errors with exponential backoff; then one line naming ``what``."""
    start, delay, tries = time.monotonic(), 0.5, 0
    while True:
        try:
            return fn()
        except ScaletrainError:
            raise
        except Exception as e:  # noqa: BLE001 - classified below; anything permanent is re-raised as one line
            tries += 1
            elapsed = time.monotonic() - start
            if not _transient(e):
                raise ScaletrainError(f"{what}: {_describe(e)}") from None
            if tries > opts.retries or elapsed + delay > opts.max_seconds:
                raise ScaletrainError(
                    f"{what}: unreachable after {tries} tries in {elapsed:.0f} s ({_describe(e)}); check the "
                    "server, or raise data.fetch_retries / data.fetch_max_seconds") from None
            log.warning("%s: %s; retry %d/%d in %.1f s", what, _describe(e), tries, opts.retries, delay)
            time.sleep(delay)
            delay = min(2 * delay, 30.0)


class LocalSource:
    """A shard directory on this machine (one seek per block)."""

    def __init__(self, root):
        self.root = Path(root)

    def where(self, name: str) -> str:
        return str(self.root / name)

    def read_file(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def read(self, shard, offset: int, size: int) -> bytes:
        path = self.root / shard.name
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(size)
        except OSError as e:
            raise ScaletrainError(f"cannot read shard {path}: {e}") from None


class ShardCache:
    """Whole shards in a local directory, named by content hash; LRU by file time beyond ``max_bytes``."""

    def __init__(self, root: str | Path, max_bytes: int):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, shard) -> Path:
        return self.root / f"{shard.sha256[:16]}-{shard.name}"

    def read(self, shard, offset: int, size: int, fetch) -> bytes:
        """Bytes of ``shard`` from the cache, after ``fetch(tmp_path)`` wrote the whole file when it was missing."""
        for _ in range(3):  # another process may evict the file between our check and open
            p = self.path(shard)
            if not p.is_file():
                self._add(shard, fetch)
            try:
                with open(p, "rb") as f:
                    os.utime(p)  # recently used
                    f.seek(offset)
                    return f.read(size)
            except FileNotFoundError:
                continue
        raise ScaletrainError(f"{self.root}: shard {shard.name} keeps leaving the cache; raise data.cache_max_gb")

    def _add(self, shard, fetch) -> None:
        final = self.path(shard)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            fetch(tmp)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        self._evict(keep=final)

    def _evict(self, keep: Path) -> None:
        for p in self.root.glob(".*.tmp-*"):  # left by a process killed mid-download (an hour is generous)
            try:
                if time.time() - p.stat().st_mtime > 3600:
                    p.unlink()
            except FileNotFoundError:
                pass
        files = []
        for p in self.root.glob("*.tar"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in files)
        for _, s, p in sorted(files):
            if total <= self.max_bytes:
                break
            if p != keep:
                p.unlink(missing_ok=True)
                total -= s


class _MemoryCache:
    """Whole shards in this process's memory (pipe: without a cache directory), LRU beyond ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.data: OrderedDict[str, bytes] = OrderedDict()

    def read(self, shard, offset: int, size: int, fetch_bytes) -> bytes:
        buf = self.data.get(shard.name)
        if buf is None:
            buf = self.data[shard.name] = fetch_bytes()
            while len(self.data) > 1 and sum(map(len, self.data.values())) > self.max_bytes:
                self.data.popitem(last=False)
        self.data.move_to_end(shard.name)
        return buf[offset:offset + size]


def _check_whole(where: str, shard, size: int, digest: str) -> None:
    """A whole fetched shard: a wrong size is corrupt (an interrupted transfer raises before this); a wrong
    sha256 is corrupt unless its blocks carry checksums (then each block's CRC-32 names the bad ones)."""
    if size != shard.bytes:
        raise CorruptShardError(f"{where}: {size:,} bytes, the manifest says {shard.bytes:,} (truncated, or not the "
                                "shard the manifest describes)")
    if digest != shard.sha256:
        if shard.blocks.has_checksums:
            log.warning("%s: sha256 differs from the manifest; its blocks are checked one by one", where)
        else:
            raise CorruptShardError(f"{where}: sha256 differs from the manifest (corrupt shard)")


class _RemembersCorrupt:
    """Whole shards found corrupt are remembered: their other blocks fail at once instead of fetching again."""

    def _whole(self, shard, read):
        bad = self.corrupt.get(shard.name)
        if bad is not None:
            raise CorruptShardError(bad)
        try:
            return read()
        except CorruptShardError as e:
            self.corrupt[shard.name] = str(e)
            raise


class HttpSource(_RemembersCorrupt):
    """Shards under an ``http(s)://`` base URL: a Range request per block, or whole shards into a cache."""

    def __init__(self, base: str, opts: FetchOptions):
        self.base, self.opts = base.rstrip("/"), opts
        self.corrupt: dict[str, str] = {}
        self.cache = ShardCache(opts.cache_dir, int(opts.cache_max_gb * 2**30)) if opts.cache_dir else None

    def where(self, name: str) -> str:
        return f"{self.base}/{urllib.parse.quote(name)}"

    def _get(self, url: str, headers: dict | None = None):
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=self.opts.timeout)

    def read_file(self, name: str) -> bytes:
        url = self.where(name)

        def get():
            with self._get(url) as r:
                return r.read()
        return with_retries(url, get, self.opts)

    def read(self, shard, offset: int, size: int) -> bytes:
        if self.cache is not None:
            return self._whole(shard, lambda: self.cache.read(shard, offset, size, lambda t: self._download(shard, t)))
        url = self.where(shard.name)

        def get():
            try:
                with self._get(url, {"Range": f"bytes={offset}-{offset + size - 1}"}) as r:
                    body = r.read()
                    if r.status == 200:  # the server ignores Range: it sent the whole file
                        return body[offset:offset + size]
            except urllib.error.HTTPError as e:
                if e.code == 416:  # the range starts past the end: a truncated shard (read_block says so)
                    return b""
                raise
            if len(body) < size and offset + len(body) < shard.bytes:
                raise _Transient(f"short range: {len(body)} of {size} bytes")
            return body
        return with_retries(url, get, self.opts) if size else b""

    def _download(self, shard, tmp: Path) -> None:
        url = self.where(shard.name)

        def get():
            h, n = hashlib.sha256(), 0
            with self._get(url) as r, open(tmp, "wb") as f:
                expected = r.headers.get("Content-Length")
                while chunk := r.read(_CHUNK):
                    h.update(chunk)
                    f.write(chunk)
                    n += len(chunk)
            if expected is not None and n != int(expected):  # the connection ended early
                raise _Transient(f"connection closed after {n:,} of {int(expected):,} bytes")
            _check_whole(url, shard, n, h.hexdigest())
        with_retries(url, get, self.opts)


class PipeSource(_RemembersCorrupt):
    """``pipe:COMMAND`` with ``{name}``: each file is the command's stdout; shards are fetched whole."""

    def __init__(self, spec: str, opts: FetchOptions):
        self.template, self.opts = spec[len(PIPE_PREFIX):].strip(), opts
        self.corrupt: dict[str, str] = {}
        if "{name}" not in self.template:
            raise ScaletrainError(f"data.shards {spec!r}: a pipe: command needs {{name}} where the file name goes, "
                                  "e.g. 'pipe:curl -fsS https://host/shards/{name}'")
        self.cache = ShardCache(opts.cache_dir, int(opts.cache_max_gb * 2**30)) if opts.cache_dir else None
        self.memory = _MemoryCache(int(opts.cache_max_gb * 2**30))

    def command(self, name: str) -> str:
        return self.template.replace("{name}", shlex.quote(name))

    def where(self, name: str) -> str:
        return f"pipe:{self.command(name)}"

    def _run(self, name: str) -> bytes:
        cmd = self.command(name)
        try:
            p = subprocess.run(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=self.opts.max_seconds)
        except subprocess.TimeoutExpired:
            raise _Transient(f"no end after {self.opts.max_seconds:.0f} s") from None
        if p.returncode != 0:
            err = p.stderr.decode("utf-8", "replace").strip().splitlines()
            raise _Transient(f"exit status {p.returncode}" + (f": {err[-1]}" if err else ""))
        return p.stdout

    def read_file(self, name: str) -> bytes:
        return with_retries(self.where(name), lambda: self._run(name), self.opts)

    def _fetch(self, shard) -> bytes:
        def get():
            buf = self._run(shard.name)
            _check_whole(self.where(shard.name), shard, len(buf), hashlib.sha256(buf).hexdigest())
            return buf
        return with_retries(self.where(shard.name), get, self.opts)

    def read(self, shard, offset: int, size: int) -> bytes:
        if self.cache is not None:
            return self._whole(shard, lambda: self.cache.read(shard, offset, size,
                                                              lambda tmp: tmp.write_bytes(self._fetch(shard))))
        return self._whole(shard, lambda: self.memory.read(shard, offset, size, lambda: self._fetch(shard)))


_SOURCES: dict = {}


def open_source(spec, opts: FetchOptions | None = None):
    """The source for a directory, URL or ``pipe:`` spec (one per spec and options in a process)."""
    if not isinstance(spec, (str, os.PathLike)):
        return spec  # already a source
    if not is_remote(spec):
        return LocalSource(spec)
    opts = opts or FetchOptions()
    key = (spec, opts)
    if key not in _SOURCES:
        _SOURCES[key] = HttpSource(spec, opts) if spec.startswith(HTTP_PREFIXES) else PipeSource(spec, opts)
    return _SOURCES[key]


as_source = open_source


def run_source(data_cfg):
    """The shards a run's ``data`` section names (``data.shards``), opened with its fetch and cache keys."""
    return open_source(data_cfg.shards, fetch_options(data_cfg))
