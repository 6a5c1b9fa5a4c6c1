"""train_step's per-step sums (loss, nll, target tokens) are the float64 left-to-right sums of the
micro-batches' values, as when each was read with float() — now read once after the update."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from scaletrain.engine import StepInfo
from scaletrain.train.unit import StopVote, train_step


class FakeEngine:
    world_size, device = 1, torch.device("cpu")

    def __init__(self):
        self.backward_losses, self.steps = [], 0

    @property
    def parallel(self):  # the collectives of its parallel context
        return self

    def all_reduce_sum(self, values):
        return [float(v) for v in values]

    def backward(self, loss):
        self.backward_losses.append(loss)

    def step(self):
        self.steps += 1
        return StepInfo(grad_norm=1.0, lr=0.1)


class FakeUnit:
    def __init__(self, values):
        self.values = iter(values)

    def loss(self, batch):
        loss, nll, ntok = next(self.values)
        return torch.tensor(loss, dtype=torch.float32), torch.tensor(nll, dtype=torch.float32), torch.tensor(ntok)


def batch(n_tgt, size):
    return SimpleNamespace(n_tgt_tokens=n_tgt, n_src_tokens=n_tgt + 1, size=size, to=lambda device: batch(n_tgt, size))


def test_sums_equal_the_float64_sums_of_the_fp32_values():
    # values where a float32 accumulation would round: 1e8 + 0.1 + 3.3 is not representable in float32
    vals = [(1.0e8, 2.5e7, 100), (0.1, 0.7, 7), (3.3, 1e-3, 11)]
    eng = FakeEngine()
    out = train_step(eng, FakeUnit(vals), [batch(100, 3), batch(7, 1), batch(11, 2)], stop_vote=False)
    want_loss = want_nll = 0.0
    for loss, nll, _ in vals:  # what float(loss_sum.detach()) per micro-batch gave
        want_loss += float(torch.tensor(loss, dtype=torch.float32))
        want_nll += float(torch.tensor(nll, dtype=torch.float32))
    assert out.loss_sum == want_loss and out.nll_sum == want_nll
    assert isinstance(out.loss_sum, float) and out.ntok == 118 and isinstance(out.ntok, int)
    assert out.examples == 6 and out.global_tokens == 118 and eng.steps == 1
    assert out.global_src_tokens == 118 + 3
    # each micro-batch's loss is scaled by world * n_micro / global tokens before backward
    assert [float(x) for x in eng.backward_losses] == [float(torch.tensor(v[0]) * (3 / 118)) for v in vals]


def test_stop_vote_returns_the_vote_before_any_work():
    eng = FakeEngine()
    assert train_step(eng, FakeUnit([]), [batch(5, 1)], stop_vote=True) == StopVote(preempted=False)
    assert eng.steps == 0 and eng.backward_losses == []
