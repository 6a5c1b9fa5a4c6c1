"""The thread rule (scaletrain.threads): injected affinity, cgroup quota, ranks, idle cores and requests."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from scaletrain import threads as th
from scaletrain.threads import CpuBudget, cgroup_quota, idle_cores, local_ranks_from_env, plan_threads


def test_cores_divided_by_the_ranks_on_the_node():
    assert plan_threads(CpuBudget(tuple(range(16))), local_ranks=4)[0] == 4
    assert plan_threads(CpuBudget(tuple(range(16))), local_ranks=3)[0] == 5
    assert plan_threads(CpuBudget((0, 1)), local_ranks=2)[0] == 1
    assert plan_threads(CpuBudget((0, 1)), local_ranks=8)[0] == 1  # at least one
    n, why = plan_threads(CpuBudget((0, 1, 2, 3)), local_ranks=1)
    assert n == 4 and "4 usable core(s)" in why and "1 rank(s)" in why


def test_affinity_not_the_machine_decides():
    # a process pinned to 2 of 64 cores gets 2 threads, not 64 (torch's default counts the machine)
    assert plan_threads(CpuBudget((10, 11)), local_ranks=1)[0] == 2


def test_cgroup_quota_caps_the_cores():
    n, why = plan_threads(CpuBudget(tuple(range(8)), quota=2.5), local_ranks=1)
    assert n == 2 and "quota 2.5" in why
    assert plan_threads(CpuBudget(tuple(range(8)), quota=0.5), local_ranks=1)[0] == 1
    assert plan_threads(CpuBudget(tuple(range(8)), quota=4.0), local_ranks=2)[0] == 2


def test_request_then_omp_win_but_never_above_the_cores():
    b = CpuBudget(tuple(range(8)))
    assert plan_threads(b, local_ranks=4, requested=3, omp=6) == (3, "requested 3")
    assert plan_threads(b, local_ranks=4, omp=6) == (6, "OMP_NUM_THREADS 6")
    n, why = plan_threads(CpuBudget((0, 1)), requested=16)
    assert n == 2 and "capped" in why
    assert plan_threads(CpuBudget((0, 1)), omp=4)[0] == 2


def test_idle_cores_cap_only_the_automatic_choice():
    b = CpuBudget((0, 1, 2, 3))
    assert plan_threads(b, idle=1.0)[0] == 1  # three of four cores busy with someone else
    assert plan_threads(b, idle=2.8)[0] == 3  # a core >= 70% idle counts
    assert plan_threads(b, idle=0.0)[0] == 1
    assert plan_threads(b, idle=4.0)[0] == 4
    assert plan_threads(b, requested=4, idle=0.0)[0] == 4  # the user asked: taken as asked


def test_local_ranks_from_launcher_variables():
    assert local_ranks_from_env({"LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "2"}) == 4
    assert local_ranks_from_env({"LOCAL_SIZE": "2"}) == 2  # DeepSpeed's launcher
    assert local_ranks_from_env({}) == 1
    assert local_ranks_from_env({"LOCAL_SIZE": "x"}) == 1


def test_users_omp_value_is_the_one_launch_sh_handed_on():
    assert th.user_omp_threads({"OMP_NUM_THREADS": "3"}) == 3
    # a launcher set OMP_NUM_THREADS=1 for its ranks; the user had not set it
    assert th.user_omp_threads({"OMP_NUM_THREADS": "1", th.USER_OMP_ENV: ""}) is None
    assert th.user_omp_threads({"OMP_NUM_THREADS": "1", th.USER_OMP_ENV: "2"}) == 2
    assert th.user_omp_threads({"OMP_NUM_THREADS": "junk"}) is None


def test_cgroup_v2_and_v1_quota_files(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota(v2) == pytest.approx(1.5)
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(v2) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(tmp_path / "v1") == pytest.approx(3.0)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_quota(tmp_path / "v1") is None
    assert cgroup_quota(tmp_path / "none") is None


def _stat(rows):
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    for i, (busy, idle) in enumerate(rows):
        lines.append(f"cpu{i} {busy} 0 0 {idle} 0 0 0 0 0 0")
    return "\n".join(lines) + "\n"


def test_idle_cores_from_two_proc_stat_samples(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    ticks = [100]
    stat.write_text(_stat([(100, 100), (100, 100)]))

    def sleep(_):  # over each window cpu0 is busy all the time, cpu1 idle all the time
        ticks[0] += 100
        stat.write_text(_stat([(ticks[0], 100), (100, ticks[0])]))

    monkeypatch.setattr(th.time, "sleep", sleep)
    t = os.times()
    monkeypatch.setattr(th.os, "times", lambda: t)
    assert idle_cores((0, 1), stat=str(stat)) == pytest.approx(1.0)
    assert idle_cores((1,), stat=str(stat)) == pytest.approx(1.0)  # only the CPUs we may use count
    assert idle_cores((0,), stat=str(stat)) == pytest.approx(0.0)
    assert idle_cores((0, 1), stat=str(tmp_path / "missing")) is None
    # the busy core was busy with this process (a model loading): it is ours to use
    hz = os.sysconf("SC_CLK_TCK")
    later = os.times_result((t.user + 100 / hz, *tuple(t)[1:]))
    seq = iter([t, later])
    monkeypatch.setattr(th.os, "times", lambda: next(seq))
    assert idle_cores((0, 1), stat=str(stat)) == pytest.approx(2.0)


def test_apply_threads_sets_torch_and_logs_once(monkeypatch, caplog):
    saved = torch.get_num_threads()
    monkeypatch.setattr(th.CpuBudget, "detect", classmethod(lambda cls: CpuBudget((0, 1, 2, 3))))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(th.USER_OMP_ENV, raising=False)
    monkeypatch.setattr(th, "_applied", [])
    try:
        with caplog.at_level(logging.INFO, logger="scaletrain"):
            assert th.apply_threads(local_ranks=2, cuda=False) == 2
            assert torch.get_num_threads() == 2
            assert th.apply_threads(local_ranks=2, cuda=False) == 2
            assert th.apply_threads(requested=1, cuda=False) == 1 and torch.get_num_threads() == 1
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("threads ")]
        assert lines == ["threads 2: 4 usable core(s) (affinity 4) / 2 rank(s) on this node", "threads 1: requested 1"]
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert th.apply_threads(local_ranks=2, cuda=False) == 3
        # with a GPU the CPU threads are left to torch unless asked for
        monkeypatch.delenv("OMP_NUM_THREADS")
        torch.set_num_threads(1)
        assert th.apply_threads(local_ranks=2, cuda=True) == 1
    finally:
        torch.set_num_threads(saved)


def test_engine_rank_threads_count_world_size_without_local_variables(monkeypatch):
    from types import SimpleNamespace

    from scaletrain.engine.env import configure_threads

    saved = torch.get_num_threads()
    monkeypatch.setattr(th.CpuBudget, "detect", classmethod(lambda cls: CpuBudget(tuple(range(8)))))
    for k in ("OMP_NUM_THREADS", th.USER_OMP_ENV, "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = SimpleNamespace(engine=SimpleNamespace(threads=0))
    try:
        monkeypatch.setenv("WORLD_SIZE", "4")
        assert configure_threads(cfg) == 2
        monkeypatch.setenv("LOCAL_SIZE", "2")
        assert configure_threads(cfg) == 4
        cfg.engine.threads = 3
        assert configure_threads(cfg) == 3
    finally:
        torch.set_num_threads(saved)
