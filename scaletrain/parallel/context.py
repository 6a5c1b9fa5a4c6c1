"""``ParallelContext``: the run's parallel layout and process groups, built once by the engine.

The engine makes it in its constructor, right after the default process group
(:meth:`ParallelDims.from_config` is the one place that reads ``moe.ep_size`` from a config), exposes it
as ``Engine.parallel`` and hands it to whoever needs a group: the model builder (which experts a rank
holds), the gradient reduction (``grads.py``), the engine's expert set-up, checkpoints of expert shards
and lock-step decoding. Nothing searches a model for it. As torchtitan's ``ParallelDims``: the sizes
of every dimension (:class:`ParallelDims`, validated against the world size, no process group) are
kept apart from the groups (:meth:`ParallelDims.build`, collective); a new dimension (tensor or
pipeline parallel) is a size there and a group here.

Dimensions today (W ranks):

* data parallel (DP): every rank; each rank reads its own batches, and replicated (dense)
  gradients are averaged over all W ranks. The context has no data-parallel rank, size or group of its
  own: with no tensor or pipeline dimension the data-parallel group *is* the world, and a separate
  ``dp_rank``/``dp_size`` would be a second name for ``rank``/``world_size`` that no test could tell apart
  (token counts, validation and BLEU shares split by one and summed over the other would pass the same
  tests). The batches, the token-count normalisation, the validation and BLEU shares and the data position
  at another layout all use ``rank`` and ``world_size``, and the collectives the default group. A tensor or
  pipeline dimension would bring a data-parallel group back, with the collectives taking it and a run of
  two data-parallel groups to show it.
* expert parallel (EP), size P = ``moe.ep_size``: as Megatron-Core and DeepSpeed lay out expert
  groups, the world is cut into W / P groups of P consecutive ranks (consecutive ranks usually share
  a node, and the all-to-all is the heavy collective). The experts of each routed layer are
  partitioned over the P ranks of an EP group: EP rank i holds experts [i * E/P, (i + 1) * E/P).
* expert data parallel (EDP): the ranks holding the same experts (equal EP rank, one per EP group),
  W / P of them; expert gradients are reduced over it only.

The groups are made with ``torch.distributed.new_group``, which every rank must call for every group
in the same order: :meth:`ParallelDims.build` does that, so call it on every rank, once.

The context carries the run's collectives on host values (fairseq2's gangs carry theirs):
:meth:`ParallelContext.all_reduce_sum` (token counts, votes, failure flags), ``broadcast_object``,
``all_gather_object``, ``barrier``. Host numbers travel on a gloo group: the default group where it is
gloo, else a gloo side group of every rank (``host_group``, made with the other groups), so a step's
token count and votes never wait for the GPU. A world of one needs no process group at all.
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
class ParallelDims:
    """The size of every parallel dimension of a run, without process groups (cheap, picklable).

    ``world_size``: W ranks, all data parallel. ``ep``: expert-parallel size P (``moe.ep_size``).
    The expert-data-parallel size is W / P. :meth:`problem` says why the sizes do not fit."""

    world_size: int = 1
    ep: int = 1

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "ParallelDims":
        """The layout a run's config asks for on ``world_size`` ranks: the one place ``moe.ep_size``
        is read from a config (engines, and the DeepSpeed config checks of ``preflight``)."""
        return cls(world_size=world_size, ep=int(cfg.moe.ep_size))

    @property
    def edp(self) -> int:
        return self.world_size // self.ep

    def problem(self) -> Optional[str]:
        """Why these sizes cannot be used (one line), or None."""
        return ep_size_problem(self.ep, self.world_size)

    def build(self, rank: Optional[int] = None) -> "ParallelContext":
        """This rank's :class:`ParallelContext`; creates the process groups (collective: every rank
        calls it once, in the same order). ``rank`` defaults to the default process group's (0
        without one). Raises ScaletrainError (one line) when the sizes do not fit (:meth:`problem`)."""
        return _build_groups(self, rank)


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in every parallel dimension and the process group of each. A group is a
    ``torch.distributed`` process group, or None where it is this process alone (EP at ep_size 1)
    or the whole world (the default group). Frozen and shared: a deep copy of a model that holds it
    keeps the same groups."""

    # every rank is data parallel (no tensor/pipeline dimension): its batches, shares and gradient average
    # are by rank of world_size, over the default group
    world_size: int = 1
    rank: int = 0
    # expert parallel: P consecutive ranks that split each routed layer's experts and exchange tokens
    # with all-to-alls (None at ep_size 1: no exchange)
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    # expert data parallel: the W / P ranks holding the same experts (equal ep_rank); expert gradients
    # are reduced over it (None at ep_size 1: the whole world, as data parallel)
    edp_size: int = 1
    edp_rank: int = 0
    edp_group: Any = None
    # host values (token counts, votes): a gloo group of every rank where the default group is not gloo
    # (NCCL); None where the default group is gloo itself (or a world of one)
    host_group: Any = None

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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- collectives on host values (every rank calls each at the same point) -------------------
    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sums over every rank of a few host numbers, in float64 (collective). Host tensors on a gloo
        group (``host_group``), so under NCCL the training step's token counts and votes never wait for
        the GPU."""
        import torch

        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.host_group)
        return t.numpy().tolist()  # a host tensor (numpy() refuses a device one)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank (collective; pickled by torch on the host group)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.host_group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order (collective)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.host_group)


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
    """The context of this rank for an expert-parallel size ``ep_size`` (``ParallelDims(world_size,
    ep_size).build(rank)``); creates the process groups. ``world_size``/``rank`` default to the
    initialised default process group (1 / 0 without one)."""
    import torch.distributed as dist

    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return ParallelDims(world_size=world_size, ep=ep_size).build(rank)


def _build_groups(dims: ParallelDims, rank: Optional[int]) -> ParallelContext:
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    world_size, ep_size = dims.world_size, dims.ep
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if problem := dims.problem():
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
    # host values ride on gloo: the default group where it is gloo, else a gloo group of every rank
    host_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return ParallelContext(world_size=world_size, rank=rank, ep_size=ep_size, ep_rank=ep_rank, ep_group=ep_group,
                           edp_size=world_size // ep_size, edp_rank=ep_index, edp_group=edp_group,
                           host_group=host_group)

