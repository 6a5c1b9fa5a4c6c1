"""Atomic, resumable checkpoints: the train-time side (:class:`CheckpointManager`) and the on-disk
format it writes (tags, ``latest``, ``index.json`` and its verification, RNG states, the data position,
the vocabulary files). The engine's part is :mod:`scaletrain.checkpoint.engine_state`; loading a
checkpoint for evaluate/translate/export is :mod:`scaletrain.checkpoint.inference`.

Layout of a run directory::

    OUT/checkpoints/step-0000100/      engine state (engine_state.py): engine.json (layout, LR schedule),
                                       model.safetensors + optimizer.bin, or DeepSpeed's files;
                                       expert_shard_ep*.pt under expert parallelism
                     rank00000.pt      this rank's data-stream state and RNG states
                     trainer_state.json step, tokens/examples seen, world size, MLflow run id, the corpus
                                       record (compat.py), a warm start's source (train.init_from), the
                                       token budget (data.max_tokens, which a resume of ``auto`` keeps)
                     config.yaml       the resolved config
                     langs.json        vocabulary languages (manifest order)
                     vocab.json, *.model  a SentencePiece vocabulary's record and model (subword runs only)
                     index.json        sha256 and size of every file above, written last
    OUT/checkpoints/latest             name of the newest complete checkpoint
    OUT/checkpoints/best/              the best checkpoint's files as hard links, best.json (keep_copy)

A checkpoint is written under ``step-N.partial`` and renamed when every rank has finished, then
``latest`` is replaced atomically: a crash during a save leaves the previous checkpoint loadable and
``latest`` never names a partial one. Resume verifies ``index.json`` and falls back to the newest intact
checkpoint (``train.on_corrupt_checkpoint``); every file is loaded weights-only (``scaletrain.safeload``).
At another world size (:meth:`CheckpointManager.load`) every old rank's ``rankRRRRR.pt`` is read: the
data position moves to the new ranks (``scaletrain.data.position.states_for_layout``) and the RNG streams
are re-derived by the trainer.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scaletrain.checkpoint.engine_state import load_engine_state, save_engine_state
from scaletrain.checkpoint.layout import saved_layout
from scaletrain.errors import ScaletrainError
from scaletrain.fileio import atomic_write_text, default_mode, sha256_file
from scaletrain.oom import OutOfMemory, is_oom, memory_summary
from scaletrain.safeload import safe_torch_load

TAG_RE = re.compile(r"^step-(\d+)$")
INDEX = "index.json"  # per-file sha256 and size, written last inside step-N.partial before the rename
log = logging.getLogger("scaletrain")


class CorruptCheckpoint(ScaletrainError):
    """A checkpoint file is missing, truncated or changed (does not match the checkpoint's index)."""


def _looks_like_io_error(e: RuntimeError) -> bool:
    """torch.save reports a full disk as RuntimeError('... iostream error' / 'PytorchStreamWriter failed ...')."""
    text = str(e).lower()
    return any(w in text for w in ("iostream", "streamwriter", "write", "file", "disk", "space"))


def write_index(ckpt_dir: Path) -> None:
    """Record every file of ``ckpt_dir`` (sha256, bytes) in ``index.json``, written last and atomically.
    Files a library wrote 0600 (Accelerate's ``model.safetensors``) get the mode ``open()`` gives first."""
    default_mode(ckpt_dir)
    files = {}
    for p in sorted(ckpt_dir.rglob("*")):
        if p.is_file() and p.name != INDEX and not p.name.startswith("."):
            files[p.relative_to(ckpt_dir).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    atomic_write_text(ckpt_dir / INDEX, json.dumps({"format": 1, "files": files}, indent=1))


def verify_checkpoint(ckpt_dir: Path, only=None) -> None:
    """Raise :class:`CorruptCheckpoint` naming the first file that is missing or differs from ``index.json``
    (``only``: a predicate on file names to check a subset). Checkpoints without an index (written
    before this check existed, or by ``average``) are not verified."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / INDEX
    if not index.is_file():
        return
    try:
        files = json.loads(index.read_text())["files"]
        items = [(name, int(rec["bytes"]), str(rec["sha256"])) for name, rec in files.items()]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"{index}: unreadable checkpoint index ({type(e).__name__}: {e})") from None
    for name, size, sha in items:
        if only is not None and not only(name):
            continue
        p = ckpt_dir / name
        if not p.is_file():
            raise CorruptCheckpoint(f"{p}: missing (listed in {index})")
        actual = p.stat().st_size
        if actual != size:
            raise CorruptCheckpoint(f"{p}: truncated or corrupt ({actual} bytes, {size} when written)")
        if sha256_file(p) != sha:
            raise CorruptCheckpoint(f"{p}: corrupt (sha256 differs from {index})")


def rng_state() -> dict:
    """Every RNG state as tensors and plain types (a weights-only load reads them back; no pickled objects)."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    st = {
        "python": {"version": int(version), "state": torch.tensor(words, dtype=torch.int64),
                   "gauss": None if gauss is None else float(gauss)},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    """Restore every RNG state :func:`rng_state` recorded (CUDA's only where CUDA is available)."""
    py, npst = st["python"], st["numpy"]
    random.setstate((py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss"]))
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached_gaussian"]))
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def tag_for(step: int) -> str:
    return f"step-{step:07d}"


def latest_tag(ckpt_root: Path) -> str | None:
    f = ckpt_root / "latest"
    if not f.is_file():
        return None
    tag = f.read_text().strip()
    if not (ckpt_root / tag / "trainer_state.json").is_file():
        raise ScaletrainError(f"{f} names {tag!r}, which is not a complete checkpoint; remove {f} or fix it")
    return tag


@dataclass
class CheckpointContents:
    """What a checkpoint holds besides the engine's state: the trainer's counters (``trainer_state.json``,
    rank 0), this rank's state (``rank_state``: the data position; the RNG states are added at the save), the
    resolved config, the vocabulary's languages and (subword) its files."""

    trainer_state: dict
    rank_state: dict
    config_yaml: str
    langs: list[str]
    vocab: Any = None


class CheckpointManager:
    """Writes, prunes, verifies and restores the checkpoints of one run directory.

    ``save_every``: :meth:`due` says a checkpoint is due every that many steps (0 = only when forced: a new
    best, the end of training, ``train.save_every_minutes``). ``on_save_error``: ``stop`` (a failed save
    raises one line naming the path and the free space) or ``continue`` (warn and train on without that
    checkpoint); either way the partial directory is removed and the previous checkpoint stays intact.
    """

    def __init__(self, out_dir: Path, engine, keep_last: int, save_every: int = 0, on_save_error: str = "stop"):
        self.root = Path(out_dir) / "checkpoints"
        self.engine = engine
        self.keep_last = keep_last
        self.save_every = save_every
        self.on_save_error = on_save_error

    def due(self, step: int) -> bool:
        """A checkpoint is due after ``step`` (``train.save_every``)."""
        return bool(self.save_every and step % self.save_every == 0)

    def _any(self, failed: bool) -> bool:
        """True on every rank if any rank failed (a collective; a world of one needs none)."""
        if self.engine.world_size == 1:
            return failed
        return self.engine.parallel.all_reduce_sum([1.0 if failed else 0.0])[0] > 0

    def remove_stale_partials(self) -> list[str]:
        """Remove ``step-N.partial`` directories left by a crash or a failed save (rank 0, at start)."""
        if not self.root.is_dir():
            return []
        stale = sorted(p.name for p in self.root.iterdir() if p.is_dir() and p.name.endswith(".partial"))
        for name in stale:
            shutil.rmtree(self.root / name, ignore_errors=True)
        if stale:
            log.warning("removed %d unfinished checkpoint(s) left by an earlier run: %s", len(stale), ", ".join(stale))
        return stale

    def save(self, step: int, contents: CheckpointContents) -> Path | None:
        """Write the checkpoint of ``step`` (collective). Returns its directory, or None when the save failed
        under ``on_save_error=continue``."""
        eng = self.engine
        tag = tag_for(step)
        pdir = self.root / (tag + ".partial")
        error = None
        if eng.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(pdir, ignore_errors=True)  # left by a crash
            except OSError as e:
                error = e
        eng.parallel.barrier()
        if error is None:
            try:  # every rank writes its part
                save_engine_state(eng, pdir)
                pdir.mkdir(parents=True, exist_ok=True)
                torch.save({**contents.rank_state, "rng": rng_state()}, pdir / f"rank{eng.rank:05d}.pt")
                if eng.is_main:
                    atomic_write_text(pdir / "trainer_state.json", json.dumps(contents.trainer_state, indent=2))
                    atomic_write_text(pdir / "config.yaml", contents.config_yaml)
                    atomic_write_text(pdir / "langs.json", json.dumps(contents.langs))
                    save_vocab_files(contents.vocab, pdir)
            except (OSError, RuntimeError, MemoryError) as e:  # out of memory (ZeRO-3 gathers, a CPU copy) too
                if not isinstance(e, OSError) and not (_looks_like_io_error(e) or is_oom(e)):
                    raise
                error = e
                if is_oom(e):  # one line, with the cause kept for --debug
                    error = OutOfMemory(f"writing checkpoint {tag}", memory=memory_summary(eng.device))
                    error.__cause__ = e
        if self._any(error is not None):
            return self._save_failed(pdir, error)
        if eng.is_main:
            try:  # the index is written last, over the files every rank wrote (all of them are done)
                write_index(pdir)
                final = self.root / tag
                if final.exists():
                    shutil.rmtree(final)
                os.replace(pdir, final)
                atomic_write_text(self.root / "latest", tag + "\n")
                self._prune()
            except OSError as e:
                error = e
        if self._any(error is not None):
            return self._save_failed(pdir, error)
        return self.root / tag

    def _save_failed(self, pdir: Path, error: BaseException | None) -> None:
        eng = self.engine
        if eng.is_main:
            shutil.rmtree(pdir, ignore_errors=True)
        eng.parallel.barrier()
        try:
            free = f"{shutil.disk_usage(self.root).free / 2**20:,.1f} MiB free"
        except OSError:
            free = "free space unknown"
        prev = None
        try:
            prev = self.latest()
        except ScaletrainError:
            pass
        where = getattr(error, "filename", None) or pdir
        what = (f"{getattr(error, 'strerror', None) or error}" if error is not None
                else "another rank failed to write its part (see its message)")
        keep = f"the previous checkpoint {self.root / prev} is intact" if prev else "no earlier checkpoint exists"
        msg = (f"could not write checkpoint {pdir.name.removesuffix('.partial')}: {what} ({where}); {free} on "
               f"{self.root}; {keep}")
        if self.on_save_error == "continue":
            if eng.is_main:
                log.warning("%s; training continues without it (train.on_save_error=continue)", msg)
            return None
        if isinstance(error, OutOfMemory):  # its partial directory removed above, ``latest`` unchanged
            error.fix = ("the state gathered for saving did not fit: leave it more room (a lower data.max_tokens), "
                         "or set train.on_save_error=continue to train on without such a checkpoint")
            error.after = f"{keep}; re-run the same command to resume"
            raise error
        raise ScaletrainError(f"{msg}; free space or fix permissions, then re-run the same command to resume "
                              "(or set train.on_save_error=continue to train on without saving)")

    def verify(self, tag: str) -> None:
        verify_checkpoint(self.root / tag)

    def resume_tag(self, on_corrupt: str = "fallback") -> str | None:
        """The checkpoint to resume from: ``latest`` if its files match its index, else (``fallback``) the
        newest intact earlier one, with a warning; ``stop`` raises the first mismatch. Rank 0 reads and
        hashes the files; every rank gets the same answer (collective)."""
        eng = self.engine
        answer: tuple[str | None, str | None] = (None, None)
        if eng.is_main:
            try:
                answer = (self._find_intact(on_corrupt), None)
            except ScaletrainError as e:
                answer = (None, str(e))
        if eng.world_size > 1:
            answer = eng.parallel.broadcast_object(answer)
        tag, err = answer
        if err:
            raise ScaletrainError(err)
        return tag

    def _find_intact(self, on_corrupt: str) -> str | None:
        latest = self.latest()
        if latest is None:
            return None
        tags = sorted((p.name for p in self.root.iterdir()
                       if TAG_RE.match(p.name) and (p / "trainer_state.json").is_file() and p.name <= latest),
                      reverse=True)
        problems = []
        for tag in tags:
            try:
                self.verify(tag)
            except CorruptCheckpoint as e:
                if on_corrupt == "stop":
                    raise ScaletrainError(f"{e}; set train.on_corrupt_checkpoint=fallback to resume from the "
                                          "newest intact earlier checkpoint") from None
                problems.append(str(e))
                log.warning("%s; falling back to the previous checkpoint (train.on_corrupt_checkpoint=fallback)", e)
                continue
            if problems:
                log.warning("resuming from %s, the newest intact checkpoint", self.root / tag)
            return tag
        raise ScaletrainError(f"no intact checkpoint in {self.root} ({'; '.join(problems)}); "
                              "start a new train.out_dir or set train.resume=false")

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        tags = sorted((p.name for p in self.root.iterdir() if TAG_RE.match(p.name)), reverse=True)
        for old in tags[self.keep_last :]:
            shutil.rmtree(self.root / old, ignore_errors=True)

    def latest(self) -> str | None:
        return latest_tag(self.root)

    def load(self, tag: str) -> "Loaded":
        """Restore the engine's state from checkpoint ``tag`` at this run's layout (``engine_state.py``; another
        world size, ZeRO stage or engine through ``reshard.py``). Returns the trainer state and the rank
        states: at the world size it was written with, this rank's (its RNG states set); at another, every
        old rank's, in rank order (the caller moves the data position to the new layout and re-derives the
        RNG streams: the old ranks' streams belong to ranks that no longer exist)."""
        d = self.root / tag
        trainer_state = json.loads((d / "trainer_state.json").read_text())
        saved_world, eng = int(trainer_state.get("world_size") or 0), self.engine
        if saved_world != eng.world_size and saved_layout(d) is None:
            raise ScaletrainError(
                f"checkpoint {d} was written by {saved_world} ranks but this run has {eng.world_size}, before "
                "checkpoints recorded their layout (engine.json): relaunch with the old rank count to resume it")
        load_engine_state(eng, d)
        if saved_world == eng.world_size:
            rank_state = self._rank_state(d, eng.rank)
            set_rng_state(rank_state.pop("rng"))
            return Loaded(trainer_state, [rank_state], True)
        states = [self._rank_state(d, r) for r in range(saved_world)]
        for st in states:
            st.pop("rng")
        return Loaded(trainer_state, states, False)

    @staticmethod
    def _rank_state(d: Path, rank: int) -> dict:
        rank_file = d / f"rank{rank:05d}.pt"
        rank_state = safe_torch_load(rank_file)
        rng = rank_state.get("rng", None) if isinstance(rank_state, dict) else None
        if not isinstance(rng, dict) or not isinstance(rng.get("python"), dict):
            raise ScaletrainError(
                f"{rank_file}: not a rank state of this scaletrain (RNG states must be tensors and plain types; "
                "checkpoints written before safe loading cannot be resumed: start a new train.out_dir, or "
                "evaluate/average/export it, which do not read this file)"
            )
        return rank_state


@dataclass
class Loaded:
    """What :meth:`CheckpointManager.load` gives back besides the engine's state."""

    trainer_state: dict
    rank_states: list  # this rank's (same_world) or every old rank's, in rank order
    same_world: bool


VOCAB_FILE = "vocab.json"  # absent = byte vocabulary (checkpoints from before subword support too)


def save_vocab_files(vocab, ckpt_dir: Path) -> None:
    """A SentencePiece vocabulary travels with the checkpoint: its model file plus ``vocab.json``
    (kind, file, sha256), so evaluate/translate/average need neither the shards nor the tokenizer run."""
    if vocab is None or getattr(vocab, "kind", "byte") == "byte":
        return
    src = Path(vocab.model_path)
    shutil.copyfile(src, ckpt_dir / (src.name + ".tmp"))
    os.replace(ckpt_dir / (src.name + ".tmp"), ckpt_dir / src.name)
    atomic_write_text(ckpt_dir / VOCAB_FILE, json.dumps({"kind": vocab.kind, "file": src.name, "sha256": vocab.sha256}))


def copy_vocab_files(src_ckpt: Path, dst_dir: Path) -> None:
    """Copy ``vocab.json`` and the tokenizer file it names (``average``: the output is a checkpoint too)."""
    meta = Path(src_ckpt) / VOCAB_FILE
    if not meta.is_file():
        return
    info = json.loads(meta.read_text())
    shutil.copyfile(Path(src_ckpt) / info["file"], Path(dst_dir) / info["file"])
    shutil.copyfile(meta, Path(dst_dir) / VOCAB_FILE)


def keep_copy(ckpt_dir: str | Path, dst: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Make ``dst`` a copy of the complete checkpoint ``ckpt_dir`` (hard links, so no bytes are copied and
    it outlives the rotation of ``ckpt_dir``; files copied where links are impossible), with ``extra``'s
    ``{file name: JSON value}`` written beside its files (``best``: ``best.json``). Atomic: a reader sees
    the old ``dst`` or the new one, never a mix."""
    src, dst = Path(ckpt_dir), Path(dst)
    if not (src / "trainer_state.json").is_file():
        raise ScaletrainError(f"{src} is not a complete checkpoint (no trainer_state.json); save it before keeping a copy")
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)

    def link_or_copy(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, tmp, copy_function=link_or_copy)
    for name, value in (extra or {}).items():
        (tmp / name).write_text(json.dumps(value, indent=2))
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)
    return dst
