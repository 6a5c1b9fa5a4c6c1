"""``scaletrain data export``: one split of a shard directory -> line-aligned plain text per direction.

For every direction ``src-tgt`` of the split (or those asked for) two files are written,
``OUT/<split>.<src>-<tgt>.<src>`` and ``OUT/<split>.<src>-<tgt>.<tgt>``, line ``i`` of one being the
translation of line ``i`` of the other, in manifest order (shards, blocks, examples), UTF-8 with
``\\n`` line ends: what sacrebleu, COMET and other scorers read. A line break inside a sentence
(``\\r`` or ``\\n``, possible in gettext catalogs) would break the alignment, so it is written as a
space and counted. Shards are read one block at a time (constant memory); each file is written
under a temporary name and renamed into place once the whole split is read, so a reader never
sees a partial file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from scaletrain.data.shards import load_manifest, read_block
from scaletrain.errors import ScaletrainError
from scaletrain.fileio import temp_path

_LINE_BREAKS = bytes.maketrans(b"\r\n", b"  ")


@dataclass
class ExportedDirection:
    direction: str
    n: int
    src_path: Path
    tgt_path: Path
    line_breaks: int = 0  # sentences whose line breaks were written as spaces


def _one_line(text: bytes, counter: list) -> bytes:
    if b"\n" in text or b"\r" in text:
        counter[0] += 1
        return text.translate(_LINE_BREAKS)
    return text


def export_split(shard_dir: str | Path, split: str, out: str | Path,
                 directions: Sequence[str] | None = None) -> list[ExportedDirection]:
    """Write the split's directions as file pairs under ``out``; returns them in manifest order."""
    m = load_manifest(shard_dir)
    info = m.split(split)
    have = list(info.directions)
    if directions:
        unknown = [d for d in directions if d not in info.directions]
        if unknown:
            raise ScaletrainError(f"split {split!r} of {shard_dir} has no direction {', '.join(unknown)}; "
                                  f"it has: {', '.join(have) or 'none'}")
        want = list(dict.fromkeys(directions))
    else:
        want = have
    if not want:
        raise ScaletrainError(f"split {split!r} of {shard_dir} holds no examples")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ScaletrainError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, ExportedDirection] = {}
    files: dict[str, tuple] = {}
    breaks: dict[str, list] = {}
    try:
        for d in want:
            s, t = d.split("-", 1)
            e = ExportedDirection(d, 0, out / f"{split}.{d}.{s}", out / f"{split}.{d}.{t}")
            res[d] = e
            files[d] = (open(temp_path(e.src_path), "wb"), open(temp_path(e.tgt_path), "wb"))
            breaks[d] = [0]
        for sh in info.shards:
            for b in sh.blocks:
                for ex in read_block(shard_dir, sh, b).examples():
                    d = m.direction(ex.src_lang, ex.tgt_lang)
                    fs = files.get(d)
                    if fs is None:
                        continue
                    fs[0].write(_one_line(ex.src, breaks[d]) + b"\n")
                    fs[1].write(_one_line(ex.tgt, breaks[d]) + b"\n")
                    res[d].n += 1
        for d, fs in files.items():
            for f in fs:
                f.flush()
                os.fsync(f.fileno())
                f.close()
            res[d].line_breaks = breaks[d][0]
            expected = info.directions[d].n
            if res[d].n != expected:
                raise ScaletrainError(f"{shard_dir}: split {split!r} direction {d}: read {res[d].n} pairs, "
                                      f"the manifest says {expected}")
        for e in res.values():
            os.replace(temp_path(e.src_path), e.src_path)
            os.replace(temp_path(e.tgt_path), e.tgt_path)
    finally:
        for fs in files.values():
            for f in fs:
                f.close()
                Path(f.name).unlink(missing_ok=True)  # only left if something failed
    return list(res.values())
