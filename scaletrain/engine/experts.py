"""Expert parallelism around an engine's set-up: what ``deepspeed.initialize`` and Accelerate's
``prepare`` must see of the experts (``expert_setup``), for both engines.

Both engines wrap the model inside ``expert_setup`` with the engine's ``ParallelContext`` (through an
``ExpertParallelGrads``): DDP and DeepSpeed broadcast rank 0's parameters at start-up, where each rank
holds other experts (owned MoCE experts even differ in shape between ranks); ZeRO-1/2 run DeepSpeed's
own MoE path, which has to be told about our groups and expert blocks.
"""
from __future__ import annotations

import contextlib

import torch

from scaletrain.parallel.grads import ExpertParallelGrads
from scaletrain.parallel.state import rank0_layout


def _holds_experts(module) -> bool:
    """A scaletrain MoE feed-forward block (its ``experts`` say which slice of the layer's experts)."""
    return getattr(getattr(module, "experts", None), "first_expert", None) is not None


@contextlib.contextmanager
def expert_setup(model: torch.nn.Module, ep: ExpertParallelGrads, zero_stage: int = 0, ddp: bool = False):
    """Around an engine's set-up (``deepspeed.initialize``, Accelerate's ``prepare``) under expert
    parallelism; build the optimizer inside. Nothing happens at ep_size 1.

    DDP (``ddp``): the expert parameters are given to DDP as parameters to ignore
    (``_ddp_params_and_buffers_to_ignore``: no all-reduce, no start-up broadcast of rank 0's experts).
    DeepSpeed (``zero_stage``): it broadcasts rank 0's parameters, experts included; this rank's experts
    are copied before and put back after.

    ZeRO-0 and DDP: the owned expert tensors (MoCE, ``moe.moce_partition``) take rank 0's shapes while
    the engine broadcasts rank 0's parameters, and get their own back after (``rank0_layout``).

    ZeRO-1/2: DeepSpeed's own MoE path. DeepSpeed reduces a parameter marked ``allreduce = False`` over the
    expert-data-parallel group named by its ``group_name`` (sum / world size, as ``scaletrain.parallel.grads``),
    broadcasts it from that group's first rank, and ZeRO-1/2 partition an optimizer group with ``moe: True``
    over that group only. It switches that path on only for its own MoE modules: how DeepSpeed is made to
    take ours, our groups and the parameter marks is ``deepspeed_internals.moe_path`` (``build_optimizer``
    then names the experts' group and sets ``moe``). DeepSpeed broadcasts experts within their
    expert-data-parallel group only, where the shapes agree, so owned experts need nothing.
    """
    if not ep.active:
        yield
        return
    if ddp:
        model._ddp_params_and_buffers_to_ignore = list(ep.expert_names)
        with rank0_layout(model, ep.ctx.ep_size):
            yield
        return
    experts = ep.snapshot()
    with _deepspeed_experts(model, ep, zero_stage):
        yield
    ep.restore(experts)  # DeepSpeed broadcast rank 0's parameters, experts included


@contextlib.contextmanager
def _deepspeed_experts(model: torch.nn.Module, ep: ExpertParallelGrads, zero_stage: int):
    if zero_stage not in (1, 2):
        with rank0_layout(model, ep.ctx.ep_size):
            yield
        return
    from scaletrain.engine.deepspeed_internals import moe_path

    with moe_path(ep, _holds_experts):
        yield
