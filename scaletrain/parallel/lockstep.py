"""Decoding with the experts kept where they are (expert parallelism): ranks in lock-step.

Under ``moe.ep_size > 1`` every forward of an expert layer is a collective over the EP group (the
all-to-alls of ``exchange.py`` and ``scaletrain.models.moce_ep``). Decoding gives the ranks different
work: different numbers of lines, hence of batches, and outputs of different lengths, hence of
decoder steps. ``LockstepDecoder`` wraps the sharded model for ``scaletrain.eval.generate`` (same
``encode`` / ``decode_step`` / ``reorder_cache`` API) and keeps every rank in the same sequence of
exchanges without gathering any expert:

* decoding runs in phases. An encode phase starts with a vote (one all-reduce of "I encode a
  batch"); every rank then runs the encoder's exchanges, with its batch or, if it has none, with
  no rows (``join_exchange`` of each expert layer, in the encoder's order). A decode phase follows:
  before each decoder step every rank votes again ("I run a step"); a rank without a step (its
  batch finished, or it had none) joins the decoder's exchanges with no rows. The phase ends at the
  first vote where nobody runs a step, which every rank sees at the same time.
* a rank calls ``finish()`` after its last batch: it keeps joining (empty encodes, empty steps)
  until a vote shows that no rank has a batch left.

Cost per decoder step: one all-reduce of one integer over the EP group, besides the exchanges the
model makes anyway. Results equal one process holding every expert (the experts see the same rows;
empty joins add nothing). Routing statistics gathered during decoding are dropped again (``finish``),
as the gathered copy used to do, so that training's logged shares stay those of training batches.

Expert layers take part by exposing ``parallel`` (a ``ParallelContext``) and ``join_exchange()``;
their order of registration inside a layer is their order of calls (the encoder layer's attention
before its feed-forward block).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.parallel.context import ParallelContext


def exchanging_layers(part: nn.Module) -> list[nn.Module]:
    """The expert layers under ``part`` that exchange over an EP group, in call order."""
    return [m for m in part.modules() if hasattr(m, "join_exchange")
            and getattr(getattr(m, "parallel", None), "ep_size", 1) > 1]


class LockstepDecoder(nn.Module):
    """``model`` (built with expert parallelism) for decoding on every rank of its EP groups; see the
    module docstring. Every rank must call ``finish()`` once after its last batch."""

    def __init__(self, model: nn.Module, ctx: ParallelContext):
        super().__init__()
        self.model = model
        self.ctx = ctx
        self._enc = exchanging_layers(model.encoder_layers)
        self._dec = exchanging_layers(model.decoder_layers)
        self._in_decode = False
        self._stats = {m: copy.deepcopy(m._stats) for m in model.modules() if hasattr(m, "_stats")}

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def _vote(self, busy: bool) -> bool:
        """All-reduce over the EP group: does any rank have work in this phase?"""
        t = torch.tensor([int(busy)], dtype=torch.int64)
        dist.all_reduce(t, group=self.ctx.ep_group)
        return int(t[0]) > 0

    def _drain(self) -> None:
        """End the decode phase: join the other ranks' decoder steps until none is left."""
        if self._in_decode:
            with torch.no_grad():
                while self._vote(False):
                    for m in self._dec:
                        m.join_exchange()
            self._in_decode = False

    def encode(self, src):
        self._drain()
        self._vote(True)
        out = self.model.encode(src)
        self._in_decode = True
        return out

    def decode_step(self, *args, **kwargs):
        self._vote(True)
        return self.model.decode_step(*args, **kwargs)

    def reorder_cache(self, *args, **kwargs):
        return self.model.reorder_cache(*args, **kwargs)

    def finish(self) -> None:
        """After this rank's last batch: join every other rank's remaining encodes and decoder steps;
        returns when no rank has a batch left (on every rank at the same vote)."""
        self._drain()
        with torch.no_grad():
            while self._vote(False):
                for m in self._enc:
                    m.join_exchange()
                self._in_decode = True
                self._drain()
        for m, stats in self._stats.items():  # decoding's routing counts are not training's
            m._stats = stats
