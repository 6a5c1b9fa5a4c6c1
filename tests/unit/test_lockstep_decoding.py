"""Decoding with the experts kept sharded (``scaletrain.parallel.lockstep``), 2 gloo ranks, moe.ep_size=2:
a MoCE model whose conv experts are spread over the ranks (moe.moce_partition) with MoE-FFN experts in
every encoder and decoder layer. The ranks decode different numbers of batches (3 and 1; then 1 and 0)
of sources of different lengths (so different numbers of decoder steps), greedy and beam search;
every rank's outputs equal those of one process holding every expert, both ranks finish, and the
routing counts of training are left as they were."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import run_ranks
from scaletrain.eval.generate import generate
from scaletrain.models import ModelConfig, build_model
from scaletrain.models.config import ConvConfig, MoEConfig
from scaletrain.parallel import ParallelContext, build_parallel_context
from scaletrain.parallel.lockstep import LockstepDecoder, exchanging_layers
from scaletrain.vocab import BYTE_OFFSET, LANG_OFFSET, PAD, ByteVocab

VOCAB = ByteVocab(["de", "en", "ru"])
MOE = dict(num_experts=4, top_k=2, every=1, ffn_dim=16)


def _model(moe: MoEConfig, ctx: ParallelContext | None):
    torch.manual_seed(0)
    cfg = ModelConfig(arch="moce", d_model=16, n_heads=2, encoder_layers=2, decoder_layers=2, ffn_dim=32,
                      dropout=0.0, max_positions=64, conv=ConvConfig(kernels=[0, 1, 3, 5], layers=[0, 1]))
    return build_model(cfg, VOCAB.size, moe=moe, parallel=ctx).eval()


def _batches(lengths: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(0, len(lengths), 2):
        lens = lengths[i:i + 2]
        src = torch.full((len(lens), max(lens)), PAD)
        for r, n in enumerate(lens):
            src[r, :n] = torch.randint(BYTE_OFFSET + 97, BYTE_OFFSET + 123, (n,), generator=g)
        out.append((src, torch.full((len(lens),), LANG_OFFSET + 1)))
    return out


def _worker(rank, world):
    ctx = build_parallel_context(2)
    sharded = _model(MoEConfig(**MOE, ep_size=2, moce_partition=True), ctx)
    ref = _model(MoEConfig(**MOE), None)  # every expert, one process
    assert [type(m).__name__ for m in exchanging_layers(sharded.encoder_layers)] == \
        ["MoCEExperts", "MoEFeedForward", "MoCEExperts", "MoEFeedForward"]
    assert sum(p.numel() for p in sharded.parameters()) < sum(p.numel() for p in ref.parameters())
    before = [dict(m.moe_stats(reset=False)) for m in exchanging_layers(sharded) if hasattr(m, "moe_stats")]
    rounds = {0: ([3, 12, 7, 5, 9], [6]), 1: ([4], [])}  # per round: rank 0's and rank 1's source lengths
    for rnd, lengths in rounds.items():
        dec = LockstepDecoder(sharded, ctx)
        for i, (src, tags) in enumerate(_batches(lengths[rank], seed=10 * rnd + rank)):
            kw = dict(beam=1 + i % 2, max_len_a=1.0, max_len_b=2)
            got = generate(dec, src, tags, **kw)
            assert got == generate(ref, src, tags, **kw), (rnd, rank, i)
        dec.finish()
    t = torch.ones(1)
    dist.all_reduce(t)  # both ranks came out of finish() in step
    assert float(t[0]) == 2
    after = [m.moe_stats(reset=False) for m in exchanging_layers(sharded) if hasattr(m, "moe_stats")]
    assert after == before


@pytest.mark.timeout(180)  # a rank left out of an exchange hangs: fail in minutes, not at the suite timeout
def test_lockstep_decoding_equals_one_process_with_uneven_work():
    run_ranks(_worker, 2)
