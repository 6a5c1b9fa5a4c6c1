"""The step's values stay on the device until read (``StepInfo``), and a non-finite update is withheld by the
fused AdamW itself (``scaletrain/engine/optim.py``): parameters, moments and the step count unchanged where
the flag is 1, a normal update where it is 0; the LR schedule counts the applied updates from the flag on the
device (``optim.UpdateSchedule``), so reading the flag later changes nothing."""
from __future__ import annotations

import pytest
import torch

from scaletrain.engine import StepInfo
from scaletrain.engine.optim import can_skip_on_device, clip_, grad_norm, nonfinite_flag, withheld_if
from scaletrain.engine.optim import UpdateSchedule, inverse_sqrt_factor


def _model_and_opt(fused=True):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
    return m, opt


def _grads(m, scale=1.0):
    loss = m(torch.randn(5, 4)).pow(2).sum() * scale
    loss.backward()


def test_fused_adamw_withholds_the_update_where_the_flag_is_one():
    m, opt = _model_and_opt()
    assert can_skip_on_device(opt) and not can_skip_on_device(_model_and_opt(fused=False)[1])
    _grads(m)
    with withheld_if(opt, nonfinite_flag(grad_norm(list(m.parameters())))):
        opt.step()  # a finite gradient: applied
    opt.zero_grad()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in m.parameters()}
    _grads(m, scale=float("nan"))
    norm = grad_norm(list(m.parameters()))
    flag = nonfinite_flag(norm)
    assert flag.shape == () and float(flag) == 1.0 and not hasattr(opt, "found_inf")
    with withheld_if(opt, flag):
        opt.step()
    assert not hasattr(opt, "found_inf")  # only for that step
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    for p in m.parameters():
        assert all(torch.equal(moments[id(p)][k], v) for k, v in opt.state[p].items())  # the step count too
    opt.zero_grad()
    _grads(m)
    with withheld_if(opt, nonfinite_flag(grad_norm(list(m.parameters())))):
        opt.step()
    assert any(not torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert {float(opt.state[p]["step"]) for p in m.parameters()} == {2.0}


def test_clip_on_the_device_matches_torch():
    import copy

    m, _ = _model_and_opt()
    _grads(m, scale=100.0)
    ref = copy.deepcopy(m)
    for p, q in zip(m.parameters(), ref.parameters()):
        q.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    norm = grad_norm(list(m.parameters()))
    clip_(list(m.parameters()), 1.0, norm)
    assert float(norm) == float(want) > 1.0
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters()))


def test_step_info_reads_every_pending_value_once():
    ok = StepInfo(torch.tensor(2.5), torch.tensor(0.01, dtype=torch.float64), flag=torch.tensor(0.0))
    bad = StepInfo(torch.tensor(float("inf")), torch.tensor(0.02, dtype=torch.float64), flag=torch.tensor(1.0))
    host = StepInfo(1.0, 0.1, skipped=True)  # an fp16 overflow the engine knew on the host
    assert ok.pending and bad.pending and not host.pending
    StepInfo.resolve_all([ok, bad, host])
    assert not ok.pending and not bad.pending
    assert (ok.grad_norm, ok.skipped, ok.nonfinite, ok.lr) == (2.5, False, False, 0.01)
    assert bad.skipped and bad.nonfinite and bad.lr == 0.02
    assert host.skipped and not host.nonfinite  # skipped with a finite norm: not a non-finite update
    derived = StepInfo(float("nan"), 0.1, skipped=True, nonfinite=None)
    assert derived.nonfinite


def test_the_schedule_counts_applied_updates_on_the_device():
    """The LR of each update follows the updates applied before it: a withheld one (flag 1) is not counted,
    on the device, with the fused AdamW reading the LR tensor; the host count gives the same LRs from bools,
    and a checkpoint's count (or a LambdaLR's ``last_epoch``) puts the schedule back."""
    f = inverse_sqrt_factor(1e-2, 4, 0.0)
    m, opt = _model_and_opt()
    sched = UpdateSchedule(opt, 1e-2, 4, 0.0)
    sched.on_device(torch.device("cpu"))
    host = UpdateSchedule(_model_and_opt()[1], 1e-2, 4, 0.0)
    assert torch.is_tensor(opt.param_groups[0]["lr"]) and not torch.is_tensor(host.optimizer.param_groups[0]["lr"])
    lrs = []
    for withheld in (0.0, 1.0, 0.0, 1.0, 1.0, 0.0):
        _grads(m)
        with withheld_if(opt, torch.tensor(withheld)):
            opt.step()  # the fused kernel reads the LR tensor
        opt.zero_grad()
        sched.advance(torch.tensor(withheld))
        host.advance(bool(withheld))
        lrs.append(sched.next_lr())
    assert float(sched.applied) == 3 == host.applied and {float(opt.state[p]["step"]) for p in m.parameters()} == {3.0}
    want = [1e-2 * f(n) for n in (1, 1, 2, 2, 2, 3)]  # the LR of the next update after each one
    assert [float(lr) for lr in lrs] == pytest.approx(want, rel=1e-15)
    assert host.value() == want[-1] and float(opt.param_groups[0]["lr"]) == pytest.approx(want[-1], rel=1e-15)
    assert sched.state_dict() == host.state_dict() == {"applied": 3}
    back = UpdateSchedule(_model_and_opt()[1], 1e-2, 4, 0.0)
    back.load_state_dict({"last_epoch": 3, "base_lrs": [1e-2]})
    assert back.value() == want[-1]


def test_a_pending_value_is_read_on_first_use():
    info = StepInfo(torch.tensor(3.0), 0.5, flag=torch.tensor(0.0))
    assert info.lr == 0.5 and not info.pending and info.grad_norm == 3.0 and not info.skipped
