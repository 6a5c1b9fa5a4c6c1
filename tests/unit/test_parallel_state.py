"""Expert shards <-> full state dict on 2 gloo ranks: an ep_size=2 model consolidates to exactly the
ep_size=1 model's state dict (same seed), a full state dict reshards into ep_size=2 and gives the ep=1
outputs, and a consolidate -> shard round trip keeps every rank's own (changed) experts."""
from __future__ import annotations

import pytest
import torch

from helpers import run_ranks
from scaletrain.errors import ScaletrainError
from scaletrain.models import ModelConfig, build_model
from scaletrain.models.config import MoEConfig
from scaletrain.parallel import ParallelContext, build_parallel_context
from scaletrain.parallel.state import consolidate_state_dict, expert_shards, shard_state_dict

CFG = ModelConfig(d_model=16, n_heads=2, encoder_layers=2, decoder_layers=2, ffn_dim=24, dropout=0.0)


def _model(ep: int, ctx: ParallelContext, experts: int = 4):
    torch.manual_seed(0)
    return build_model(CFG, 260, moe=MoEConfig(num_experts=experts, every=2, ep_size=ep), parallel=ctx).eval()


def _state_worker(rank, world):
    ctx = build_parallel_context(2)
    ref, ep = _model(1, ParallelContext.single()), _model(2, ctx)
    shards = expert_shards(ep)
    assert len(shards) == 8 and all(v == (2 * rank, 4) for v in shards.values())  # w1 b1 w2 b2, 2 layers
    full = consolidate_state_dict(ep, ctx)
    ref_sd = ref.state_dict()
    assert full.keys() == ref_sd.keys()
    for k in ref_sd:
        assert torch.equal(full[k], ref_sd[k]), k
    with torch.no_grad():  # ref changes; the ep=2 model takes its weights from the full state dict
        for p in ref.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ep.load_state_dict(shard_state_dict(ref.state_dict(), ep))
    src = torch.randint(4, 260, (2, 6), generator=torch.Generator().manual_seed(rank))
    tgt = torch.randint(4, 260, (2, 5), generator=torch.Generator().manual_seed(rank + 9))
    with torch.no_grad():
        torch.testing.assert_close(ep(src, tgt), ref(src, tgt))
        for p in ep.parameters():  # each rank changes its own experts differently
            if getattr(p, "expert", False):
                p.add_(float(rank + 1))
    fresh = _model(2, ctx)
    fresh.load_state_dict(shard_state_dict(consolidate_state_dict(ep, ctx), fresh))
    for (k, a), b in zip(ep.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    with pytest.raises(ScaletrainError, match="the checkpoint has 4 experts, the model 8"):
        shard_state_dict(ref.state_dict(), _model(2, ctx, experts=8))


@pytest.mark.slow
def test_consolidate_and_reshard_experts_on_two_ranks():
    run_ranks(_state_worker, 2)
