"""A run resumed at another layout continues the same run: 2 ranks x 1 micro-batch, checkpoint at update 12,
then 1 rank x 2 micro-batches to 24 (and 1 -> 2 ranks, 2 ranks x 2 -> 4 ranks, ZeRO-2 -> ZeRO-0, and
moe.ep_size 2 -> 1 with MoCE and MoE experts) gives the losses of an
uninterrupted 2-rank run update for update (the same global batches; only the order of the reductions
differs), and the weights of the same resume at the checkpoint's world size to 1e-5 (measured 0.0), with the
weights, fp32 master weights, AdamW moments and step count carried bitwise.

Real shard stream (its position moves to the new layout: ``data/position.py``), CPU/gloo under the
``deepspeed`` launcher, fp32, no dropout (the RNG streams of ranks that no longer exist are re-derived).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import REPLAY_DRIVER, deepspeed_cmd, launcher_env, run

N = 12
COMMON = ["optim.warmup_steps=4", "data.num_workers=0"]
# moce_d5_moe's layers, tiny: MoCE experts and a sparse MoE feed-forward, split over 2 ranks (moe.ep_size=2)
MOCE_MOE = ["model.arch=moce", "model.conv.kernels=[0,1,3,5]", "moe.moce_partition=true", "moe.num_experts=4",
            "moe.every=1", "moe.top_k=2", "moe.ffn_dim=32"]
Z0, Z2, Z3 = "engine.ds_config=zero0.json", "engine.ds_config=zero2.json", "engine.ds_config=zero3.json"


def _job(name, steps, *overrides, whole=False):
    return {"name": name, "replay": False, "whole": whole,
            "overrides": [f"train.max_steps={steps}", *COMMON, *overrides]}


def _launch(n, tmp_path, shards, jobs, env):
    return run(deepspeed_cmd(n, REPLAY_DRIVER, str(tmp_path), shards, json.dumps(jobs)), env)


def _result(tmp_path, name, rank=0):
    return json.loads((tmp_path / name / f"result_rank{rank}.json").read_text())


def _close(a: list, b: list, rel=1e-5):
    assert [s for s, _ in a] == [s for s, _ in b]
    for (s, x), (_, y) in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (s, x, y)


def _weights_rel(tmp_path, name, ref="full") -> float:
    """||a - b|| / ||a|| over the whole model's final weights (rank 0's consolidated copy)."""
    a = torch.load(tmp_path / ref / "params_rank0.pt")
    b = torch.load(tmp_path / name / "params_rank0.pt")
    assert a.keys() == b.keys()
    da = torch.cat([a[k].flatten() for k in a])
    return float((da - torch.cat([b[k].flatten() for k in a])).norm() / da.norm())


@pytest.mark.slow
def test_resume_at_another_world_size_stage_and_grad_accum(django_shards, tmp_path):
    env, sh = launcher_env(tmp_path), str(django_shards)
    ep2 = [Z0, *MOCE_MOE, "moe.ep_size=2"]
    ga2 = [Z0, "engine.grad_accum=2"]
    _launch(2, tmp_path, sh, [_job("full", 2 * N, Z0), _job("z0", N, Z0), _job("z2", N, Z2, whole=True),
                              _job("z3", N, Z3, whole=True), _job("ep_full", 2 * N, *ep2), _job("ep", N, *ep2, whole=True),
                              _job("ep_z2", N, Z2, "optim.clip_norm=0", *MOCE_MOE, "moe.ep_size=2", whole=True),
                              _job("full_2x2", 2 * N, *ga2), _job("quad", N, *ga2)], env)
    for src, dst in (("z2", "carry"), ("z2", "carry_z3"), ("z3", "carry_from_z3"), ("z2", "carry_bf16"),
                     ("ep", "carry_ep"), ("ep", "carry_ep_z2"), ("ep_z2", "carry_from_ep_z2"),
                     ("z2", "z2_same"), ("ep", "ep_same")):
        shutil.copytree(tmp_path / src, tmp_path / dst)  # the same checkpoint, loaded without training
    p = _launch(1, tmp_path, sh, [
        _job("z0", 2 * N, Z0, "engine.grad_accum=2"),  # 2 ranks x 1 -> 1 rank x 2, ZeRO-0
        _job("z2", 2 * N, Z0, "engine.grad_accum=2"),  # and ZeRO-2 -> ZeRO-0
        _job("carry", N, Z0, "engine.grad_accum=2", whole=True),
        _job("carry_from_z3", N, Z0, "engine.grad_accum=2", whole=True),
        _job("one", N, Z0, "engine.grad_accum=2", whole=True),  # 1 rank x 2, to be resumed on 2 ranks
        _job("ep", 2 * N, Z0, *MOCE_MOE, "moe.ep_size=1", "engine.grad_accum=2"),  # ep_size 2 -> 1, 2 -> 1 rank
        _job("carry_ep", N, Z0, *MOCE_MOE, "moe.ep_size=1", "engine.grad_accum=2", whole=True),
        _job("carry_from_ep_z2", N, Z0, *MOCE_MOE, "moe.ep_size=1", "engine.grad_accum=2", whole=True),
    ], env)
    assert "the checkpoint was written by 2 rank(s), this run has 1" in p.stdout + p.stderr
    shutil.copytree(tmp_path / "one", tmp_path / "carry_up")
    p = _launch(2, tmp_path, sh, [_job("one", 2 * N, Z0), _job("carry_up", N, Z2, whole=True),
                              # the same resumes at the checkpoint's world size: the references of "z2" and "ep"
                              _job("z2_same", 2 * N, Z0), _job("ep_same", 2 * N, Z0, *MOCE_MOE, "moe.ep_size=1"),
                              _job("carry_z3", N, Z3, whole=True),
                              _job("carry_bf16", N, Z2, "engine.precision=bf16", whole=True),
                              _job("carry_ep_z2", N, Z2, "optim.clip_norm=0", *MOCE_MOE, "moe.ep_size=2",
                                   whole=True)], env)
    # a change of the ZeRO stage alone (same world size) is said once, by rank 0, with the way it loads
    said = (p.stdout + p.stderr).count("at another layout: zero_stage 2 -> 3; through the whole state")
    assert said == 1, (p.stdout + p.stderr)[-3000:]
    ep4 = [Z2, "optim.clip_norm=0", *MOCE_MOE, "moe.ep_size=2"]  # 2 expert-data-parallel ranks per EP rank
    _launch(4, tmp_path, sh, [_job("quad", 2 * N, Z0), _job("ep4", N, *ep4, whole=True)], env)  # quad: 2x2 -> 4x1
    shutil.copytree(tmp_path / "ep4", tmp_path / "carry_from_ep4")
    _launch(1, tmp_path, sh, [_job("carry_from_ep4", N, Z0, *MOCE_MOE, "engine.grad_accum=4", whole=True)], env)

    full = _result(tmp_path, "full")
    assert full["steps"] == 2 * N and len(full["train_loss"]) == 2 * N
    worlds = {"z0": 1, "z2": 1, "one": 2, "ep": 1, "quad": 4}
    for name, ref in (("z0", "full"), ("z2", "full"), ("one", "full"), ("ep", "ep_full"), ("quad", "full_2x2")):
        res, want = _result(tmp_path, name), _result(tmp_path, ref)
        assert res["steps"] == 2 * N and res["world_size"] == worlds[name], name
        assert res["tokens"] == want["tokens"], name  # the same global batches
        _close(res["train_loss"], want["train_loss"][N:])
        # against a reference that ran one layout throughout: 1e-5 where the two runs do the same arithmetic up to
        # the grouping of the gradients' sum: two addends (2 ranks x 1 or 1 rank x 2 micro-batches) sum the same
        # either way (measured 0.0), four (2 ranks x 2 -> 4 ranks x 1) not quite (4.2e-6).
        # Not for "z2" and "ep", whose arithmetic differs from their reference's in one half of the run:
        # - "z2" ran its first half at ZeRO-2, where DeepSpeed's ZeRO optimizer measures the gradient norm (the
        #   partitions' squared norms summed, then the square root) and clips by dividing by its own coefficient,
        #   where ZeRO-0 leaves both to the engine (torch's norm of the per-tensor norms, a multiplication): the
        #   clipped gradients differ in the last bits at each update and Adam carries it (measured 5.2e-5; with
        #   optim.clip_norm=0 the two runs agree bitwise, measured 0.0: the sums of the gradients are the same);
        # - "ep" ran its second half at ep_size=1, where each expert's gradient is summed over each micro-batch's
        #   tokens, then over the micro-batches, and the clipping norm is the engine's on the device; at
        #   ep_size=2 the expert's rank sums the tokens of both ranks in one matrix product after the all-to-all
        #   and the norm counting each expert once is summed on the host (measured 1.4e-5).
        # Their 1e-5 comparison is with the same resume at the checkpoint's world size ("z2_same": ZeRO-2 -> 0 on
        # 2 ranks; "ep_same": ep_size 2 -> 1 on 2 ranks), which did the same arithmetic in both halves (0.0).
        assert _weights_rel(tmp_path, name, ref) <= (1e-4 if name in ("z2", "ep") else 1e-5), name
    for name, ref in (("z2", "z2_same"), ("ep", "ep_same")):
        assert _result(tmp_path, name)["tokens"] == _result(tmp_path, ref)["tokens"], name
        _close(_result(tmp_path, name)["train_loss"], _result(tmp_path, ref)["train_loss"])  # both resumed at N
        assert _weights_rel(tmp_path, name, ref) <= 1e-5, name
    # the state carried, bitwise: what the engine held before the save == what the engine at the new layout
    # holds after the load (ZeRO-2 on 2 ranks -> ZeRO-0 on 1 and ZeRO-3 on 2; ZeRO-3 -> ZeRO-0 on 1;
    # ZeRO-0 on 1 -> ZeRO-2 on 2; fp32 -> bf16 at ZeRO-2, whose fp32 master weights and moments are the fp32 run's)
    # and with expert parallelism (MoCE + MoE experts): ep_size 2 -> 1 at ZeRO-0, ZeRO-0 -> ZeRO-2 at ep_size 2,
    # ZeRO-2 at ep_size 2 (DeepSpeed's MoE path: experts partitioned over each expert-data-parallel group, of 1
    # rank on 2 ranks and of 2 ranks on 4) -> 1 rank
    for saved, loaded in (("z2", "carry"), ("z2", "carry_z3"), ("z3", "carry_from_z3"), ("one", "carry_up"),
                          ("z2", "carry_bf16"), ("ep", "carry_ep"), ("ep", "carry_ep_z2"), ("ep_z2", "carry_from_ep_z2"),
                          ("ep4", "carry_from_ep4")):
        _same_whole(tmp_path, saved, loaded)


def _same_whole(tmp_path, saved, loaded):
    before = torch.load(tmp_path / saved / "whole_rank0.pt")
    after = torch.load(tmp_path / loaded / "whole_rank0.pt")
    assert before["step"] == after["step"] == N, (saved, loaded)
    assert before["masters"].keys() == after["masters"].keys() and before["masters"]
    for k in before["masters"]:
        assert torch.equal(before["masters"][k], after["masters"][k]), (saved, loaded, k)
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(before["moments"][k][m], after["moments"][k][m]), (saved, loaded, k, m)
    # and training did move the moments (the comparison is not trivially true)
    assert any(before["moments"][k]["exp_avg"].abs().sum() > 0 for k in before["moments"])


@pytest.mark.slow
def test_resume_on_the_other_engine_carries_the_state(django_shards, tmp_path):
    """Accelerate DDP (1 process) -> DeepSpeed ZeRO-2 (2 ranks) and DeepSpeed ZeRO-2 (2 ranks) -> Accelerate DDP
    (1 process): the weights, Adam moments and step count the new engine holds after the load are the ones
    the old engine held, bitwise."""
    import sys

    env, sh = launcher_env(tmp_path), str(django_shards)
    ddp = ["engine.backend=accelerate", "engine.accelerate=ddp"]
    run([sys.executable, REPLAY_DRIVER, str(tmp_path), sh, json.dumps([_job("acc", N, *ddp, whole=True)])], env)
    shutil.copytree(tmp_path / "acc", tmp_path / "acc_to_z2")
    _launch(2, tmp_path, sh, [_job("acc_to_z2", N, Z2, whole=True), _job("ds", N, Z2, whole=True)], env)
    shutil.copytree(tmp_path / "ds", tmp_path / "ds_to_acc")
    p = run([sys.executable, REPLAY_DRIVER, str(tmp_path), sh, json.dumps([_job("ds_to_acc", N, *ddp, whole=True)])],
            env)
    assert "the checkpoint was written by 2 rank(s), this run has 1" in p.stdout + p.stderr
    assert ("resume of step-0000012 at another layout: backend deepspeed -> accelerate/ddp, zero_stage 2 -> 0, "
            "world_size 2 -> 1; through the whole state") in p.stdout + p.stderr
    assert _result(tmp_path, "acc_to_z2")["engine"] == "deepspeed" and _result(tmp_path, "ds_to_acc")["engine"] == \
        "accelerate/ddp"
    for saved, loaded in (("acc", "acc_to_z2"), ("ds", "ds_to_acc")):
        _same_whole(tmp_path, saved, loaded)
