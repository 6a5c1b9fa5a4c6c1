"""The lost-host heartbeat's logic with a fake store and a fake clock, the line it prints, and the exit codes
(76 for a lost peer: retry, distinct from 2, 71 and 75)."""
from __future__ import annotations

import pytest

from scaletrain.engine.env import Peers
from scaletrain.engine.heartbeat import DONE, PEER_LOST_EXIT, Heartbeat, PeerLost, interval_for, lost_line
from scaletrain.oom import OOM_EXIT
from scaletrain.train.preemption import PREEMPTED_EXIT


class FakeStore:
    def __init__(self):
        self.d: dict[str, int] = {}
        self.down = False

    def add(self, k, n):
        if self.down:
            raise RuntimeError("store unreachable")
        self.d[k] = self.d.get(k, 0) + n
        return self.d[k]

    def multi_get(self, keys):
        if self.down:
            raise RuntimeError("store unreachable")
        return [str(self.d[k]).encode() for k in keys]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


TABLE = [("host0", 10), ("host0", 11), ("host1", 20), ("host1", 21)]


def _beats(store, clock, timeout=10.0):
    return [Heartbeat(store, r, 4, timeout, 1.0, clock=clock) for r in range(4)]


def test_a_host_whose_counters_stop_is_lost_after_the_timeout_and_not_before():
    store, clock = FakeStore(), Clock()
    hb = _beats(store, clock)
    for _ in range(5):  # everyone beats
        clock.t += 1
        for h in hb:
            assert h.poll() == ([], False)
    for step in range(1, 13):  # host1 (ranks 2, 3) stops beating
        clock.t += 1
        got = [hb[r].poll() for r in (0, 1)]
        if step < 11:  # rank 0 last saw their counters move at its poll of step 1 (before they beat at step 0)
            assert got == [([], False)] * 2, step
        else:
            assert got == [([2, 3], False)] * 2, step


def test_a_finished_rank_is_never_lost_and_an_unreachable_store_is():
    store, clock = FakeStore(), Clock()
    hb = _beats(store, clock)
    for h in hb:
        h.poll()
    hb[3].done()
    assert store.d[hb[3].keys[3]] >= DONE
    for _ in range(20):
        clock.t += 1
        for r in (0, 1, 2):
            assert hb[r].poll() == ([], False)
    store.down = True  # rank 0's host (the store) cut off
    for step in range(1, 12):
        clock.t += 1
        assert hb[2].poll() == ([], step >= 10), step


def test_confirm_names_the_ranks_whose_counters_do_not_move_after_a_failure():
    store, clock = FakeStore(), Clock()
    hb = _beats(store, clock)
    for h in hb:
        h.poll()

    def sleep(s):  # alive ranks 1 and 2 keep beating while rank 0 waits; rank 3 was killed
        clock.t += s
        hb[1].beat()
        hb[2].beat()

    assert hb[0].confirm(sleep=sleep) == ([3], False)
    assert clock.t - 100.0 >= 3.0  # three intervals


def test_interval_is_a_tenth_of_the_timeout_within_bounds():
    assert interval_for(60) == 2.0 and interval_for(5) == 0.5 and interval_for(0.5) == 0.2


def test_the_line_names_the_lost_host_its_ranks_the_checkpoint_and_the_retry_code():
    line = lost_line(0, [2, 3], False, TABLE, 60, "the last checkpoint, /r/checkpoints/step-0000004, is intact")
    assert line.startswith("lost host1 (ranks 2, 3): no heartbeat for 60 s (engine.peer_timeout_s)")
    assert "exit 76: retry" in line and "step-0000004" in line
    line = lost_line(2, [], True, TABLE, 60, "x")
    assert line.startswith("host0 (rank 0's host, which holds the rendezvous store) is unreachable")


def test_exit_codes_are_distinct_and_the_cli_returns_76_for_a_lost_peer(monkeypatch, capsys):
    assert len({2, OOM_EXIT, PREEMPTED_EXIT, PEER_LOST_EXIT}) == 4
    from scaletrain import cli

    def boom(args):
        raise PeerLost("lost host1 (rank 1): no heartbeat")

    real = cli.build_parser

    def parser():
        p = real()
        p._subparsers._group_actions[0].choices["train"].set_defaults(func=boom)
        return p

    monkeypatch.setattr(cli, "build_parser", parser)
    assert cli.main(["train", "--config", "small"]) == PEER_LOST_EXIT
    assert "scaletrain: error: lost host1 (rank 1)" in capsys.readouterr().err


def test_explain_names_a_remote_host_from_the_heartbeat():
    p = Peers(0, 1)
    p.world_size, p.table = 4, list(TABLE)
    p.table[0] = (__import__("socket").gethostname(), p.table[0][1])
    p.table[1] = (p.table[0][0], 999999999)  # gone: "dead" is the local check; make it alive instead
    p.dead = lambda: []

    class HB:
        timeout_s = 60.0

        def confirm(self):
            return [2, 3], False

    err = p.explain(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"), HB(),
                    "the last checkpoint, /r/checkpoints/step-0000004, is intact")
    assert isinstance(err, PeerLost) and err.exit_code == PEER_LOST_EXIT
    assert str(err).startswith("lost host1 (ranks 2, 3): collective failed (")
    assert "step-0000004" in str(err)
    assert p.explain(ValueError("not a collective"), HB()) is None
