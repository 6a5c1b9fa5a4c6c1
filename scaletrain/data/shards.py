"""WebDataset-compatible tar shards whose members are blocks of many examples, plus the manifest.

Layout of an output directory::

    OUT/train-000000.tar ... OUT/valid-000000.tar ... OUT/test-000000.tar
    OUT/manifest.json            (written last, atomically)

Each tar member is one *block* named ``{split}-{shard:06d}-{block:06d}.pairs`` (WebDataset key
``{split}-{shard:06d}-{block:06d}``, extension ``pairs``). Block format, little endian::

    magic b"STPB" | version u16 | flags u16 (0) | n u32          (12-byte header)
    src_lang u16[n] | tgt_lang u16[n] | src_len u32[n] | tgt_len u32[n]
    all source bytes (concatenated) | all target bytes (concatenated)

so a reader decodes a block with a handful of ``np.frombuffer`` calls, and the lengths (for
batch planning) are readable from the first ``12 + 12 n`` bytes alone. Tar headers are
deterministic (mtime 0, uid/gid 0, empty user/group names, mode 0644, ustar), so the same input
gives byte-identical shards. The manifest records each member's data offset and size, so a block
can be read with one seek.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

import scaletrain
from scaletrain.data.batch import Example
from scaletrain.errors import ScaletrainError

BLOCK_MAGIC = b"STPB"
BLOCK_VERSION = 1
HEADER_BYTES = 12
FORMAT_NAME = "scaletrain-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "valid", "test")
MAX_LANGS = 65535


# ---------------------------------------------------------------------------------------------
# blocks
# ---------------------------------------------------------------------------------------------
def encode_block(examples: Sequence[Example]) -> bytes:
    """Pack examples into one block (see module doc)."""
    n = len(examples)
    if n == 0:
        raise ValueError("cannot encode an empty block")
    src_lang = np.fromiter((e.src_lang for e in examples), dtype="<u2", count=n)
    tgt_lang = np.fromiter((e.tgt_lang for e in examples), dtype="<u2", count=n)
    src_len = np.fromiter((len(e.src) for e in examples), dtype="<u4", count=n)
    tgt_len = np.fromiter((len(e.tgt) for e in examples), dtype="<u4", count=n)
    head = BLOCK_MAGIC + np.array([BLOCK_VERSION, 0], dtype="<u2").tobytes() + np.uint32(n).astype("<u4").tobytes()
    return b"".join(
        [
            head,
            src_lang.tobytes(),
            tgt_lang.tobytes(),
            src_len.tobytes(),
            tgt_len.tobytes(),
            b"".join(e.src for e in examples),
            b"".join(e.tgt for e in examples),
        ]
    )


@dataclass
class BlockLengths:
    """What a block's header says: enough to plan batches without reading the text."""

    src_lang: np.ndarray  # uint16 [n]
    tgt_lang: np.ndarray
    src_len: np.ndarray  # uint32 [n]
    tgt_len: np.ndarray

    def __len__(self) -> int:
        return int(self.src_len.shape[0])


@dataclass
class PairBlock(BlockLengths):
    src_data: bytes = b""
    tgt_data: bytes = b""
    src_off: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))  # [n+1] offsets
    tgt_off: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))

    def example(self, i: int) -> Example:
        return Example(
            int(self.src_lang[i]),
            int(self.tgt_lang[i]),
            self.src_data[self.src_off[i] : self.src_off[i + 1]],
            self.tgt_data[self.tgt_off[i] : self.tgt_off[i + 1]],
        )

    def examples(self, idx: Iterable[int] | None = None) -> list[Example]:
        if idx is None:
            idx = range(len(self))
        sl, tl = self.src_lang.tolist(), self.tgt_lang.tolist()
        so, to = self.src_off.tolist(), self.tgt_off.tolist()
        s, t = self.src_data, self.tgt_data
        return [Example(sl[i], tl[i], s[so[i] : so[i + 1]], t[to[i] : to[i + 1]]) for i in idx]


def _parse_header(buf: bytes, where: str) -> int:
    if len(buf) < HEADER_BYTES:
        raise ScaletrainError(f"{where}: block truncated ({len(buf)} bytes, header needs {HEADER_BYTES})")
    if buf[:4] != BLOCK_MAGIC:
        raise ScaletrainError(f"{where}: not a scaletrain block (magic {buf[:4]!r}, expected {BLOCK_MAGIC!r})")
    version = int(np.frombuffer(buf, dtype="<u2", count=1, offset=4)[0])
    if version != BLOCK_VERSION:
        raise ScaletrainError(f"{where}: block format version {version}, this scaletrain reads {BLOCK_VERSION}")
    return int(np.frombuffer(buf, dtype="<u4", count=1, offset=8)[0])


def decode_lengths(buf: bytes, where: str = "block") -> BlockLengths:
    """Decode only the header and the per-example arrays (``buf`` may be just the first 12+12n bytes)."""
    n = _parse_header(buf, where)
    need = HEADER_BYTES + 12 * n
    if len(buf) < need:
        raise ScaletrainError(f"{where}: block truncated ({len(buf)} bytes, its arrays need {need})")
    o = HEADER_BYTES
    src_lang = np.frombuffer(buf, "<u2", n, o)
    tgt_lang = np.frombuffer(buf, "<u2", n, o + 2 * n)
    src_len = np.frombuffer(buf, "<u4", n, o + 4 * n)
    tgt_len = np.frombuffer(buf, "<u4", n, o + 8 * n)
    return BlockLengths(src_lang, tgt_lang, src_len, tgt_len)


def decode_block(buf: bytes, where: str = "block") -> PairBlock:
    """Decode a whole block with array operations; malformed input raises ScaletrainError."""
    h = decode_lengths(buf, where)
    n = len(h)
    o = HEADER_BYTES + 12 * n
    src_off = np.zeros(n + 1, dtype=np.int64)
    tgt_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(h.src_len, out=src_off[1:])
    np.cumsum(h.tgt_len, out=tgt_off[1:])
    ns, nt = int(src_off[-1]), int(tgt_off[-1])
    if len(buf) != o + ns + nt:
        raise ScaletrainError(
            f"{where}: block size {len(buf)} does not match its header ({o + ns + nt} bytes expected); "
            "the shard is corrupt or truncated"
        )
    buf = bytes(buf)
    return PairBlock(
        h.src_lang, h.tgt_lang, h.src_len, h.tgt_len, buf[o : o + ns], buf[o + ns : o + ns + nt], src_off, tgt_off
    )


# ---------------------------------------------------------------------------------------------
# manifest
# ---------------------------------------------------------------------------------------------
@dataclass
class BlockInfo:
    key: str
    offset: int  # byte offset of the member's data in the tar file
    size: int
    n: int


@dataclass
class ShardInfo:
    name: str
    sha256: str
    bytes: int
    n_examples: int
    n_blocks: int
    blocks: list[BlockInfo]


@dataclass
class DirectionStats:
    n: int = 0
    src_bytes: int = 0
    tgt_bytes: int = 0


@dataclass
class SplitInfo:
    n_examples: int
    shards: list[ShardInfo]
    directions: dict[str, DirectionStats]

    @property
    def n_blocks(self) -> int:
        return sum(s.n_blocks for s in self.shards)


@dataclass
class Manifest:
    languages: list[str]
    splits: dict[str, SplitInfo]
    cleaning: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    scaletrain_version: str = scaletrain.__version__
    root: Path | None = field(default=None, compare=False, repr=False)

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise ScaletrainError(
                f"split {name!r} is not in {self.root or 'the manifest'}; it has: {', '.join(self.splits) or 'none'}"
            )
        return self.splits[name]

    def direction(self, src_lang: int, tgt_lang: int) -> str:
        return f"{self.languages[src_lang]}-{self.languages[tgt_lang]}"

    def to_dict(self) -> dict:
        d = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "scaletrain_version": self.scaletrain_version,
            "languages": list(self.languages),
            "splits": {k: asdict(v) for k, v in self.splits.items()},
            "cleaning": self.cleaning,
            "source": self.source,
            "params": self.params,
        }
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "manifest") -> "Manifest":
        try:
            if d.get("format") != FORMAT_NAME:
                raise ScaletrainError(f"{where}: not a scaletrain shard manifest (format={d.get('format')!r})")
            if d["format_version"] != FORMAT_VERSION:
                raise ScaletrainError(
                    f"{where}: manifest format version {d['format_version']}, this scaletrain reads {FORMAT_VERSION}; "
                    "re-run `prepare`"
                )
            splits = {}
            for name, s in d["splits"].items():
                shards = [
                    ShardInfo(
                        sh["name"], sh["sha256"], int(sh["bytes"]), int(sh["n_examples"]), int(sh["n_blocks"]),
                        [BlockInfo(b["key"], int(b["offset"]), int(b["size"]), int(b["n"])) for b in sh["blocks"]],
                    )
                    for sh in s["shards"]
                ]
                dirs = {
                    k: DirectionStats(int(v["n"]), int(v["src_bytes"]), int(v["tgt_bytes"]))
                    for k, v in s["directions"].items()
                }
                splits[name] = SplitInfo(int(s["n_examples"]), shards, dirs)
            return cls(
                languages=[str(x) for x in d["languages"]],
                splits=splits,
                cleaning=d.get("cleaning", {}),
                source=d.get("source", {}),
                params=d.get("params", {}),
                format_version=int(d["format_version"]),
                scaletrain_version=str(d["scaletrain_version"]),
            )
        except ScaletrainError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ScaletrainError(f"{where}: corrupt manifest ({type(e).__name__}: {e}); re-run `prepare`") from None


def load_manifest(shard_dir: str | Path) -> Manifest:
    """Read ``shard_dir/manifest.json``; missing or corrupt -> ScaletrainError naming the file."""
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise ScaletrainError(f"{path} not found: is {shard_dir} a prepared shard directory? (run `prepare` first)")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ScaletrainError(f"{path}: cannot parse manifest ({e}); re-run `prepare`") from None
    if not isinstance(d, dict):
        raise ScaletrainError(f"{path}: corrupt manifest (top level is not an object); re-run `prepare`")
    m = Manifest.from_dict(d, str(path))
    m.root = Path(shard_dir)
    return m


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(shard_dir: str | Path, manifest: Manifest) -> None:
    data = json.dumps(manifest.to_dict(), indent=1, ensure_ascii=False).encode("utf-8") + b"\n"
    atomic_write_bytes(Path(shard_dir) / MANIFEST, data)
    manifest.root = Path(shard_dir)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.type = tarfile.REGTYPE
    return ti


def build_tar(members: Sequence[tuple[str, bytes]]) -> tuple[bytes, list[tuple[str, int, int]]]:
    """Deterministic tar bytes and (name, data offset, size) of each member."""
    bio = io.BytesIO()
    with tarfile.open(fileobj=bio, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))
    raw = bio.getvalue()
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        info = [(m.name, m.offset_data, m.size) for m in tar.getmembers()]
    return raw, info


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


class SplitWriter:
    """Streams examples of one split into shards of ``shard_size`` examples, blocks of ``block_size``.

    Each shard is written to a temporary name and renamed; ``close()`` returns the SplitInfo.
    """

    def __init__(self, out_dir: str | Path, split: str, languages: Sequence[str], *, shard_size: int = 2048,
                 block_size: int = 256, max_block_bytes: int = 1 << 20, on_shard=None, first_index: int = 0):
        if shard_size < 1 or block_size < 1:
            raise ScaletrainError(f"shard_size ({shard_size}) and block_size ({block_size}) must be >= 1")
        self.out = Path(out_dir)
        self.split = split
        self.languages = list(languages)
        self.shard_size = shard_size
        self.block_size = block_size
        self.max_block_bytes = max_block_bytes
        self.on_shard = on_shard
        self.first_index = first_index  # number of the first shard written (parallel writers)
        self.shards: list[ShardInfo] = []
        self.directions: dict[str, DirectionStats] = {}
        self._block: list[Example] = []
        self._block_bytes = 0
        self._members: list[tuple[str, bytes, int]] = []  # (name, data, n)
        self._shard_n = 0
        self.n_examples = 0

    def add(self, ex: Example) -> None:
        nl = len(self.languages)
        if not (0 <= ex.src_lang < nl and 0 <= ex.tgt_lang < nl):
            raise ScaletrainError(f"example language index out of range 0..{nl - 1}: {ex.src_lang}, {ex.tgt_lang}")
        self._block.append(ex)
        self._block_bytes += len(ex.src) + len(ex.tgt) + 12
        self._shard_n += 1
        self.n_examples += 1
        d = self.directions.setdefault(f"{self.languages[ex.src_lang]}-{self.languages[ex.tgt_lang]}", DirectionStats())
        d.n += 1
        d.src_bytes += len(ex.src)
        d.tgt_bytes += len(ex.tgt)
        if len(self._block) >= self.block_size or self._block_bytes >= self.max_block_bytes:
            self._flush_block()
        if self._shard_n >= self.shard_size:
            self._flush_shard()

    def add_all(self, examples: Iterable[Example]) -> None:
        for ex in examples:
            self.add(ex)

    def _flush_block(self) -> None:
        if not self._block:
            return
        key = f"{self.split}-{self.first_index + len(self.shards):06d}-{len(self._members):06d}"
        self._members.append((f"{key}.pairs", encode_block(self._block), len(self._block)))
        self._block = []
        self._block_bytes = 0

    def _flush_shard(self) -> None:
        self._flush_block()
        if not self._members:
            return
        name = shard_name(self.split, self.first_index + len(self.shards))
        raw, info = build_tar([(m, d) for m, d, _ in self._members])
        atomic_write_bytes(self.out / name, raw)
        blocks = [
            BlockInfo(m.rsplit(".", 1)[0], off, size, n) for (m, off, size), (_, _, n) in zip(info, self._members)
        ]
        sh = ShardInfo(name, hashlib.sha256(raw).hexdigest(), len(raw), self._shard_n, len(blocks), blocks)
        self.shards.append(sh)
        self._members = []
        self._shard_n = 0
        if self.on_shard is not None:
            self.on_shard(sh)

    def close(self) -> SplitInfo:
        self._flush_shard()
        return SplitInfo(self.n_examples, self.shards, dict(sorted(self.directions.items())))


def prepare_out_dir(out: str | Path, overwrite: bool) -> Path:
    """Create ``out``; refuse a non-empty one unless overwrite (then only our own files are removed)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ScaletrainError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ScaletrainError(
                f"output directory {out} is not empty; choose another directory or pass overwrite=True (--overwrite)"
            )
        ours = [out / MANIFEST] + [p for s in SPLITS for p in out.glob(f"{s}-*.tar")] + list(out.glob(".*.tmp-*"))
        for p in ours:  # the manifest goes first so a crash never leaves it pointing at missing shards
            if p.is_file():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def read_block(shard_dir: str | Path, shard: ShardInfo, block: BlockInfo, *, lengths_only: bool = False):
    """Read one block by its manifest offset (one seek); ``lengths_only`` reads just the header arrays."""
    path = Path(shard_dir) / shard.name
    want = HEADER_BYTES + 12 * block.n if lengths_only else block.size
    try:
        with open(path, "rb") as f:
            f.seek(block.offset)
            buf = f.read(want)
    except OSError as e:
        raise ScaletrainError(f"cannot read shard {path}: {e}") from None
    where = f"{path} member {block.key}.pairs"
    if len(buf) < want:
        raise ScaletrainError(f"{where}: shard truncated (read {len(buf)} of {want} bytes)")
    if lengths_only:
        h = decode_lengths(buf, where)
    else:
        h = decode_block(buf, where)
    if len(h) != block.n:
        raise ScaletrainError(f"{where}: block holds {len(h)} examples, the manifest says {block.n}")
    return h


def iter_shard_blocks(path: str | Path) -> Iterator[tuple[str, PairBlock]]:
    """Stream (key, block) from one shard file in order, without the manifest (plain tar reading)."""
    path = Path(path)
    try:
        with tarfile.open(path, mode="r|") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key, _, ext = m.name.partition(".")
                if ext != "pairs":
                    continue
                f = tar.extractfile(m)
                data = f.read() if f is not None else b""
                yield key, decode_block(data, f"{path} member {m.name}")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ScaletrainError(f"cannot read shard {path}: {e} (corrupt or truncated?)") from None


def read_split(shard_dir: str | Path, split: str) -> list[Example]:
    """Every example of a split, in manifest order (shards, blocks, examples): for evaluation."""
    m = load_manifest(shard_dir)
    info = m.split(split)
    out: list[Example] = []
    for sh in info.shards:
        for b in sh.blocks:
            out.extend(read_block(shard_dir, sh, b).examples())
    return out


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
