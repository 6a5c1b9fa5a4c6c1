"""The NMT-specific part of training that the generic loop calls (fairseq2's ``TrainUnit``).

The loop knows micro-batches, engines and counters; this unit knows that a batch is a translation
batch: its loss (label-smoothed cross-entropy, summed; normalised by the loop) and the model's routing
statistics (MoCE expert shares per language, mean radius).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from scaletrain.engine import Engine, StepInfo
from scaletrain.models.loss import label_smoothed_ce
from scaletrain.models.routing_stats import has_routing, routing_metrics
from scaletrain.oom import OomPolicy, is_oom, memory_summary
from scaletrain.train.moe_usage import MoeLanguageUsage


class TranslationUnit:
    def __init__(self, engine: Engine, label_smoothing: float, pad: int, langs: list[str]):
        self.engine, self.label_smoothing, self.pad, self.langs = engine, label_smoothing, pad, langs
        self._aux_sum, self._aux_n = None, 0  # MoE auxiliary loss of the training batches (on the device)
        self.moe_usage = MoeLanguageUsage.for_model(engine.module, len(langs)) if langs else None
        self.routed = has_routing(engine.module)  # the same model on every rank: all skip the collective alike

    def loss(self, batch):
        """(label-smoothed loss sum, nll sum, target tokens) of one batch already on the device.

        A model with auxiliary losses (MoE load balancing: ``last_aux_loss``, a per-batch mean with its
        coefficient applied) adds aux * target tokens to the loss sum, so that after ``train_step``'s
        normalisation it enters as the token-weighted mean over the step's batches (all ranks)."""
        if self.moe_usage is not None:
            self.moe_usage.set_batch(batch.src_lang)  # MoE expert usage per source language
        # a batch without source padding (host-side counts) attends without a mask (FlashAttention on CUDA)
        logits = self.engine.forward(batch.src, batch.tgt_in, src_padded=batch.src_padded)
        loss_sum, nll_sum, ntok = label_smoothed_ce(logits, batch.tgt_out, epsilon=self.label_smoothing,
                                                    ignore_index=self.pad)
        aux = getattr(self.engine.module, "last_aux_loss", None)
        if aux is not None:
            loss_sum = loss_sum + aux.to(loss_sum.dtype) * ntok
            if torch.is_grad_enabled():  # training batches only, summed on the device (no host sync)
                a = aux.detach().double()
                self._aux_sum = a if self._aux_sum is None else self._aux_sum + a
                self._aux_n += 1
        return loss_sum, nll_sum, ntok

    def aux_loss(self, reset: bool = True) -> tuple[float, int]:
        """(sum, number of batches) of the MoE auxiliary loss (coefficient applied) over this rank's
        training batches since the last reset; (0.0, 0) for models without one. One host sync."""
        out = (float(self._aux_sum) if self._aux_sum is not None else 0.0, self._aux_n)
        if reset:
            self._aux_sum, self._aux_n = None, 0
        return out

    def routing(self, reset: bool = False) -> dict[str, float]:
        """The model's routing statistics since the last reset (empty for models without routing)."""
        if not self.routed:
            return {}
        # MoE counts are summed over the ranks (collective: every rank calls this at the same points)
        out = routing_metrics(self.engine.module, self.langs, reset=reset, reduce=self.engine.parallel.all_reduce_sum)
        if self.moe_usage is not None:
            out.update(self.moe_usage.metrics(self.langs, self.engine.parallel.all_reduce_sum, reset=reset))
        return out


class StepOutput:
    """One update: the engine's :class:`StepInfo`, the step's global token counts (host numbers from the
    all-reduce), this rank's examples, and this rank's loss sums over its micro-batches, which stay on the
    device (``sums``: float64 [loss, nll, target tokens]) until read: ``loss_sum``/``nll_sum``/``ntok``
    read them once (the training loop does on log and save steps, :func:`resolve_outputs`).

    ``oom``: a micro-batch ran out of memory and the update was withheld (``train.on_oom=skip``); its
    ``oom_shape`` names the batch."""

    def __init__(self, info: StepInfo, global_tokens: int, sums, examples: int, global_src_tokens: int = 0,
                 save_due: bool = False, oom: str = ""):
        self.info, self.global_tokens, self.examples = info, global_tokens, examples
        self.global_src_tokens, self.save_due, self.oom = global_src_tokens, save_due, oom
        self._sums = sums  # device tensor [3] until read, then a list of floats

    @property
    def sums(self) -> torch.Tensor | list[float]:
        return self._sums

    def _read(self) -> list[float]:
        if torch.is_tensor(self._sums):
            resolve_outputs([self])
        return self._sums

    @property
    def loss_sum(self) -> float:  # this rank's sums over its micro-batches
        return self._read()[0]

    @property
    def nll_sum(self) -> float:
        return self._read()[1]

    @property
    def ntok(self) -> int:
        return int(self._read()[2])

    @property
    def loss_finite(self) -> bool:
        """This rank's loss sums are finite (a NaN/inf loss on any rank makes the reduced gradient, and so
        ``info.nonfinite``, non-finite on every rank)."""
        return math.isfinite(self.loss_sum) and math.isfinite(self.nll_sum)


def resolve_outputs(outs: list[StepOutput]) -> None:
    """Read the loss sums and the update values (norm, skip flag) of ``outs`` to the host in one read."""
    pending = [o for o in outs if torch.is_tensor(o._sums)]
    if pending:
        flat = torch.stack([o._sums for o in pending]).tolist()
        for o, vals in zip(pending, flat):
            o._sums = vals
    StepInfo.resolve_all([o.info for o in outs])


@dataclass
class StopVote:
    """Returned by :func:`train_step` instead of an update when any rank voted to stop (all ranks agree)."""
    preempted: bool  # some rank got a preemption signal (else: the wall-clock budget is spent)


def train_step(engine: Engine, unit: TranslationUnit, micro: list, stop_vote: bool,
               preempt_vote: bool = False, save_vote: bool = False, oom: OomPolicy | None = None
               ) -> StepOutput | StopVote:
    """One update over ``micro`` (grad_accum batches, already on the engine's device: the prefetcher moved them,
    ``prefetch.py``), or a :class:`StopVote` when any rank voted to stop
    (``stop_vote``: budget spent; ``preempt_vote``: a preemption signal); the votes ride on the step's
    token all-reduce, so every rank stops at the same step. ``save_vote`` (rank 0's save timer) comes
    back as ``StepOutput.save_due`` on every rank, from the same all-reduce.

    Loss normalisation: the target tokens of the whole step (all ranks, all micro-batches) are
    all-reduced first, and each micro-batch's summed loss is scaled so that, after the engine's averaging
    over ranks and accumulation steps, the gradient is d(sum of losses)/d(theta) / (global target tokens).

    No host synchronisation: the token counts are host numbers (known before the batches move), reduced on
    a host (gloo) group; the loss sums stay on the device, in float64 like the Python floats they replace
    (same values, same order); the engine's norm and skip flag too (``StepInfo``).

    ``oom``: what a ``torch.OutOfMemoryError`` in a micro-batch's forward/backward does (``train.on_oom``):
    stop with one line naming the batch, or withhold the update and go on (:class:`OomPolicy`).
    """
    local_tok = sum(b.n_tgt_tokens for b in micro)
    local_src = sum(b.n_src_tokens for b in micro)
    g_tok, g_stop, g_src, g_preempt, g_save = engine.parallel.all_reduce_sum(
        [local_tok, float(stop_vote), local_src, float(preempt_vote), float(save_vote)])
    if g_stop > 0 or g_preempt > 0:
        return StopVote(preempted=g_preempt > 0)
    # the libraries average gradients over the ranks (every rank is data parallel) and the engine over the
    # micro-batches:
    # undo both, so that the update is the gradient of the global token-mean loss
    scale = engine.parallel.world_size * len(micro) / g_tok
    acc, examples, failed = None, 0, None
    for i, b in enumerate(micro):
        try:
            loss_sum, nll_sum, ntok = unit.loss(b)
            engine.backward(loss_sum * scale)
        except Exception as e:  # noqa: BLE001 - re-raised unless out of memory under a policy
            if oom is None or not is_oom(e):
                raise
            failed, at_failure = i, memory_summary(engine.device)  # handled below, once released
            break
        s = torch.stack([loss_sum.detach().double(), nll_sum.detach().double(),
                         torch.as_tensor(ntok, device=loss_sum.device).double()])
        acc = s if acc is None else acc + s
        examples += b.size
    shape = oom.recover(engine, micro, failed, at_failure) if failed is not None else ""  # raises under stop
    with oom.updating(engine, micro) if oom is not None else contextlib.nullcontext():  # always stops
        info = engine.step()
    if failed is not None:
        return StepOutput(info, 0, [0.0, 0.0, 0.0], 0, 0, save_due=g_save > 0, oom=shape)
    return StepOutput(info, int(g_tok), acc, examples, int(g_src), save_due=g_save > 0)


@dataclass
class ValidLoss:
    """A validation pass on every rank: ``nll`` per target token over the batches that ran (NaN when every
    batch ran out of memory), ``batches`` that ran and ``oom_batches`` left out (``train.on_oom=skip``), summed
    over the ranks."""
    nll: float
    batches: int
    oom_batches: int = 0


def validation_loss(engine: Engine, unit: TranslationUnit, batches, max_batches: int) -> float:
    """Mean nll per target token over at most ``max_batches`` of ``batches`` on every rank (collective); see
    :func:`validation`."""
    return validation(engine, unit, batches, max_batches).nll


@torch.no_grad()
def validation(engine: Engine, unit: TranslationUnit, batches, max_batches: int, oom: OomPolicy | None = None,
               where: str = "validation") -> ValidLoss:
    """Mean nll per target token over at most ``max_batches`` of ``batches`` on every rank (collective).

    Where every forward is a collective (``engine.partitioned()``: ZeRO-3 gathers, expert-parallel
    exchanges) the ranks go in lock-step: a vote per batch, and a rank whose batches ran out re-runs its
    last one (result discarded) while another rank still has one, so that no rank waits alone.

    ``oom``: a batch that runs out of memory stops with one line naming it and ``where`` (``train.on_oom=stop``),
    or is left out and counted (``skip``, a single process)."""
    engine.train(False)
    nll, ran, skipped = None, 0, 0  # nll summed on the device, read once at the end
    lockstep, it, last = engine.partitioned(), iter(batches), None
    for k in range(max_batches):
        batch = next(it, None)
        if lockstep and engine.parallel.all_reduce_sum([float(batch is not None)])[0] == 0 or not lockstep and batch is None:
            break
        if batch is None:  # lock-step: join the others' collectives
            if last is not None:
                unit.loss(last)
            continue
        at_failure = None
        try:
            last = batch.to(engine.device)
            _, nll_sum, ntok = unit.loss(last)
        except Exception as e:  # noqa: BLE001 - re-raised unless out of memory under a policy
            if oom is None or not is_oom(e):
                raise
            at_failure = memory_summary(engine.device)
        if at_failure is not None:  # outside the handler: the failed forward's tensors are released
            last = None
            oom.validation_batch(engine, batch, k, where, at_failure)  # raises under train.on_oom=stop
            skipped += 1
            continue
        s = torch.stack([nll_sum.double(), torch.as_tensor(ntok, device=nll_sum.device).double()])
        nll = s if nll is None else nll + s
        ran += 1
    nll, n = nll.tolist() if nll is not None else (0.0, 0.0)
    tot_nll, tot_n, tot_ran, tot_skipped = engine.parallel.all_reduce_sum([nll, n, float(ran), float(skipped)])
    unit.routing(reset=True)  # routing statistics describe training batches only
    engine.train(True)
    mean = tot_nll / max(tot_n, 1) if tot_ran or not tot_skipped else float("nan")
    return ValidLoss(mean, int(tot_ran), int(tot_skipped))
