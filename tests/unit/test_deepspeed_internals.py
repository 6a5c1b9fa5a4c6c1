"""The DeepSpeed internals ``scaletrain/engine/deepspeed_internals.py`` relies on are still there and still behave
as that module says: each test fails when an upgrade changes one (the installed version first, so an upgrade
re-reads the list). The end-to-end check of the bf16 ZeRO-1/2 non-finite skip is the two-rank planted-inf run of
``tests/integration/test_nonfinite_two_ranks.py``."""
from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

import pytest
import torch

import scaletrain.engine.deepspeed_internals as dsi


def test_the_installed_deepspeed_is_the_one_the_internals_were_checked_against():
    import deepspeed

    assert deepspeed.__version__ == dsi.CHECKED_VERSION, (
        f"DeepSpeed {deepspeed.__version__}: re-check every internal listed in scaletrain/engine/deepspeed_internals.py "
        f"(checked against {dsi.CHECKED_VERSION}), then update CHECKED_VERSION")


def test_an_invalid_group_norm_becomes_inf_when_the_zero_optimizer_combines_them():
    """bf16 ZeRO-1/2 without DeepSpeed's overflow check: a NaN/inf group norm is masked to -1, and combining the
    groups must turn that marker into inf (a finite result would apply a NaN update)."""
    from deepspeed.runtime.utils import combine_grad_norm_groups, mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for bad in (float("nan"), float("inf")):
        norm = torch.tensor(bad)
        mask_nan_or_inf_with_val_inplace(norm)
        assert float(norm) == -1.0
        assert torch.isinf(combine_grad_norm_groups([norm, torch.tensor(3.0)]))
    assert float(combine_grad_norm_groups([torch.tensor(3.0), torch.tensor(4.0)])) == 5.0
    assert "combine_grad_norm_groups" in inspect.getsource(DeepSpeedZeroOptimizer.scaled_global_norm)
    step = inspect.getsource(DeepSpeedZeroOptimizer.step)
    # bf16 without the check does not stop on the invalid norm itself: it leaves it in _global_grad_norm
    assert "self.dtype != torch.bfloat16" in step and "self._global_grad_norm = scaled_global_grad_norm" in step
    init = inspect.getsource(DeepSpeedZeroOptimizer.__init__)
    assert "self._global_grad_norm" in init and "self.clip_grad = clip_grad" in init


def test_our_expert_groups_and_moe_blocks_reach_deepspeeds_moe_path():
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.utils import groups

    assert "isinstance(module, MoE)" in inspect.getsource(ds_engine.DeepSpeedEngine)
    original = ds_engine.MoE
    p = torch.nn.Parameter(torch.zeros(2))
    ep = SimpleNamespace(ctx=SimpleNamespace(ep_size=8, ep_group="ep-group", edp_group="edp-group"), experts=[p])
    block = object()
    try:
        with dsi.moe_path(ep, lambda m: m is block):
            assert isinstance(block, ds_engine.MoE) and not isinstance(object(), ds_engine.MoE)
            assert groups._get_expert_parallel_group("ep_size_8") == "ep-group"
            assert groups._get_expert_data_parallel_group("ep_size_8") == "edp-group"
        assert ds_engine.MoE is original
        assert p.allreduce is False and p.group_name == dsi.moe_group_name(8) == "ep_size_8"
        assert "has_moe_layers" in inspect.getsource(ds_engine.DeepSpeedEngine.save_checkpoint)
    finally:
        groups._EXPERT_PARALLEL_GROUP.pop("ep_size_8", None)
        groups._EXPERT_DATA_PARALLEL_GROUP.pop("ep_size_8", None)


def test_an_optimizer_marked_overflowing_is_a_skipped_update():
    """``step_without_update``: DeepSpeed's model step counts the update as skipped when its optimizer says
    ``overflow``, and the optimizer's ``step`` attribute is what it calls."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    take = inspect.getsource(DeepSpeedEngine._take_model_step)
    assert 'hasattr(self.optimizer, "overflow")' in take and "self.skipped_steps += 1" in take
    assert "self.optimizer.step()" in take
    calls = []
    opt = SimpleNamespace(step=lambda: calls.append("update"))
    fake = SimpleNamespace(optimizer=opt, step=lambda: calls.append(("overflow", opt.overflow, opt.step())))
    dsi.step_without_update(fake)
    assert calls == [("overflow", True, None)] and not hasattr(opt, "overflow")
    opt.step()
    assert calls[-1] == "update"  # the optimizer's own step is back


def test_the_ops_table_and_the_shared_memory_buffer_are_where_we_look():
    import importlib
    from pathlib import Path

    import deepspeed.ops as ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    from deepspeed.ops.op_builder.builder import probe_is_compatible  # noqa: F401  (the lazy table probes with it)

    assert set(dsi.UNUSED_DEEPSPEED_OPS) <= set(ALL_OPS)
    ds_comm = importlib.import_module("deepspeed.comm.torch")  # (``deepspeed.comm.torch`` the attribute is torch)
    assert "deepspeed.ops.__compatible_ops__.get(builder.NAME" in inspect.getsource(ds_comm)
    dsi.skip_unused_deepspeed_ops()
    assert isinstance(ops.__compatible_ops__, dsi._LazyCompatibleOps)
    assert ops.__compatible_ops__.get("deepspeed_shm_comm") is False
    shm = Path(inspect.getsourcefile(ops)).parent / "csrc" / "cpu" / "comm" / "shm.cpp"
    assert '#define SHM_BUFFER_NAME "deepspeed_allreduce_buffer"' in shm.read_text()


def test_fp16_loss_scale_is_read_where_deepspeed_keeps_it():
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert "self.loss_scale_config = loss_scale_config" in inspect.getsource(FP16_Optimizer.__init__)
    assert "cur_scale" in inspect.getsource(DeepSpeedZeroOptimizer)


# ---- behaviour on a real engine: one rank, gloo, in this process, ZeRO-1 in bf16 (as our configs run it) ----
@pytest.fixture(scope="module")
def zero1_engine():
    """A DeepSpeed ZeRO-1 engine (bf16, DeepSpeed's overflow check off) on a world of one over gloo, in this
    process, on a two-layer model; its process group released after the module's tests."""
    from helpers import free_port
    from scaletrain.config import load_config
    from scaletrain.engine import build_engine
    from scaletrain.engine.shutdown import release_process_groups

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        eng = build_engine(load_config("small", ["engine.compile=false", "engine.backend=deepspeed",
                                                 "engine.ds_config=zero1.json", "engine.precision=bf16",
                                                 "engine.grad_accum=1"]))
        torch.manual_seed(0)
        eng.setup(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)))
        assert eng.zero_stage == 1 and eng.backend.withholds_on_device
        yield eng
    finally:
        release_process_groups()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _update(eng, scale: float = 1.0):
    x = torch.randn(5, 4).to(torch.bfloat16)
    eng.backward(eng.module(x).float().pow(2).sum() * scale)
    return eng.step()


def test_a_state_loaded_before_the_first_update_is_the_state_deepspeed_holds(zero1_engine):
    """``link_optimizer_state``: before any update DeepSpeed ZeRO-1/2 has not linked its parameters' fragments to
    the optimizer's state, and ``safe_set_full_optimizer_state`` needs the link: the moments a resume at another
    layout loads must be the ones read back (first in this module: no update yet)."""
    from scaletrain.engine import WholeState

    eng = zero1_engine
    sd = {k: v.float() for k, v in eng.full_state_dict().items()}
    names = eng.trainable()
    moments = {n: {"exp_avg": torch.full(p.shape, 0.5) + i, "exp_avg_sq": torch.full(p.shape, 0.25) * (i + 1)}
               for i, (n, p) in enumerate(names.items())}
    eng.load_whole(sd, WholeState({n: sd[n] for n in names}, moments, 4))
    back = eng.whole_state()
    assert back.step == 4
    for n in names:
        assert torch.equal(back.masters[n], sd[n])
        assert all(torch.equal(back.moments[n][k], moments[n][k]) for k in moments[n]), n


def test_zero_norm_hook_withholds_a_non_finite_update_on_the_device(zero1_engine):
    """``ZeroNormHook``: a finite update goes through (flag 0, the moments move); an inf gradient (bf16,
    DeepSpeed's own overflow check off) sets the flag and leaves the fp32 master weights and the moments as
    they were, with the update counted as skipped."""
    eng = zero1_engine
    info = _update(eng)
    assert not info.skipped and float(eng.backend._hook.flag) == 0.0
    before = eng.whole_state()
    info = _update(eng, float("inf"))
    after = eng.whole_state()
    for n in before.masters:
        assert torch.equal(after.masters[n], before.masters[n]), n
        assert all(torch.equal(after.moments[n][k], before.moments[n][k]) for k in before.moments[n]), n
    assert float(eng.backend._hook.flag) == 1.0 and info.skipped and info.nonfinite
    info = _update(eng)  # and training goes on
    assert not info.skipped and all(torch.isfinite(t).all() for t in eng.whole_state().masters.values())


def test_a_zero1_checkpoint_is_read_back_whole_through_its_partition_keys(zero1_engine, tmp_path):
    """``zero12_partition`` (``param_slice_mappings``, ``single_partition_of_fp32_groups``): the whole state
    ``checkpoint.reshard`` joins from the files DeepSpeed writes is the state the engine holds, bitwise. (ZeRO-3's
    ``fp32_flat_groups`` / ``param_shapes`` / ``ds_shape`` are exercised by the ZeRO-3 cases of
    ``tests/integration/test_resume_any_layout.py``.)"""
    from scaletrain.checkpoint.reshard import read_whole

    eng = zero1_engine
    _update(eng)
    eng.save_native(tmp_path / "ck")
    names = eng.trainable()
    assert not dsi.zero3_partitioned(eng.module)
    shapes = {n: dsi.whole_shape(p) for n, p in names.items()}
    model, whole = read_whole(tmp_path / "ck", {"zero_stage": 1, "ep_size": 1}, list(names), shapes)
    held = eng.whole_state()
    assert whole.step == held.step and whole.step is not None
    for n in names:
        assert torch.equal(whole.masters[n], held.masters[n]), n
        assert all(torch.equal(whole.moments[n][k], held.moments[n][k]) for k in held.moments[n]), n
