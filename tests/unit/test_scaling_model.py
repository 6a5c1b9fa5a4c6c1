"""benchmarks/scaling_model.py: the ZeRO communication volumes and the step-time arithmetic."""
from __future__ import annotations

import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import scaling_model as S  # noqa: E402

PSI = 44_000_000


def test_volumes_per_rank_follow_the_zero_paper():
    ring = 7 / 8 * PSI * 2
    assert S.comm_bytes(0, 8, PSI) == pytest.approx(2 * ring)
    assert S.comm_bytes(1, 8, PSI) == S.comm_bytes(0, 8, PSI) == S.comm_bytes(2, 8, PSI)  # grad_accum 1
    assert S.comm_bytes(3, 8, PSI) == pytest.approx(1.5 * S.comm_bytes(0, 8, PSI))  # ZeRO-3: 3 Psi vs 2 Psi
    # accumulation: ZeRO-0/1 reduce once per update, ZeRO-2 per micro-batch, ZeRO-3 gathers per micro-batch
    assert S.comm_bytes(1, 8, PSI, grad_accum=4) == S.comm_bytes(1, 8, PSI)
    assert S.comm_bytes(2, 8, PSI, grad_accum=4) == pytest.approx(5 * ring)
    assert S.comm_bytes(3, 8, PSI, grad_accum=4) == pytest.approx(12 * ring)
    assert S.comm_bytes(3, 1, PSI) == 0.0
    assert S.comm_bytes(0, 512, PSI) == pytest.approx(2 * 511 / 512 * PSI * 2)


def test_time_uses_the_slowest_link_and_overlap():
    link = S.Link(intra_gbps=300, inter_gbps=25, gpus_per_node=8, latency_us=0.0)
    inside = S.comm_seconds(0, 8, PSI, link)
    assert inside == pytest.approx(S.comm_bytes(0, 8, PSI) / 300e9)
    across = S.comm_seconds(0, 16, PSI, link)
    assert across == pytest.approx(S.comm_bytes(0, 16, PSI) / 25e9)
    link_lat = S.Link(latency_us=10.0, bucket_mb=500.0)
    assert S.comm_seconds(0, 8, PSI, link_lat) == pytest.approx(inside + 2 * 7 * 10e-6)
    assert S.step_seconds(1.0, 0.3, overlap=0.0) == pytest.approx(1.3)
    assert S.step_seconds(1.0, 0.3, overlap=1.0) == pytest.approx(1.0)
    assert S.step_seconds(0.2, 0.3, overlap=1.0) == pytest.approx(0.3)  # cannot hide more than the compute


def test_cli_prints_a_row_per_gpu_count(capsys):
    assert S.main(["--step-time", "0.5", "--params", str(PSI), "--gpus", "8,64"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().split(" ")[0] in ("8", "64")]
    assert len(rows) == 2 and "ZeRO-3 MB/rank" in out


def test_expert_parallel_volumes_and_break_even():
    shape = S.MoEShape(d_model=512, expert_ffn=2048, experts=8, top_k=2, layers=1)
    assert S.ep_a2a_bytes(1, 1000, shape) == 0.0
    # 4 transfers (dispatch, combine, and both in backward) of D bf16 values per pair leaving the rank
    assert S.ep_a2a_bytes(4, 1000, shape) == pytest.approx(4 * 1000 * 2 * 512 * 2 * 3 / 4)
    params = 8 * 2 * 512 * 2048
    assert S.replicated_expert_allreduce_bytes(4, shape) == pytest.approx(2 * 3 / 4 * params * 2)
    t = S.ep_break_even_tokens(shape)
    assert t == 8 * 2048 / 2
    p = 64  # at the break-even batch both move the same bytes for the same P
    assert S.ep_a2a_bytes(p, int(t), shape) == pytest.approx(S.replicated_expert_allreduce_bytes(p, shape))
    assert S.ep_a2a_bytes(p, int(t) // 2, shape) < S.replicated_expert_allreduce_bytes(p, shape)
    # MoCE: identities send nothing; a k-expert slot sends (k + 1) Dh values, twice (forward, backward)
    assert S.moce_a2a_bytes(2, 10, [0, 3], 4, bytes_per=1) == pytest.approx(2 * 10 * (4 * 4 / 2) * 1 / 2)
    assert S.moce_local_flops(10, [0, 3], 4) == pytest.approx(3 * 10 * (2 * 3 * 16 / 2))
