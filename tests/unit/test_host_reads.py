"""Host reads of device data (device syncs on an accelerator) per training forward + backward, counted on
the CPU (scaletrain/models/host_reads.py): none in a dense model, none in a single-rank MoE model whose
experts run as grouped GEMMs, at most one per routed layer otherwise (the per-expert counts; over expert
parallelism the all-to-all split sizes); and the grouped MoE path equals the per-expert loop."""
from __future__ import annotations

import pytest
import torch

from helpers import run_ranks
from scaletrain.config import load_config
from scaletrain.models import build_model, moe as moe_module
from scaletrain.models.config import ModelConfig, MoEConfig
from scaletrain.models.host_reads import HostReads
from scaletrain.models.loss import label_smoothed_ce
from scaletrain.models.moe import MoEFeedForward
from scaletrain.parallel import ParallelContext, build_parallel_context
from scaletrain.vocab import BYTE_OFFSET, LANG_OFFSET, PAD

V = LANG_OFFSET + 8
SMALL = ["model.d_model=272", "model.ffn_dim=64", "model.max_positions=64", "data.max_bytes=60", "data.max_tokens=200"]


def test_the_counter_sees_every_kind_of_read():
    x = torch.tensor([1, 0, 2, 3])
    with HostReads() as reads:
        x.tolist()
        int(x.sum())
        bool(x[0] > 0)
        x.nonzero()
        x[x > 0]
        x.repeat_interleave(x)
    assert reads.events == ["tolist", "item", "item", "nonzero", "index", "repeat_interleave"]
    with HostReads() as reads:  # device-side work only
        x.repeat_interleave(x, output_size=6)
        torch.sort(x, stable=True)
        torch.zeros(4, dtype=torch.long).scatter_add_(0, x, torch.ones_like(x))
        torch.where(x > 0, x, 0).cumsum(0)
    assert reads.count == 0, reads.events
    assert torch.Tensor.tolist(x) == [1, 0, 2, 3]  # restored


def _batch():
    g = torch.Generator().manual_seed(1)
    src = torch.randint(BYTE_OFFSET, LANG_OFFSET, (4, 24), generator=g)
    tgt = torch.randint(BYTE_OFFSET, LANG_OFFSET, (4, 25), generator=g)
    src[:, 0] = V - 8
    src[1, 15:] = PAD
    tgt[1, 15:] = PAD
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:].clone()
    tgt_out[tgt_in.eq(PAD)] = PAD
    return src, tgt_in, tgt_out


def _step_reads(recipe: str, overrides=(), dtype=torch.float32):
    cfg = load_config(recipe, SMALL + list(overrides))
    torch.manual_seed(0)
    model = build_model(cfg.model, V, moe=cfg.moe).to(dtype).train()
    src, tgt_in, tgt_out = _batch()
    with HostReads() as reads:
        loss, _, n = label_smoothed_ce(model(src, tgt_in), tgt_out, epsilon=0.1, ignore_index=PAD)
        aux = model.last_aux_loss
        (loss / n + (aux if aux is not None else 0.0)).backward()
    moe_layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    moce_layers = [m for m in model.modules() if type(m).__name__ == "MoCEExperts"]
    return reads, len(moe_layers), len(moce_layers)


@pytest.mark.parametrize("recipe", ["small", "base", "byte_ncf", "byte_wsf", "embeddingless", "msc", "msha"])
def test_dense_models_read_nothing(recipe):
    reads, n_moe, n_moce = _step_reads(recipe)
    assert n_moe == n_moce == 0
    assert reads.count == 0, reads.events


def test_single_rank_moe_with_grouped_experts_reads_nothing():
    reads, n_moe, _ = _step_reads("moe_base")
    assert n_moe == 6 and reads.count == 0, reads.events


def test_moe_on_the_per_expert_loop_reads_once_per_layer():
    reads, n_moe, _ = _step_reads("moe_base", dtype=torch.float64)  # no grouped GEMM in fp64
    assert reads.count == n_moe == 6, reads.events


def test_moce_routed_reads_once_per_layer_and_dense_reads_nothing():
    reads, _, n_moce = _step_reads("moce_d5_moe")  # CPU default: the routed path
    assert n_moce == 1 and reads.count == 1, reads.events
    reads, _, _ = _step_reads("moce_d5_moe", ["model.moce.dispatch=dense"])
    assert reads.count == 0, reads.events


@pytest.mark.parametrize("capacity", [0.0, 0.5])
def test_grouped_experts_equal_the_per_expert_loop(capacity, monkeypatch):
    """Outputs, aux loss, counts and every gradient, with pads, dropped pairs (capacity) and dropout off."""
    moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=capacity, aux_loss_coef=0.1, shared_expert=True)
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(3, 7, 8, generator=g)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 1:] = True
    runs = []
    for grouped in (True, False):
        monkeypatch.setattr(moe_module, "_grouped_mm_ok", lambda x, f, on=grouped: on)
        torch.manual_seed(0)
        layer = MoEFeedForward(8, moe, 12, "relu", 0.0, "torch")
        x = x0.clone().requires_grad_()
        y = layer(x, pad)
        (y * torch.linspace(-1, 1, 8)).sum().add(layer.aux_loss).backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        runs.append((y.detach(), x.grad, layer.aux_loss.detach(), layer.moe_stats(), grads))
    (yg, xg, ag, sg, gg), (yl, xl, al, sl, gl) = runs
    assert torch.equal(yg[pad], torch.zeros_like(yg[pad]))
    torch.testing.assert_close(yg, yl)
    torch.testing.assert_close(xg, xl)
    torch.testing.assert_close(ag, al)
    assert sg == sl and sg["pairs"] == 2 * int((~pad).sum()) and (sg["dropped"] > 0) == (capacity > 0)
    for a, b in zip(gg, gl):
        torch.testing.assert_close(a, b)


def _ep_worker(rank, world):
    ctx = build_parallel_context(2)
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_heads=2, encoder_layers=2, decoder_layers=2, ffn_dim=32, dropout=0.0,
                      arch="moce")
    cfg.conv.kernels, cfg.conv.layers = [0, 1, 3], [0]
    moe = MoEConfig(num_experts=4, top_k=2, every=1, ep_size=2, moce_partition=True)
    model = build_model(cfg, V, moe=moe, parallel=ctx).train()
    src, tgt_in, tgt_out = _batch()
    with HostReads() as reads:
        loss, _, n = label_smoothed_ce(model(src, tgt_in), tgt_out, epsilon=0.1, ignore_index=PAD)
        (loss / n + model.last_aux_loss).backward()
    # 4 MoE-FFN layers (the all-to-all split sizes) + 1 expert-parallel MoCE layer (the gathered counts)
    assert reads.count == 5, reads.events


@pytest.mark.slow
def test_expert_parallel_layers_read_once_each():
    run_ranks(_ep_worker, 2)
