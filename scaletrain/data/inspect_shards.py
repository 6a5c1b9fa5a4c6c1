"""Look at a prepared shard directory: statistics (``scaletrain data stats``) and an integrity check
(``scaletrain data verify``). Both take a directory, an ``http(s)://`` URL or a ``pipe:`` command
(``scaletrain.data.sources``); ``stats`` reads only the blocks' length headers (range requests for a
URL), ``verify`` fetches every shard whole."""
from __future__ import annotations

import hashlib
import io
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from scaletrain.data.shards import load_manifest, read_block
from scaletrain.data.sources import is_remote, open_source
from scaletrain.errors import ScaletrainError
from scaletrain.fileio import sha256_file as file_sha256

PERCENTILES = (50, 90, 99, 100)


def data_stats(shard_dir: str | Path, splits: list[str] | None = None) -> dict:
    """Per split and direction: pairs, byte totals, byte-length percentiles of each side; plus the
    filter / cleaning counters from the manifest. Reads only the blocks' length arrays."""
    shard_dir = open_source(shard_dir)
    m = load_manifest(shard_dir)
    names = list(m.splits) if splits is None else splits
    out: dict = {"languages": m.languages, "splits": {}, "cleaning": m.cleaning, "source": m.source}
    L = len(m.languages)
    for name in names:
        info = m.split(name)
        s_len, t_len, d = [], [], []
        for sh in info.shards:
            for b in sh.blocks:
                h = read_block(shard_dir, sh, b, lengths_only=True)
                s_len.append(h.src_len)
                t_len.append(h.tgt_len)
                d.append(h.src_lang.astype(np.int64) * L + h.tgt_lang)
        s = np.concatenate(s_len) if s_len else np.zeros(0, np.uint32)
        t = np.concatenate(t_len) if t_len else np.zeros(0, np.uint32)
        dd = np.concatenate(d) if d else np.zeros(0, np.int64)
        dirs = {}
        for key in np.unique(dd).tolist():
            sel = dd == key
            name_d = f"{m.languages[key // L]}-{m.languages[key % L]}"
            dirs[name_d] = {
                "pairs": int(sel.sum()),
                "src_bytes": int(s[sel].sum()),
                "tgt_bytes": int(t[sel].sum()),
                "src_len_pct": {f"p{p}": int(np.percentile(s[sel], p)) for p in PERCENTILES},
                "tgt_len_pct": {f"p{p}": int(np.percentile(t[sel], p)) for p in PERCENTILES},
            }
        out["splits"][name] = {
            "pairs": int(len(s)),
            "shards": len(info.shards),
            "blocks": info.n_blocks,
            "bytes_on_disk": sum(sh.bytes for sh in info.shards),
            "directions": dirs,
        }
    return out


def format_stats(stats: dict) -> str:
    lines = [f"languages: {', '.join(stats['languages'])}"]
    for name, sp in stats["splits"].items():
        lines.append(f"{name}: {sp['pairs']:,} pairs, {sp['shards']} shards, {sp['blocks']} blocks, "
                     f"{sp['bytes_on_disk']:,} bytes on disk")
        lines.append(f"  {'direction':<12}{'pairs':>10}{'src bytes':>12}{'tgt bytes':>12}"
                     f"{'src p50/p90/p99/max':>24}{'tgt p50/p90/p99/max':>24}")
        for d, v in sp["directions"].items():
            sp_ = "/".join(str(x) for x in v["src_len_pct"].values())
            tp_ = "/".join(str(x) for x in v["tgt_len_pct"].values())
            lines.append(f"  {d:<12}{v['pairs']:>10,}{v['src_bytes']:>12,}{v['tgt_bytes']:>12,}{sp_:>24}{tp_:>24}")
    total = stats.get("cleaning", {}).get("total")
    if total:
        lines.append("filtered / cleaned: " + ", ".join(f"{k} {v:,}" for k, v in total.items()))
    no_eval = (stats.get("source") or {}).get("no_eval")
    if no_eval:
        lines.append(f"train only (left out of evaluation): {', '.join(no_eval)}")
    return "\n".join(lines)


@dataclass
class VerifyReport:
    shards: int = 0
    blocks: int = 0
    examples: int = 0
    tokenizers: int = 0  # tokenizer models checked (manifest "tokenizers")
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class _Fetched:
    """A whole shard fetched from a URL or pipe: held in memory, read like a directory by ``read_block``."""

    def __init__(self, src, sh):
        self.src, self.name = src, src.where(sh.name)
        self.raw = src.read(sh, 0, sh.bytes)

    def where(self, name: str) -> str:
        return self.name

    def read(self, shard, offset: int, size: int) -> bytes:
        return self.raw[offset:offset + size]


def _check_shard(shard_dir, sh, checksums: bool, rep: VerifyReport, n_langs: int | None = None) -> int:
    """Size, sha256 and tar member table of one shard, then decode its blocks; problems go to ``rep``.
    Returns the number of examples decoded."""
    if is_remote(shard_dir):
        try:
            fetched = _Fetched(open_source(shard_dir), sh)
        except ScaletrainError as e:
            rep.problems.append(str(e))
            return 0
        path, raw, size = fetched.name, fetched.raw, len(fetched.raw)
        digest = (lambda: hashlib.sha256(raw).hexdigest())  # noqa: E731
        reader = fetched
    else:
        path = shard_dir / sh.name
        if not path.is_file():
            rep.problems.append(f"{path}: missing")
            return 0
        size, raw, reader = path.stat().st_size, None, shard_dir
        digest = (lambda: file_sha256(path))  # noqa: E731
    if size != sh.bytes:
        rep.problems.append(f"{path}: {size:,} bytes, the manifest says {sh.bytes:,} (truncated?)")
    elif checksums and digest() != sh.sha256:
        rep.problems.append(f"{path}: sha256 differs from the manifest (corrupt)")
    try:
        with (tarfile.open(fileobj=io.BytesIO(raw), mode="r:") if raw is not None else tarfile.open(path, "r:")) as tar:
            table = [(t.name, t.offset_data, t.size) for t in tar.getmembers()]
        want = [(f"{b.key}.pairs", b.offset, b.size) for b in sh.blocks]
        if table != want:
            rep.problems.append(f"{path}: tar members differ from the manifest's block table")
    except (tarfile.TarError, OSError, EOFError) as e:
        rep.problems.append(f"{path}: not a readable tar file ({e})")
    n_shard = 0
    for b in sh.blocks:
        try:
            n_shard += len(read_block(reader, sh, b, n_langs=n_langs))
            rep.blocks += 1
        except ScaletrainError as e:
            rep.problems.append(str(e))
    if n_shard != sh.n_examples and not any(p.startswith(str(path)) for p in rep.problems):
        rep.problems.append(f"{path}: {n_shard} examples decoded, the manifest says {sh.n_examples}")
    return n_shard


def _check_tokenizer(shard_dir: Path, languages: list[str], t: dict, checksums: bool, rep: VerifyReport) -> None:
    """A tokenizer model stored beside the shards (``scaletrain.vocab.SubwordVocab``) and its token-length files:
    present, sha256 as in the manifest, and (SentencePiece) loadable with the recorded number of pieces."""
    path = shard_dir / str(t["file"])
    n_problems = len(rep.problems)
    if not path.is_file():
        rep.problems.append(f"{path}: missing (tokenizer {t['type']} {t['vocab_size']} in the manifest)")
    elif checksums and file_sha256(path) != t["sha256"]:
        rep.problems.append(f"{path}: sha256 differs from the manifest (corrupt tokenizer model; re-create it "
                            f"with `scaletrain data spm {shard_dir} --vocab-size {t['vocab_size']} --overwrite`)")
    else:
        for split, rec in (t.get("lengths") or {}).items():  # the stream's token-length files
            lp = shard_dir / str(rec["file"])
            if not lp.is_file():
                rep.problems.append(f"{lp}: missing (token lengths of split {split})")
            elif checksums and file_sha256(lp) != rec["sha256"]:
                rep.problems.append(f"{lp}: sha256 differs from the manifest (corrupt token lengths; re-create "
                                    f"with `scaletrain data spm {shard_dir} --vocab-size {t['vocab_size']} "
                                    "--overwrite`)")
    if t["type"] == "spm" and len(rep.problems) == n_problems:  # the file is the recorded one: load it
        try:
            from scaletrain.vocab import SubwordVocab

            if SubwordVocab(languages, path).spm_size != int(t["vocab_size"]):
                rep.problems.append(f"{path}: holds a different number of pieces than the manifest's "
                                    f"{t['vocab_size']}")
        except ScaletrainError as e:
            rep.problems.append(str(e))


def verify(shard_dir: str | Path, *, checksums: bool = True) -> VerifyReport:
    """Check every shard of the manifest: size, sha256, tar member table, and decode every block.

    Problems are collected (each names the shard) rather than raised; a missing or corrupt
    manifest raises ScaletrainError.
    """
    shard_dir = shard_dir if is_remote(shard_dir) else Path(shard_dir)
    m = load_manifest(shard_dir)
    rep = VerifyReport()
    for split, info in m.splits.items():
        n_split = 0
        for sh in info.shards:
            rep.shards += 1
            n_split += _check_shard(shard_dir, sh, checksums, rep, len(m.languages))
        rep.examples += n_split
        if n_split != info.n_examples and not rep.problems:
            rep.problems.append(
                f"{shard_dir}: split {split} has {n_split} examples, the manifest says {info.n_examples}"
            )
    for t in [] if is_remote(shard_dir) else m.tokenizers:  # models beside the shards (SubwordVocab); local only
        rep.tokenizers += 1
        _check_tokenizer(shard_dir, m.languages, t, checksums, rep)
    return rep
