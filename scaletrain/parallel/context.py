"""``ParallelContext``: which ranks share experts, built once from ``moe.ep_size`` and the world size.

Layout (as Megatron-Core and DeepSpeed lay out expert groups): the world of W ranks is cut into
W / P expert-parallel (EP) groups of P consecutive ranks (consecutive ranks usually share a node, and
the all-to-all is the heavy collective). The experts of each routed layer are partitioned over the P
ranks of an EP group: EP rank i holds experts [i * E/P, (i + 1) * E/P). The ranks holding the same
experts (equal EP rank, one per EP group) form an expert-data-parallel (EDP) group of W / P ranks;
expert gradients are reduced over it only, every other gradient over the whole world.

The groups are made with ``torch.distributed.new_group``, which every rank must call for every group
in the same order: ``build_parallel_context`` does that, so call it on every rank, once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from scaletrain.errors import ScaletrainError


def ep_size_problem(ep_size: int, world_size: int) -> Optional[str]:
    """Why ``moe.ep_size`` cannot be used with ``world_size`` ranks (one line), or None."""
    if ep_size < 1 or world_size % ep_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        return (f"moe.ep_size={ep_size} must divide the number of ranks ({world_size}); "
                f"choose one of {', '.join(map(str, divisors))}")
    return None


@dataclass(frozen=True)
class ParallelContext:
    """Ranks and process groups for expert parallelism. ``ep_group`` / ``edp_group`` are
    ``torch.distributed`` process groups, or None where the group is this process alone (EP) or the
    whole world (EDP when ep_size == 1, i.e. ordinary data parallel)."""

    world_size: int = 1
    rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    edp_size: int = 1
    edp_rank: int = 0
    edp_group: Any = None

    def __deepcopy__(self, memo) -> "ParallelContext":
        return self  # process groups are handles: a copied model uses the same groups

    @classmethod
    def single(cls) -> "ParallelContext":
        """The trivial context of a single process (every expert local, no exchange)."""
        return cls()

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1

    def local_experts(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds, out of ``num_experts`` per layer."""
        if num_experts % self.ep_size:
            raise ScaletrainError(f"moe.num_experts={num_experts} must be a multiple of moe.ep_size={self.ep_size}")
        n = num_experts // self.ep_size
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)


def balanced_owners(sizes, ep_size: int) -> list[int]:
    """EP rank owning each of a layer's experts of unequal cost ``sizes`` (MoCE's conv experts:
    kernel taps): the largest first, each to the rank with the least cost so far, a rank without an
    expert first (ties: lowest rank), so every rank owns one when there are at least ``ep_size``. The
    same on every rank, so a checkpoint written at one ep_size can be re-cut for another."""
    owners = [0] * len(sizes)
    cost = [0] * ep_size
    count = [0] * ep_size
    for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        p = min(range(ep_size), key=lambda p: (count[p] > 0, cost[p], p))
        owners[j] = p
        cost[p] += sizes[j]
        count[p] += 1
    return owners


def build_parallel_context(ep_size: int, world_size: Optional[int] = None, rank: Optional[int] = None) -> ParallelContext:
    """The context of this rank for ``moe.ep_size = ep_size``; creates the process groups.

    ``world_size``/``rank`` default to the initialised default process group (1 / 0 without one).
    Raises ScaletrainError (one line) when ep_size does not divide the world size."""
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if problem := ep_size_problem(ep_size, world_size):
        raise ScaletrainError(problem)
    if world_size == 1:
        return ParallelContext.single()
    if not initialised:
        raise ScaletrainError(f"a parallel context for {world_size} ranks needs an initialised process group")
    ep_rank, ep_index = rank % ep_size, rank // ep_size
    ep_group = edp_group = None
    for g in range(world_size // ep_size):  # every rank creates every group, in the same order
        grp = dist.new_group(list(range(g * ep_size, (g + 1) * ep_size))) if ep_size > 1 else None
        if g == ep_index:
            ep_group = grp
    if ep_size > 1:
        for i in range(ep_size):
            grp = dist.new_group(list(range(i, world_size, ep_size)))
            if i == ep_rank:
                edp_group = grp
    return ParallelContext(world_size=world_size, rank=rank, ep_size=ep_size, ep_rank=ep_rank, ep_group=ep_group,
                           edp_size=world_size // ep_size, edp_rank=ep_index, edp_group=edp_group)


def model_parallel_context(model: Any) -> ParallelContext:
    """The expert-parallel context a model was built with (the ``parallel`` attribute of its MoE
    layers); the trivial one for a model without expert layers. Engines read it in ``setup``."""
    for mod in model.modules():
        ctx = getattr(mod, "parallel", None)
        if isinstance(ctx, ParallelContext):
            return ctx
    return ParallelContext.single()
