"""WebDataset-compatible tar shards whose members are blocks of many examples, plus the manifest.

Layout of an output directory::

    OUT/train-000000.tar ... OUT/valid-000000.tar ... OUT/test-000000.tar
    OUT/manifest.json            (written last, atomically)

Each tar member is one *block* named ``{split}-{shard:06d}-{block:06d}.pairs`` (WebDataset key
``{split}-{shard:06d}-{block:06d}``, extension ``pairs``). Block format, little endian::

    magic b"STPB" | version u16 | flags u16 | n u32              (12-byte header)
    src_lang L[n] | tgt_lang L[n] | src_len W[n] | tgt_len W[n]
    all source bytes (concatenated) | all target bytes (concatenated)

where the flags give the array widths: ``L`` is u8 if bit 0 (``FLAG_LANG_U8``) is set, else u16;
``W`` is u8 if bit 2 (``FLAG_LEN_U8``), u16 if bit 1 (``FLAG_LEN_U16``), else u32; with bit 3
(``FLAG_LEN_U8X``) ``W`` is u8 where 255 means "see the overflow table": the escaped lengths follow
the four arrays as u32, in order (source escapes, then target escapes). The writer
picks the narrowest widths that hold the block (short sentences cost 4 bytes of arrays per
example instead of 12); flags 0 is the full-width layout. Decoded arrays are always u16 / u32.
A reader decodes a block with a handful of ``np.frombuffer`` calls, and the lengths (for batch
planning) are readable from the first ``12 + 12 n`` bytes alone (fewer when narrow). Tar
headers are deterministic (mtime 0, uid/gid 0, empty user/group names, mode 0644, ustar) and the
archive ends right after its two zero blocks (no padding to tar's 10 KiB record size), so the
same input gives byte-identical shards. The manifest records each member's data offset and
size, so a block can be read with one seek, and (format 3) each block's CRC-32, checked whenever a
whole block is read (``read_block``): a block whose bytes changed raises ``CorruptShardError`` naming
the shard and the member. Manifests of format 1 and 2 have no block checksums (nothing is checked
per block; ``block_checksums`` says so).

The shards are plain WebDataset shards: ``webdataset.WebDataset(urls)`` iterates them, one sample
per block (``{"__key__": ..., "pairs": bytes}``), and :func:`decode_webdataset_sample` (exported by
``scaletrain.data``) turns such a sample into its translation pairs, the same ones this module's
readers yield (tested against ``webdataset`` 1.0.2). The writer and the readers here are our own,
not ``webdataset.TarWriter`` / ``WebDataset``, because training needs what a sequential tar stream
does not give: the writer records each member's data offset and size (and CRC-32) in the manifest,
which ``TarWriter`` does not report; with them a reader fetches one block with one seek or one
HTTP Range request (``sources.py``) instead of streaming the shard from its start, the training
stream resumes exactly at (shard, block, example) after a restart without re-reading what it had
consumed, and a changed block is caught by its checksum. Tar headers are written by
``tarfile.TarInfo.tobuf``, and reading a shard without its manifest (``iter_shard_blocks``) uses
``tarfile``.
"""
from __future__ import annotations

import base64
import binascii
import json
import logging
import tarfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence, overload

import numpy as np

import scaletrain
from scaletrain.data.example import Example
from scaletrain.data.sources import LocalSource, as_source, is_remote
from scaletrain.errors import CorruptShardError, ScaletrainError
from scaletrain.fileio import atomic_write_bytes, sha256_bytes

BLOCK_MAGIC = b"STPB"
BLOCK_VERSION = 1
HEADER_BYTES = 12
FLAG_LANG_U8 = 1
FLAG_LEN_U16 = 2
FLAG_LEN_U8 = 4
FLAG_LEN_U8X = 8
_KNOWN_FLAGS = FLAG_LANG_U8 | FLAG_LEN_U16 | FLAG_LEN_U8 | FLAG_LEN_U8X
_LEN_FLAGS = FLAG_LEN_U16 | FLAG_LEN_U8 | FLAG_LEN_U8X
FORMAT_NAME = "scaletrain-shards"
FORMAT_VERSION = 3  # 3: per-block CRC-32; 2: block tables as arrays (1: a list of objects); all read
READ_FORMAT_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
SPLITS = ("train", "valid", "test")
MAX_LANGS = 65535


# ---------------------------------------------------------------------------------------------
# blocks
# ---------------------------------------------------------------------------------------------
def encode_block(examples: Sequence[Example], *, compact: bool = True) -> bytes:
    """Pack examples into one block (see module doc); ``compact=False`` forces the full widths."""
    n = len(examples)
    if n == 0:
        raise ValueError("cannot encode an empty block")
    src_lang = np.fromiter((e.src_lang for e in examples), dtype="<u2", count=n)
    tgt_lang = np.fromiter((e.tgt_lang for e in examples), dtype="<u2", count=n)
    src_len = np.fromiter((len(e.src) for e in examples), dtype="<u4", count=n)
    tgt_len = np.fromiter((len(e.tgt) for e in examples), dtype="<u4", count=n)
    flags = 0
    overflow = np.zeros(0, "<u4")
    if compact:
        if max(int(src_lang.max()), int(tgt_lang.max())) < 256:
            flags |= FLAG_LANG_U8
            src_lang, tgt_lang = src_lang.astype("u1"), tgt_lang.astype("u1")
        longest = max(int(src_len.max()), int(tgt_len.max()))
        if longest < 256:
            flags |= FLAG_LEN_U8
            src_len, tgt_len = src_len.astype("u1"), tgt_len.astype("u1")
        else:
            n_esc = int((src_len >= 255).sum() + (tgt_len >= 255).sum())
            if 4 * n_esc < 2 * n or longest >= 65536:  # u8 + overflow table is smaller than u16
                flags |= FLAG_LEN_U8X
                overflow = np.concatenate([src_len[src_len >= 255], tgt_len[tgt_len >= 255]]).astype("<u4")
                src_len, tgt_len = np.minimum(src_len, 255).astype("u1"), np.minimum(tgt_len, 255).astype("u1")
            else:
                flags |= FLAG_LEN_U16
                src_len, tgt_len = src_len.astype("<u2"), tgt_len.astype("<u2")
    head = BLOCK_MAGIC + np.array([BLOCK_VERSION, flags], dtype="<u2").tobytes() + np.uint32(n).astype("<u4").tobytes()
    return b"".join(
        [
            head,
            src_lang.tobytes(),
            tgt_lang.tobytes(),
            src_len.tobytes(),
            tgt_len.tobytes(),
            overflow.tobytes(),
            b"".join(e.src for e in examples),
            b"".join(e.tgt for e in examples),
        ]
    )


def _widths(flags: int) -> tuple[str, str]:
    lang = "u1" if flags & FLAG_LANG_U8 else "<u2"
    length = "u1" if flags & (FLAG_LEN_U8 | FLAG_LEN_U8X) else ("<u2" if flags & FLAG_LEN_U16 else "<u4")
    return lang, length


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


def _parse_header(buf: bytes, where: str) -> tuple[int, int]:
    """(n, flags) of a block."""
    if len(buf) < HEADER_BYTES:
        raise CorruptShardError(f"{where}: block truncated ({len(buf)} bytes, header needs {HEADER_BYTES})")
    if buf[:4] != BLOCK_MAGIC:
        raise CorruptShardError(f"{where}: not a scaletrain block (magic {buf[:4]!r}, expected {BLOCK_MAGIC!r})")
    version, flags = np.frombuffer(buf, dtype="<u2", count=2, offset=4).tolist()
    if version != BLOCK_VERSION:
        raise CorruptShardError(f"{where}: block format version {version}, this scaletrain reads {BLOCK_VERSION}")
    if flags & ~_KNOWN_FLAGS or bin(flags & _LEN_FLAGS).count("1") > 1:
        raise CorruptShardError(f"{where}: unknown block flags {flags:#x}; the shard is corrupt or from a newer "
                                "scaletrain")
    return int(np.frombuffer(buf, dtype="<u4", count=1, offset=8)[0]), flags


def _decode_arrays(buf: bytes, where: str) -> tuple[BlockLengths, int]:
    """The per-example arrays (always u16 languages, u32 lengths) and the offset where text starts."""
    n, flags = _parse_header(buf, where)
    lang, length = _widths(flags)
    lw, nw = np.dtype(lang).itemsize, np.dtype(length).itemsize
    need = HEADER_BYTES + 2 * n * (lw + nw)
    if len(buf) < need:
        raise CorruptShardError(f"{where}: block truncated ({len(buf)} bytes, its arrays need {need})")
    o = HEADER_BYTES
    src_lang = np.frombuffer(buf, lang, n, o)
    tgt_lang = np.frombuffer(buf, lang, n, o + lw * n)
    src_len = np.frombuffer(buf, length, n, o + 2 * lw * n)
    tgt_len = np.frombuffer(buf, length, n, o + 2 * lw * n + nw * n)
    if lw != 2:
        src_lang, tgt_lang = src_lang.astype("<u2"), tgt_lang.astype("<u2")
    if flags & FLAG_LEN_U8X:
        es, et = np.flatnonzero(src_len == 255), np.flatnonzero(tgt_len == 255)
        k = len(es) + len(et)
        if len(buf) < need + 4 * k:
            raise CorruptShardError(f"{where}: block truncated ({len(buf)} bytes, its arrays need {need + 4 * k})")
        overflow = np.frombuffer(buf, "<u4", k, need)
        src_len, tgt_len = src_len.astype("<u4"), tgt_len.astype("<u4")
        src_len[es] = overflow[: len(es)]
        tgt_len[et] = overflow[len(es):]
        need += 4 * k
    elif nw != 4:
        src_len, tgt_len = src_len.astype("<u4"), tgt_len.astype("<u4")
    return BlockLengths(src_lang, tgt_lang, src_len, tgt_len), need


def decode_lengths(buf: bytes, where: str = "block") -> BlockLengths:
    """Decode only the header and the per-example arrays (``buf`` may be just the first 12+12n bytes)."""
    return _decode_arrays(buf, where)[0]


def decode_block(buf: bytes, where: str = "block") -> PairBlock:
    """Decode a whole block with array operations; malformed input raises ScaletrainError."""
    h, o = _decode_arrays(buf, where)
    n = len(h)
    src_off = np.zeros(n + 1, dtype=np.int64)
    tgt_off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(h.src_len, out=src_off[1:])
    np.cumsum(h.tgt_len, out=tgt_off[1:])
    ns, nt = int(src_off[-1]), int(tgt_off[-1])
    if len(buf) != o + ns + nt:
        raise CorruptShardError(
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
    crc32: int | None = field(default=None, compare=False)  # of the member's bytes (format 3); None: unknown


class BlockTable(Sequence[BlockInfo]):
    """The blocks of one shard, held as int64 arrays (constant memory per block).

    A sequence of ``BlockInfo`` built on access; block ``i`` of shard ``{split}-{k:06d}.tar`` has
    the key ``{split}-{k:06d}-{i:06d}``. ``crc32`` is None for manifests older than format 3.
    Compares equal to another table or a list of BlockInfo with the same entries.
    """

    __slots__ = ("stem", "offset", "size", "n", "crc32")

    def __init__(self, stem: str, offset, size, n, crc32=None):
        self.stem = stem
        self.offset = np.asarray(offset, dtype=np.int64).reshape(-1)
        self.size = np.asarray(size, dtype=np.int64).reshape(-1)
        self.n = np.asarray(n, dtype=np.int64).reshape(-1)
        self.crc32 = None if crc32 is None else np.asarray(crc32, dtype=np.int64).reshape(-1)
        if not (len(self.offset) == len(self.size) == len(self.n)) or (
                self.crc32 is not None and len(self.crc32) != len(self.n)):
            raise ValueError("block table arrays differ in length")

    @classmethod
    def from_blocks(cls, stem: str, blocks: Sequence[BlockInfo]) -> "BlockTable":
        for i, b in enumerate(blocks):
            if b.key != f"{stem}-{i:06d}":
                raise ScaletrainError(f"block {i} of {stem}.tar is named {b.key!r}, expected {stem}-{i:06d}")
        crc = [b.crc32 for b in blocks] if blocks and all(b.crc32 is not None for b in blocks) else None
        return cls(stem, [b.offset for b in blocks], [b.size for b in blocks], [b.n for b in blocks], crc)

    def __len__(self) -> int:
        return int(self.n.shape[0])

    @overload
    def __getitem__(self, i: int) -> BlockInfo: ...

    @overload
    def __getitem__(self, i: slice) -> list[BlockInfo]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        crc = None if self.crc32 is None else int(self.crc32[i])
        return BlockInfo(f"{self.stem}-{i:06d}", int(self.offset[i]), int(self.size[i]), int(self.n[i]), crc)

    def __iter__(self) -> Iterator[BlockInfo]:
        crc = [None] * len(self) if self.crc32 is None else self.crc32.tolist()
        for i, (o, s, n, c) in enumerate(zip(self.offset.tolist(), self.size.tolist(), self.n.tolist(), crc)):
            yield BlockInfo(f"{self.stem}-{i:06d}", o, s, n, c)

    def __eq__(self, other) -> bool:
        if isinstance(other, BlockTable):
            return (self.stem == other.stem and np.array_equal(self.offset, other.offset)
                    and np.array_equal(self.size, other.size) and np.array_equal(self.n, other.n))
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"BlockTable({self.stem!r}, {len(self)} blocks)"

    # in the manifest: little-endian arrays, base64 (a 55M-pair corpus has ~120k blocks; as JSON
    # lists of numbers they would cost ~15 MB of Python objects while loading the manifest)
    _DTYPES = {"offset": "<i8", "size": "<u4", "n": "<u4", "crc32": "<u4"}

    def to_dict(self) -> dict:
        out = {"encoding": "base64 little-endian: offset int64, size uint32, n uint32, crc32 uint32 (zlib)"}
        for k, dt in self._DTYPES.items():
            if getattr(self, k) is not None:
                out[k] = base64.b64encode(getattr(self, k).astype(dt).tobytes()).decode("ascii")
        return out

    @classmethod
    def from_dict(cls, stem: str, d: dict) -> "BlockTable":
        """Arrays as written by ``to_dict``, or plain JSON lists of numbers (``crc32`` optional)."""
        arrs = {}
        for k, dt in cls._DTYPES.items():
            v = d.get(k) if k == "crc32" else d[k]
            if v is not None:
                arrs[k] = np.frombuffer(base64.b64decode(v, validate=True), dt) if isinstance(v, str) else np.asarray(v)
        return cls(stem, arrs["offset"], arrs["size"], arrs["n"], arrs.get("crc32"))

    @property
    def has_checksums(self) -> bool:
        return self.crc32 is not None


@dataclass
class ShardInfo:
    name: str
    sha256: str
    bytes: int
    n_examples: int
    n_blocks: int
    blocks: BlockTable  # a list of BlockInfo is converted

    def __post_init__(self):
        if not isinstance(self.blocks, BlockTable):
            self.blocks = BlockTable.from_blocks(self.name[: -len(".tar")], list(self.blocks))

    def to_dict(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "bytes": self.bytes, "n_examples": self.n_examples,
                "n_blocks": self.n_blocks, "blocks": self.blocks.to_dict()}

    @classmethod
    def from_dict(cls, sh: dict) -> "ShardInfo":
        b = sh["blocks"]
        stem = str(sh["name"])[: -len(".tar")]
        if isinstance(b, dict):  # format 2
            table = BlockTable.from_dict(stem, b)
        else:  # format 1: a list of {key, offset, size, n}
            table = BlockTable.from_blocks(stem, [BlockInfo(x["key"], int(x["offset"]), int(x["size"]), int(x["n"]),
                                                            x.get("crc32")) for x in b])
        if len(table) != int(sh["n_blocks"]):
            raise ValueError(f"shard {sh['name']}: {len(table)} blocks listed, n_blocks says {sh['n_blocks']}")
        return cls(str(sh["name"]), str(sh["sha256"]), int(sh["bytes"]), int(sh["n_examples"]), int(sh["n_blocks"]),
                   table)


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
    # models trained on the shards and stored beside them, e.g. {"type": "spm", "file": "spm8000.model",
    # "vocab_size": 8000, "sha256": ..., "params": {...}} (see scaletrain.data.spm_models); omitted when empty
    tokenizers: list = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    scaletrain_version: str = scaletrain.__version__
    root: Path | None = field(default=None, compare=False, repr=False)

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise ScaletrainError(
                f"split {name!r} is not in {self.root or 'the manifest'}; it has: {', '.join(self.splits) or 'none'}"
            )
        return self.splits[name]

    @property
    def block_checksums(self) -> bool:
        """Every block has a CRC-32 (format 3 manifests); False for older ones (blocks unchecked)."""
        return all(sh.blocks.has_checksums for sp in self.splits.values() for sh in sp.shards)

    def direction(self, src_lang: int, tgt_lang: int) -> str:
        return f"{self.languages[src_lang]}-{self.languages[tgt_lang]}"

    def to_dict(self) -> dict:
        d = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "scaletrain_version": self.scaletrain_version,
            "languages": list(self.languages),
            "splits": {
                k: {"n_examples": v.n_examples, "shards": [sh.to_dict() for sh in v.shards],
                    "directions": {d: asdict(x) for d, x in v.directions.items()}}
                for k, v in self.splits.items()
            },
            "cleaning": self.cleaning,
            "source": self.source,
            "params": self.params,
        }
        if self.tokenizers:
            d["tokenizers"] = [dict(t) for t in self.tokenizers]
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "manifest") -> "Manifest":
        try:
            if d.get("format") != FORMAT_NAME:
                raise ScaletrainError(f"{where}: not a scaletrain shard manifest (format={d.get('format')!r})")
            if d["format_version"] not in READ_FORMAT_VERSIONS:
                raise ScaletrainError(
                    f"{where}: manifest format version {d['format_version']}, this scaletrain reads "
                    f"{', '.join(map(str, READ_FORMAT_VERSIONS))}; re-run `prepare`"
                )
            splits = {}
            for name, s in d["splits"].items():
                shards = [ShardInfo.from_dict(sh) for sh in s["shards"]]
                dirs = {
                    k: DirectionStats(int(v["n"]), int(v["src_bytes"]), int(v["tgt_bytes"]))
                    for k, v in s["directions"].items()
                }
                splits[name] = SplitInfo(int(s["n_examples"]), shards, dirs)
            tokenizers = d.get("tokenizers", [])
            if not isinstance(tokenizers, list) or not all(
                isinstance(t, dict) and {"type", "file", "vocab_size", "sha256"} <= t.keys() for t in tokenizers
            ):
                raise ValueError("'tokenizers' must be a list of {type, file, vocab_size, sha256} entries")
            return cls(
                languages=[str(x) for x in d["languages"]],
                splits=splits,
                cleaning=d.get("cleaning", {}),
                source=d.get("source", {}),
                params=d.get("params", {}),
                tokenizers=tokenizers,
                format_version=FORMAT_VERSION,
                scaletrain_version=str(d["scaletrain_version"]),
            )
        except ScaletrainError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, binascii.Error) as e:
            raise ScaletrainError(f"{where}: corrupt manifest ({type(e).__name__}: {e}); re-run `prepare`") from None


def load_manifest(shard_dir) -> Manifest:
    """Read ``shard_dir/manifest.json`` (a directory, URL or ``pipe:`` spec, or a source); missing or corrupt ->
    ScaletrainError naming the file."""
    if isinstance(shard_dir, LocalSource):
        shard_dir = shard_dir.root
    if is_remote(shard_dir) or not isinstance(shard_dir, (str, Path)):
        src = as_source(shard_dir)
        where = src.where(MANIFEST)
        raw = src.read_file(MANIFEST)
    else:
        path = Path(shard_dir) / MANIFEST
        where = str(path)
        if not path.is_file():
            raise ScaletrainError(f"{path} not found: is {shard_dir} a prepared shard directory? (run `prepare` first)")
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise ScaletrainError(f"{path}: cannot read manifest ({e})") from None
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ScaletrainError(f"{where}: cannot parse manifest ({e}); re-run `prepare`") from None
    if not isinstance(d, dict):
        raise ScaletrainError(f"{where}: corrupt manifest (top level is not an object); re-run `prepare`")
    m = Manifest.from_dict(d, where)
    m.root = Path(shard_dir) if isinstance(shard_dir, (str, Path)) and not is_remote(shard_dir) else None
    return m


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
    """Deterministic ustar bytes and (name, data offset, size) of each member.

    Each member is a 512-byte header, its data, zero padding to 512; the archive ends with the two
    zero blocks tar requires and no further padding to a 10 KiB record.
    """
    parts: list[bytes] = []
    info = []
    pos = 0
    for name, data in members:
        head = _tarinfo(name, len(data)).tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
        parts += [head, data, b"\0" * (-len(data) % tarfile.BLOCKSIZE)]
        info.append((name, pos + len(head), len(data)))
        pos += len(head) + len(data) + (-len(data) % tarfile.BLOCKSIZE)
    parts.append(b"\0" * (2 * tarfile.BLOCKSIZE))
    return b"".join(parts), info


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
        self._dir_stats: dict[tuple[int, int], DirectionStats] = {}  # (src, tgt) index -> its entry above
        self._block: list[Example] = []
        self._block_bytes = 0
        self._members: list[tuple[str, bytes, int]] = []  # (name, data, n)
        self._shard_n = 0
        self.n_examples = 0

    def add(self, ex: Example) -> None:
        d = self._dir_stats.get((ex.src_lang, ex.tgt_lang))
        if d is None:
            nl = len(self.languages)
            if not (0 <= ex.src_lang < nl and 0 <= ex.tgt_lang < nl):
                raise ScaletrainError(f"example language index out of range 0..{nl - 1}: {ex.src_lang}, {ex.tgt_lang}")
            d = self.directions.setdefault(f"{self.languages[ex.src_lang]}-{self.languages[ex.tgt_lang]}",
                                           DirectionStats())
            self._dir_stats[(ex.src_lang, ex.tgt_lang)] = d
        ls, lt = len(ex.src), len(ex.tgt)
        d.n += 1
        d.src_bytes += ls
        d.tgt_bytes += lt
        self._block.append(ex)
        self._block_bytes += ls + lt + 12
        self._shard_n += 1
        self.n_examples += 1
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
        blocks = BlockTable(name[: -len(".tar")], [off for _, off, _ in info], [size for _, _, size in info],
                            [n for _, _, n in self._members], [zlib.crc32(d) for _, d, _ in self._members])
        sh = ShardInfo(name, sha256_bytes(raw), len(raw), self._shard_n, len(blocks), blocks)
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
        ours = ([out / MANIFEST] + [p for s in SPLITS for p in out.glob(f"{s}-*.tar")] + list(out.glob(".*.tmp-*"))
                + list(out.glob("spm*.model")) + list(out.glob("spm*.lengths.npy")))
        for p in ours:  # the manifest goes first so a crash never leaves it pointing at missing shards
            if p.is_file():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def read_block(shard_dir, shard: ShardInfo, block: BlockInfo, *, lengths_only: bool = False,
               n_langs: int | None = None):
    """Read one block by its manifest offset (one seek or one range request); ``lengths_only`` reads just the
    header arrays. ``shard_dir``: a directory, a URL / ``pipe:`` spec or a source (``scaletrain.data.sources``).

    A whole block is checked against its manifest CRC-32 (format 3); with ``n_langs`` its language ids must be
    below it. Bytes that are not what ``prepare`` wrote raise ``CorruptShardError`` naming shard and member.
    """
    src = as_source(shard_dir)
    want = min(HEADER_BYTES + 12 * block.n, block.size) if lengths_only else block.size
    buf = src.read(shard, block.offset, want)
    where = f"{src.where(shard.name)} member {block.key}.pairs"
    if len(buf) < want:
        raise CorruptShardError(f"{where}: shard truncated (read {len(buf)} of {want} bytes)")
    if not lengths_only and block.crc32 is not None and zlib.crc32(buf) != block.crc32:
        raise CorruptShardError(f"{where}: checksum mismatch (crc32 {zlib.crc32(buf):08x}, the manifest says "
                                f"{block.crc32:08x}): the shard is corrupt; re-create or re-download it, or set "
                                "data.on_corrupt=skip to skip such blocks")
    h = decode_lengths(buf, where) if lengths_only else decode_block(buf, where)
    if len(h) != block.n:
        raise CorruptShardError(f"{where}: block holds {len(h)} examples, the manifest says {block.n}")
    if n_langs is not None and len(h):
        top = max(int(h.src_lang.max()), int(h.tgt_lang.max()))
        if top >= n_langs:
            raise CorruptShardError(f"{where}: language id {top} out of range (the manifest lists {n_langs} "
                                    "languages): the shard is corrupt; re-create it")
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


def iter_split(shard_dir, split: str, on_corrupt: str = "stop") -> Iterator[Example]:
    """Every example of a split, in manifest order (shards, blocks, examples), read block by block (a reader
    that stops early reads no more). ``on_corrupt="skip"``: a corrupt block is left out with a warning."""
    src = as_source(shard_dir)
    m = load_manifest(src if is_remote(shard_dir) or not isinstance(shard_dir, (str, Path)) else shard_dir)
    for sh in m.split(split).shards:
        for b in sh.blocks:
            try:
                blk = read_block(src, sh, b, n_langs=len(m.languages))
            except CorruptShardError as e:
                if on_corrupt != "skip":
                    raise
                logging.getLogger(__name__).warning("skipping a corrupt block (data.on_corrupt=skip): %s", e)
                continue
            yield from blk.examples()


def decode_webdataset_sample(sample: dict, languages: Sequence[str] | None = None) -> list[tuple]:
    """The translation pairs of one WebDataset sample read from our shards, as
    ``(src_lang, tgt_lang, src, tgt)`` tuples in block order: ``src``/``tgt`` are the raw UTF-8 bytes,
    the languages are manifest indices, or codes when ``languages`` (the manifest's list,
    ``load_manifest(shard_dir).languages``) is given. The same pairs as ``iter_split``. ::

        import webdataset as wds
        from scaletrain.data import decode_webdataset_sample
        ds = wds.WebDataset(sorted(glob("shards/NAME/train-*.tar")), shardshuffle=False)
        pairs = (p for sample in ds for p in decode_webdataset_sample(sample))

    A sample without a ``pairs`` member (not one of our blocks) raises ``ScaletrainError``; a corrupt
    block raises ``CorruptShardError`` naming the shard and the member."""
    where = f"{sample.get('__url__', 'webdataset sample')} member {sample.get('__key__', '?')}.pairs"
    data = sample.get("pairs")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ScaletrainError(f"{where}: no 'pairs' bytes in this sample (keys: {sorted(sample)}); "
                              "decode_webdataset_sample reads the blocks of scaletrain shards (undecoded bytes)")
    blk = decode_block(bytes(data), where)
    out = []
    for ex in blk.examples():
        sl, tl = (ex.src_lang, ex.tgt_lang) if languages is None else _codes(languages, ex, where)
        out.append((sl, tl, ex.src, ex.tgt))
    return out


def _codes(languages: Sequence[str], ex: Example, where: str) -> tuple[str, str]:
    top = max(ex.src_lang, ex.tgt_lang)
    if top >= len(languages):
        raise CorruptShardError(f"{where}: language id {top} out of range ({len(languages)} languages given)")
    return languages[ex.src_lang], languages[ex.tgt_lang]


def read_split(shard_dir, split: str, on_corrupt: str = "stop") -> list[Example]:
    """Every example of a split, in manifest order (shards, blocks, examples): for evaluation."""
    return list(iter_split(shard_dir, split, on_corrupt))
