"""A global batch changed in the middle of an epoch, through the trainer: a run of 1 rank x ``engine.grad_accum=2``
saves mid-window while the next update's batches are read ahead and dies, and a resume at ``grad_accum=3`` (another slot count: ``scaletrain.data.position.change_slots``
regroups the window's unread batches) trains on into the next epoch. Every example of the epoch is trained on
exactly once, counted from what the trained batches hold: each source sentence starts with its example's number
in the shards (``s<i>|``), read back from the batches' byte ids, not from the stream's position bookkeeping.

``tests/unit/test_data_slots.py`` checks the streams alone; this runs the real Trainer (its prefetcher, the
checkpoint's stream position, the resume) over the real Engine with a minimal backend, in this process."""
from __future__ import annotations

import re
import shutil
from collections import Counter

import numpy as np
import pytest

from scaletrain.config import load_config
from scaletrain.data.batch import Example
from scaletrain.data.shards import Manifest, SplitWriter, prepare_out_dir, write_manifest
from scaletrain.safeload import safe_torch_load
from test_engine_loop import TINY, SkippingEngine

N = 300
BYTE0 = 4  # the byte ids follow the 4 specials (scaletrain.vocab)
pytestmark = pytest.mark.usefixtures("isolated_env")


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """300 numbered examples of varied lengths in blocks of 16 (19 blocks: windows of 2 blocks per slot)."""
    rng = np.random.default_rng(0)
    out = prepare_out_dir(tmp_path_factory.mktemp("numbered"), overwrite=True)
    splits = {}
    for split, n in (("train", N), ("valid", 40)):
        w = SplitWriter(out, split, ["en", "de", "ja"], shard_size=100, block_size=16)
        w.add_all(Example(0, 1 + i % 2, f"s{i}|".encode() + b"a" * int(rng.integers(0, 30)),
                          b"b" * int(rng.integers(1, 30))) for i in range(n))
        splits[split] = w.close()
    write_manifest(out, Manifest(["en", "de", "ja"], splits))
    return out


def _ids(batch) -> list[int]:
    """The example numbers of a batch's rows, from their source bytes."""
    out = []
    for row in batch.src.tolist():
        text = bytes(t - BYTE0 for t in row if BYTE0 <= t < BYTE0 + 256)
        out.append(int(re.match(rb"s(\d+)\|", text).group(1)))
    return out


def _train(shards, out, accum: int, steps: int, monkeypatch, *over) -> list[list[int]]:
    """Train (resuming ``out`` if it has a checkpoint) to ``steps`` updates; the example numbers of every
    micro-batch of the updates trained, in order."""
    from scaletrain.train import Trainer, trainer as trainer_module
    from scaletrain.train.unit import StopVote, train_step as step

    trained = []

    def spy(engine, unit, micro, **kw):
        got = step(engine, unit, micro, **kw)
        if not isinstance(got, StopVote):
            trained.append([_ids(b) for b in micro])
        return got

    monkeypatch.setattr(trainer_module, "train_step", spy)
    cfg = load_config("small", [*TINY, f"data.shards={shards}", f"train.out_dir={out}", "train.resume=true",
                                "data.buffer_size=2", "data.num_workers=0", f"engine.grad_accum={accum}",
                                f"train.max_steps={steps}", *over])
    t = Trainer(cfg, engine=SkippingEngine(cfg, skip=()))
    try:
        t.fit()
    finally:
        t.close()
    return trained


def _crash_after(out, k: int) -> None:
    """The job died after the checkpoint of update ``k`` (saved while update k + 1's batches were read ahead):
    the later checkpoint is gone, ``latest`` names update k's."""
    root = out / "checkpoints"
    for d in root.glob("step-*"):
        if int(d.name.split("-")[1]) > k:
            shutil.rmtree(d)
    (root / "latest").write_text(f"step-{k:07d}")


def _first_epoch(batches: list[list[int]]) -> list[list[int]]:
    """The shortest run of leading batches that holds every example number at least once."""
    seen = set()
    for n, b in enumerate(batches, 1):
        seen.update(b)
        if len(seen) == N:
            return batches[:n]
    raise AssertionError(f"the batches hold {len(seen)} of the {N} examples (some lost, or the run ended inside the epoch)")


@pytest.mark.parametrize("k", [2, 4])
def test_a_global_batch_change_mid_epoch_trains_every_example_once(numbered, tmp_path, monkeypatch, k):
    """Updates at 2 micro-batches, a checkpoint at update ``k`` (in the middle of a window: the regrouped rest of
    it is a carry), the job dies after update k + 1; the resume trains 16 updates at 3 micro-batches."""
    out = tmp_path / "run"
    head = _train(numbered, out, 2, k + 1, monkeypatch, f"train.save_every={k}")[:k]
    _crash_after(out, k)
    stream = safe_torch_load(out / "checkpoints" / f"step-{k:07d}" / "rank00000.pt")["stream"]
    assert stream["config"]["slots"] == 2 and stream["epoch"] == 0 and stream["batch"] > 0, stream  # mid-window
    tail = _train(numbered, out, 3, k + 16, monkeypatch)
    assert [len(u) for u in head + tail] == [2] * k + [3] * 16
    batches = [b for update in head + tail for b in update]
    epoch = _first_epoch(batches)
    counts = Counter(i for b in epoch for i in b)
    assert counts == Counter(range(N)), {i: c for i, c in counts.items() if c != 1}
    assert 2 * k < len(epoch) < len(batches)  # the epoch ended after the change; the next one began
