"""Batch slots: the global batches depend on the slot count (data-parallel size x grad_accum), not on how the
slots are spread over ranks; a resume keeps them, or, with another slot count, loses and repeats no example.

Ranks are simulated in one process: one ``ShardStream`` per rank, read as ``example_ids`` (the split's example
numbers of each batch, no collation)."""
from __future__ import annotations

import hashlib
import itertools
import json
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from scaletrain.data.batch import Example
from scaletrain.data.loader import ShardLoader
from scaletrain.data.position import states_for_layout, upgrade
from scaletrain.data.shards import Manifest, SplitWriter, prepare_out_dir, write_manifest
from scaletrain.data.stream import ShardStream
from scaletrain.errors import ScaletrainError

LANGS = ["en", "de", "ja"]
KW = dict(max_tokens=700, max_bytes=64, buffer_size=2, seed=3)
N = 700


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """700 examples of varied lengths in 22 blocks of 32 (3 windows per epoch at 4 slots, 6 at 2)."""
    rng = np.random.default_rng(0)
    out = prepare_out_dir(tmp_path_factory.mktemp("slots"), overwrite=True)
    splits = {}
    for split, n in (("train", N), ("valid", 150)):
        w = SplitWriter(out, split, LANGS, shard_size=200, block_size=32)
        w.add_all(Example(0, 1 + i % 2, f"s{i}".encode() + b"a" * int(rng.integers(0, 60)),
                          f"t{i}".encode() + b"b" * int(rng.integers(0, 60))) for i in range(n))
        splits[split] = w.close()
    write_manifest(out, Manifest(LANGS, splits))
    return out


def rank_streams(d, dp: int, accum: int, **kw):
    return [ShardStream(d, rank=r, world_size=dp, grad_accum=accum, **{**KW, **kw}) for r in range(dp)]


def read_updates(streams: list, n: int | None = None) -> list[list[tuple]]:
    """The next ``n`` updates (all, when None) of a layout's rank streams: per update, each slot's batch as a
    sorted tuple of example ids, slots in order (slot s = rank s // accum, micro-batch s % accum)."""
    its = [s.example_ids() for s in streams]
    accum = streams[0].grad_accum
    out = []
    for _ in itertools.count() if n is None else range(n):
        update = []
        for it in its:
            got = list(itertools.islice(it, accum))
            if not got:
                assert not update, "ranks ran out of batches at different updates"
                return out
            assert len(got) == accum
            update += [tuple(sorted(x.tolist())) for x in got]
        out.append(update)
    return out


def ids_of(updates) -> Counter:
    return Counter(i for u in updates for b in u for i in b)


def test_slot_layouts_read_the_same_updates(shards):
    """2 ranks x 1 micro-batch, 1 rank x 2 micro-batches: the same examples in the same updates (also 4 slots as
    4x1, 2x2, 1x4); an epoch holds every example once, and the loader with worker processes agrees."""
    epochs = {}
    for slots, layouts in ((2, ((2, 1), (1, 2))), (4, ((4, 1), (2, 2), (1, 4)))):
        runs = [read_updates(rank_streams(shards, dp, a, epochs=1)) for dp, a in layouts]
        assert len(runs[0]) > 10 and all(len(u) == slots for u in runs[0])
        assert all(r == runs[0] for r in runs[1:]), f"{slots} slots: layouts {layouts} read different updates"
        assert ids_of(runs[0]) == Counter(range(N))
        epochs[slots] = runs[0]
    assert epochs[2] != epochs[4][: len(epochs[2])]  # the slot count, not the layout, decides the batches
    kw = dict(rank=1, world_size=2, grad_accum=2, epochs=1, **KW)
    ref = list(ShardStream(shards, **kw))
    got = list(ShardLoader(shards, num_workers=2, chunk=3, **kw))
    assert len(got) == len(ref) == 2 * len(epochs[4])
    assert all(torch.equal(x.src, y.src) and torch.equal(x.tgt_out, y.tgt_out) for x, y in zip(got, ref))


@pytest.mark.parametrize("k", [5, 13])
def test_resume_in_another_layout_with_the_same_slots_continues_the_same_updates(shards, k):
    """Save every rank's state at update k under 2 ranks x 1, resume as 1 rank x 2 (and back, and 4 x 1 as
    2 x 2): the following updates are the uninterrupted run's, into the next epoch."""
    for (dp, a), (dp2, a2) in (((2, 1), (1, 2)), ((1, 2), (2, 1)), ((4, 1), (2, 2))):
        full = read_updates(rank_streams(shards, dp, a, epochs=2))
        old = rank_streams(shards, dp, a, epochs=2)
        head = read_updates(old, k)
        states = [json.loads(json.dumps(s.state_dict())) for s in old]
        new = rank_streams(shards, dp2, a2, epochs=2)
        for s, st in zip(new, states_for_layout(states, dp2, a2)):
            s.load_state_dict(st)
            assert s.state_dict()["carry"] is None  # the same slot count: the same sequence, nothing regrouped
        assert head + read_updates(new) == full, ((dp, a), (dp2, a2))
        if dp2 == 1:  # without states_for_layout: any old rank's state loads as is
            direct = rank_streams(shards, dp2, a2, epochs=2)
            direct[0].load_state_dict(states[-1])
            assert head + read_updates(direct) == full


@pytest.mark.parametrize("k", [0, 3, 6, 9])
@pytest.mark.parametrize("to", [(1, 1), (2, 2), (3, 1)])
def test_resume_with_another_slot_count_loses_and_repeats_no_example(shards, k, to):
    """2 ranks x 1 for k updates, then another global batch: the epoch's examples are every example once, the
    new ranks stay in step, and the state says the unread rest of the window is regrouped (a carry)."""
    old = rank_streams(shards, 2, 1, epochs=1)
    head = read_updates(old, k)
    window_start = old[0].state_dict()["batch"] == 0
    new = rank_streams(shards, *to, epochs=1)
    for s, st in zip(new, states_for_layout([s.state_dict() for s in old], *to)):
        s.load_state_dict(json.loads(json.dumps(st)))
        assert s.state_dict()["config"]["slots"] == to[0] * to[1]
        assert (s.state_dict()["carry"] is None) == window_start
    rest = read_updates(new)
    assert rest and all(len(u) == to[0] * to[1] for u in rest)
    assert ids_of(head) + ids_of(rest) == Counter(range(N))


def test_two_changes_inside_one_window_and_drop_last(shards):
    """2 -> 3 slots in the middle of a window, then 3 -> 1 inside the regrouped rest: still every example once.
    With drop_last the regrouping drops batches instead of splitting them, and repeats nothing."""
    old = rank_streams(shards, 2, 1, epochs=1)
    head = read_updates(old, 2)
    mid = rank_streams(shards, 3, 1, epochs=1)
    for s, st in zip(mid, states_for_layout([s.state_dict() for s in old], 3, 1)):
        s.load_state_dict(st)
    middle = read_updates(mid, 1)
    last = rank_streams(shards, 1, 1, epochs=1)
    (st,) = states_for_layout([s.state_dict() for s in mid], 1, 1)
    assert st["carry"]["regroups"] == [[3, 1]]
    last[0].load_state_dict(st)
    assert ids_of(head) + ids_of(middle) + ids_of(read_updates(last)) == Counter(range(N))
    old = rank_streams(shards, 2, 1, epochs=1, drop_last=True)
    head = read_updates(old, 3)
    new = rank_streams(shards, 3, 1, epochs=1, drop_last=True)
    for s, st in zip(new, states_for_layout([s.state_dict() for s in old], 3, 1)):
        s.load_state_dict(st)
    seen = ids_of(head) + ids_of(read_updates(new))
    kept = [len(ids_of(read_updates(rank_streams(shards, dp, 1, epochs=1, drop_last=True)))) for dp in (2, 3)]
    assert max(seen.values()) == 1 and min(kept) <= len(seen) < N  # drop_last drops, as in either layout


def test_old_one_slot_per_rank_checkpoint_resumes_exactly(shards):
    """A state written before slots (version 1, world_size 2, one slot per rank; as a stream's or as a loader's
    with 0/1 worker) resumes the same batches: that layout's sequence is unchanged."""
    full = [x.tolist() for x in ShardStream(shards, rank=1, world_size=2, epochs=1, **KW).example_ids()]
    old = ShardStream(shards, rank=1, world_size=2, epochs=1, **KW)
    head = [x.tolist() for x in itertools.islice(old.example_ids(), 7)]
    v2 = old.state_dict()
    assert v2["origin"] == 0 and v2["carry"] is None and v2["micro"] == 0
    v1 = _as_version_1(v2)
    for state in (v1, {"version": 1, "num_workers": 1, "next": 0, "chunk": 1, "positions": [v1]}):
        s = ShardStream(shards, rank=1, world_size=2, epochs=1, **KW)
        s.load_state_dict(state)
        assert head + [x.tolist() for x in s.example_ids()] == full
    fresh = {"version": 1, "num_workers": 2, "next": 0, "chunk": 8, "positions": [None, None]}  # before a batch
    s = ShardStream(shards, rank=1, world_size=2, epochs=1, **KW)
    s.load_state_dict(states_for_layout([fresh, fresh], 2, 1)[1])
    assert [x.tolist() for x in s.example_ids()] == full
    with pytest.raises(ScaletrainError, match="max_tokens: saved 700 now 800"):
        ShardStream(shards, **{**KW, "max_tokens": 800}).load_state_dict(v1)
    with pytest.raises(ScaletrainError, match="invalid data-stream state"):
        upgrade({"version": 1, "num_workers": 2, "positions": [v1]})


def test_one_slot_per_rank_batches_are_the_previous_versions(shards):
    """With one micro-batch per rank the batches are exactly those the version before batch slots made (its
    checkpoints resume bit for bit): checksums of two epochs' tensors, taken with that version on this fixture.
    (A numpy release that changed its generators' streams would change them too, and break those resumes.)"""
    for kw, n, digest in ((dict(rank=1, world_size=2), 124, "fdeebef55f84fb55"),
                          (dict(rank=0, world_size=3, temperature=2.0), 93, "929c9c7e3a8cdc44")):
        h = hashlib.sha256()
        batches = list(ShardStream(shards, epochs=2, **kw, **KW))
        for b in batches:
            h.update(b.src.numpy().tobytes() + b.tgt_out.numpy().tobytes())
        assert (len(batches), h.hexdigest()[:16]) == (n, digest), kw


def _as_version_1(v2: dict) -> dict:
    """A stream state as the version before slots wrote it (its world_size was the slot count)."""
    return {"version": 1, "epoch": v2["epoch"], "window": v2["window"], "batch": v2["batch"],
            "config": {("world_size" if k == "slots" else k): v for k, v in v2["config"].items()},
            "skipped_blocks": v2["skipped_blocks"], "skipped_total": v2["skipped_total"]}


def test_old_worker_slot_checkpoint_resumes_without_loss(shards):
    """A loader state of the old worker slots (1 rank x 2 workers = 2 slots; worker 0 already past the window
    worker 1 is still reading) resumes in 1 rank x 1: every example of the epoch once."""
    slot = [ShardStream(shards, rank=v, world_size=2, epochs=1, **KW) for v in range(2)]
    its = [s.example_ids() for s in slot]
    seen = Counter()
    while slot[0].state_dict()["window"] < 2:  # worker 0: through window 1
        seen.update(next(its[0]).tolist())
    while (slot[1].state_dict()["window"], slot[1].state_dict()["batch"]) < (1, 2):  # worker 1: into window 1
        seen.update(next(its[1]).tolist())
    state = {"version": 1, "num_workers": 2, "next": 1, "chunk": 8,
             "positions": [_as_version_1(s.state_dict()) for s in slot]}
    new = ShardStream(shards, epochs=1, **KW)
    new.load_state_dict(json.loads(json.dumps(state)))
    carry = new.state_dict()["carry"]
    assert seen + Counter(i for ids in new.example_ids() for i in ids.tolist()) == Counter(range(N))
    assert carry["starts"] == [None, 2] and carry["window"] == 1  # worker 0 read window 1, worker 1 2 batches


def test_states_for_layout_refuses_ranks_at_different_positions(shards):
    a, b = rank_streams(shards, 2, 1)
    next(iter(a))
    with pytest.raises(ScaletrainError, match="rank 1 differs from rank 0's in \\['batch'\\]"):
        states_for_layout([a.state_dict(), b.state_dict()], 1, 2)
    c = ShardStream(shards, rank=0, world_size=1, grad_accum=2, **KW)
    it = iter(c)
    next(it)
    with pytest.raises(ScaletrainError, match="inside an update"):
        ShardStream(shards, **KW).load_state_dict(c.state_dict())


def test_loaders_split_by_the_parallel_contexts_rank(shards):
    """``ShardLoader.for_run(parallel=ctx)`` reads ``ctx.rank`` of ``ctx.world_size`` (every rank is data
    parallel; an expert-parallel dimension does not split the data): on a world of 2 with ``ep_size`` 2 each rank
    reads its own batches, as a plain stream of that rank; validation too."""
    from scaletrain.config import Config

    d = Config().data
    d.shards, d.max_tokens, d.max_bytes, d.buffer_size, d.seed = str(shards), 700, 64, 2, 3
    want = {r: [b.src for b in itertools.islice(ShardStream(shards, rank=r, world_size=2, **KW), 12)] for r in (0, 1)}
    assert not all(torch.equal(x, y) for x, y in zip(want[0], want[1]))
    for world_rank in range(2):
        ctx = SimpleNamespace(rank=world_rank, world_size=2, ep_rank=world_rank, ep_size=2, edp_rank=0, edp_size=1)
        got = [b.src for b in itertools.islice(ShardLoader.for_run(d, "train", parallel=ctx), 12)]
        assert len(got) == 12 and all(torch.equal(x, y) for x, y in zip(got, want[world_rank]))
        assert ShardLoader.for_run(d, "train", parallel=ctx, grad_accum=2).state_dict()["config"]["slots"] == 4
        valid = [b.src for b in ShardLoader.for_run(d, "valid", parallel=ctx)]
        ref = ShardStream(shards, "valid", rank=world_rank, world_size=2, seed=0, epochs=1, max_tokens=700,
                          max_bytes=64)
        assert len(valid) > 1 and all(torch.equal(x, y.src) for x, y in zip(valid, ref))


def test_a_regroup_that_drops_or_repeats_batches_says_so(caplog):
    """The rest of a window regrouped for another slot count: batches split where they can be; where the
    examples are too few to split (one-example batches) the shortfall is repeated, with ``drop_last`` the surplus
    dropped, and each says so in one warning with the count; an even regroup says nothing."""
    from scaletrain.data.stream import WindowPlanner

    ones = [(s, np.array([i])) for i, s in enumerate((0, 1, 0))]
    with caplog.at_level("WARNING", logger="scaletrain.data.stream"):
        out = WindowPlanner._regroup(SimpleNamespace(drop_last=False), ones, 2)
        assert len(out) == 4 and out[3] == ones[0]
        assert WindowPlanner._regroup(SimpleNamespace(drop_last=True), ones, 2) == ones[:2]
        assert len(WindowPlanner._regroup(SimpleNamespace(drop_last=False), [(0, np.arange(4))] * 3, 2)) == 4
        assert WindowPlanner._regroup(SimpleNamespace(drop_last=False), ones, 2, say=False)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["data stream: regrouping 3 batch(es) 2 to an update repeats 1 batch(es) (too few examples left "
                    "to split); those examples are read twice in this epoch",
                    "data stream: regrouping 3 batch(es) 2 to an update drops the last 1 (data.drop_last); their "
                    "examples are not read in this epoch"]
