"""Parallelism beyond data parallel (docs/DESIGN.md, "Parallelism beyond data parallel").

- ``context.py``: ``ParallelDims`` (the size of each parallel dimension, from the config) and
  ``ParallelContext`` (this rank's data-parallel, expert-parallel and expert-data-parallel process
  groups), built once by the engine (``Engine.parallel``) and handed explicitly to the model builder,
  the gradient reduction, the expert set-up, checkpoints and lock-step decoding; a single process
  gets the trivial one.
- ``exchange.py``: the token exchange of expert parallelism, testable without a model: per-expert
  count exchange, variable-size all-to-all with autograd, permute / unpermute by destination expert.
- ``state.py``: expert shards <-> the full (ep_size=1) state dict: consolidation over the EP group and
  resharding for another ep_size.
- ``lockstep.py``: decoding with the experts sharded: the ranks of an EP group vote before each encode
  and decoder step and join each other's exchanges with no rows.
- ``grads.py``: expert-gradient reduction over the expert-data-parallel group (scaled by the world
  size, so the update does not depend on ep_size) and the clipping norm that counts each expert once.

Layer: below ``models`` and ``engine`` (both import it); it imports only torch, ``errors``,
``safeload`` and ``fileio``. With ``engine/`` the only place that makes process groups (tested).
"""
from scaletrain.parallel.context import ParallelContext, ParallelDims, build_parallel_context, ep_size_problem

__all__ = ["ParallelContext", "ParallelDims", "build_parallel_context", "ep_size_problem"]
