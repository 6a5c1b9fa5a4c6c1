"""``ParallelDims``: the sizes of the parallel dimensions, read from the config in one place and checked
against the world size before any process group is made."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from scaletrain.errors import ScaletrainError
from scaletrain.parallel import ParallelContext, ParallelDims


def test_from_config_reads_the_expert_parallel_size():
    dims = ParallelDims.from_config(SimpleNamespace(moe=SimpleNamespace(ep_size=2)), world_size=8)
    assert (dims.world_size, dims.ep, dims.edp) == (8, 2, 4)
    assert dims.problem() is None


def test_sizes_that_do_not_divide_the_world_are_refused_before_any_group():
    assert "must divide the number of ranks (6)" in ParallelDims(world_size=6, ep=4).problem()
    with pytest.raises(ScaletrainError, match=r"moe.ep_size=4 must divide the number of ranks \(6\); choose one of 1, 2, 3, 6"):
        ParallelDims(world_size=6, ep=4).build(rank=0)


def test_a_single_process_gets_the_trivial_context():
    ctx = ParallelDims().build()
    assert ctx == ParallelContext.single()
    assert (ctx.world_size, ctx.rank, ctx.ep_size, ctx.edp_size, ctx.ep_group, ctx.edp_group) == (1, 0, 1, 1, None, None)
    assert not hasattr(ctx, "dp_size") and not hasattr(ctx, "dp_rank")  # every rank is data parallel
