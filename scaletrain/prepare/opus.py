"""OPUS-100 release layout -> a list of parallel corpora for ``prepare_parallel``.

Layout (the root may be the folder holding ``opus-100-corpus``, that folder, its ``v1.0`` or the
``supervised`` folder)::

    opus-100-corpus/v1.0/supervised/<pair>/opus.<pair>-{train,dev,test}.{l1,l2}

with ``<pair>`` = ``en-xx`` or ``xx-en``. ``dev`` becomes the ``valid`` split. Some languages ship
a train set only: they are trained on and left out of evaluation, with a notice (logged, and
listed under ``source.no_eval`` in the manifest).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from scaletrain.errors import ScaletrainError
from scaletrain.prepare.parallel_text import ParallelCorpus

log = logging.getLogger(__name__)

OPUS_SPLITS = {"train": "train", "dev": "valid", "test": "test"}


def find_supervised(root: str | Path) -> Path:
    root = Path(root)
    cands = (root / "opus-100-corpus" / "v1.0" / "supervised", root / "v1.0" / "supervised", root / "supervised", root)
    for cand in cands:
        if cand.is_dir() and any(_pair_dirs(cand)):
            return cand
    raise ScaletrainError(
        f"{root} does not look like OPUS-100: expected <root>/v1.0/supervised/<en-xx>/opus.<en-xx>-train.<xx> files"
    )


def _pair_dirs(d: Path):
    for p in sorted(d.iterdir()):
        if p.is_dir() and p.name.count("-") == 1 and "en" in p.name.split("-"):
            yield p


def opus100_corpora(root: str | Path, langs: Sequence[str] | None = None) -> tuple[list[ParallelCorpus], dict]:
    """Corpora (xx -> en orientation) for each language and split found, plus a source description."""
    sup = find_supervised(root)
    found: dict[str, dict[str, ParallelCorpus]] = {}
    for d in _pair_dirs(sup):
        a, b = d.name.split("-")
        xx = b if a == "en" else a
        for tag, split in OPUS_SPLITS.items():
            fx, fe = d / f"opus.{d.name}-{tag}.{xx}", d / f"opus.{d.name}-{tag}.en"
            if fx.is_file() and fe.is_file():
                found.setdefault(xx, {})[split] = ParallelCorpus(split, xx, "en", str(fx), str(fe))
            elif fx.is_file() != fe.is_file():
                raise ScaletrainError(f"{d}: {fx.name if fx.is_file() else fe.name} has no counterpart "
                                      f"{fe.name if fx.is_file() else fx.name}")
    if langs is not None:
        missing = [l for l in langs if l not in found]
        if missing:
            raise ScaletrainError(f"OPUS-100 at {sup} has no data for {', '.join(missing)}; "
                                  f"available: {', '.join(sorted(found))}")
        found = {l: found[l] for l in langs}
    no_train = sorted(l for l, s in found.items() if "train" not in s)
    if no_train:
        raise ScaletrainError(f"OPUS-100 at {sup}: no train files for {', '.join(no_train)}")
    no_eval = sorted(l for l, s in found.items() if "valid" not in s and "test" not in s)
    if no_eval:
        log.warning("OPUS-100: %s have a train set only; trained on, left out of evaluation", ", ".join(no_eval))
    corpora = [c for l in sorted(found) for _, c in sorted(found[l].items())]
    source = {"type": "opus-100", "root": str(sup), "no_eval": no_eval}
    return corpora, source
