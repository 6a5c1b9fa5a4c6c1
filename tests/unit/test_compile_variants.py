"""Every recipe family compiles (``engine.compile``, which ``auto`` turns on for every CUDA run): one forward and
backward of a tiny model of each family through ``engine.model_prep.prepare_model`` (``engine.compile=true``,
``engine.compile_backend=aot_eager``; CPU: dynamo's capture and AOT autograd, graph breaks allowed) gives eager's
loss and gradients, for a padded batch and, for the dense and one-hot families, an unpadded one
(``src_padded=False``, the second graph training compiles). The families (dense, one-hot, MoE, MoCE, MoCE + MoE)
run by default; the other recipes' variants are marked slow. Inductor's code generation is the GPU suite's
(``benchmarks/gpu_step.sh``).

Seen failing without the MoE fix: dynamo traces ``torch._grouped_mm`` with its meta function, which refuses
fp32 activations (CUDA's bf16 rule) that the CPU op accepts, so the MoE family raised at the first forward."""
from __future__ import annotations

import random

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.engine.model_prep import prepare_model
from scaletrain.models import build_model
from scaletrain.models.loss import label_smoothed_ce
from scaletrain.vocab import LANG_OFFSET, PAD

TINY = ["model.d_model=32", "model.ffn_dim=48", "model.encoder_layers=1", "model.decoder_layers=1",
        "model.max_positions=64", "model.dropout=0.0", "data.max_bytes=40", "data.max_tokens=600",
        "engine.compile=true", "engine.compile_backend=aot_eager"]
ONEHOT = ["model.d_model=272"]  # one-hot embeddings need d_model >= the vocabulary (264 here)
# recipe -> (extra overrides, also the unpadded batch). The families (dense Transformer, one-hot embeddingless,
# MoE-FFN, MoCE, MoCE with MoE-FFN) run by default; the unpadded batch (``src_padded=False``: attention without a mask,
# the Transformer's code every family shares) only where it is cheap. The other recipes' embedding and layer
# variants are marked slow and take the padded batch only.
FAMILIES = {
    "base": ([], True),
    "embeddingless": (ONEHOT, True),
    "moe_base": (["moe.every=1", "moe.num_experts=4"], False),
    "moce_d5": ([], False),
    # both kinds of experts in one model: MoCE's convolution experts and MoE FFN blocks
    "moce_d5_moe": (["moe.every=1", "moe.num_experts=4"], False),
}
VARIANTS = {
    "byte_ncf": [*ONEHOT, "model.lobef.byte_layers=1"],
    "byte_wsf": [*ONEHOT, "model.lobef.byte_layers=1"],
    "msc": [],
    "msha": [],
    "moce_d5_lid": [],
    "subword_cg": ["model.charaware.dim=8", "model.charaware.max_len=6"],
}
N_PIECES = 200


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pieces() -> list[str]:
    """A subword vocabulary: 4 specials, N_PIECES distinct pieces, 4 language tags (charaware spells the pieces)."""
    rng, out = random.Random(0), []
    while len(out) < N_PIECES:
        p = ("\u2581" if rng.random() < 0.5 else "") + "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 6)))
        if p not in out:
            out.append(p)
    return [""] * 4 + out + [""] * 4


def _batch(first_tag: int, low: int, high: int, padded: bool):
    """src [3, 12] (a space at 5 for WSF's words; row 1 padded when ``padded``), tgt [3, 9] with a padded row."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(low, high, (3, 12), generator=g)
    src[:, 0], src[:, 5] = first_tag, 32 + 4
    if padded:
        src[1, 8:] = PAD
    tgt = torch.randint(low, high, (3, 9), generator=g)
    tgt[:, 0] = first_tag + 1
    tgt[2, 6:] = PAD
    return src, tgt[:, :-1], tgt[:, 1:]


def _loss_and_grads(model, batch, src_padded: bool):
    src, tgt_in, tgt_out = batch
    model.zero_grad(set_to_none=True)
    logits = model(src, tgt_in, src_padded=src_padded)
    loss, _, ntok = label_smoothed_ce(logits, tgt_out, epsilon=0.1, ignore_index=PAD)
    if model.last_aux_loss is not None:  # MoE load balancing, as TranslationUnit.loss adds it
        loss = loss + model.last_aux_loss * ntok
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compiled_matches_eager(recipe: str, overrides: list[str], unpadded: bool) -> None:
    from torch._dynamo.utils import counters

    cfg = load_config(recipe, [*TINY, *overrides])
    if cfg.model.embedding == "charaware":
        pieces = _pieces()
        vocab, first_tag, low, high = len(pieces), 4 + N_PIECES, 4, 4 + N_PIECES
    else:
        pieces, vocab, first_tag, low, high = None, LANG_OFFSET + 4, LANG_OFFSET, 4, LANG_OFFSET
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab, pieces, moe=cfg.moe if cfg.moe.enabled() else None)
    batches = [(_batch(first_tag, low, high, padded=True), True)]
    if unpadded:
        batches.append((_batch(first_tag, low, high, padded=False), False))
    eager = [_loss_and_grads(model, b, flag) for b, flag in batches]
    assert prepare_model(model, cfg) is model  # Module.compile in place (fullgraph=False): same parameter names
    compiled = [_loss_and_grads(model, b, flag) for b, flag in batches]
    assert counters["frames"]["ok"] >= len(batches)  # dynamo captured frames (not a silent eager run)
    for (le, ge), (lc, gc) in zip(eager, compiled):
        torch.testing.assert_close(lc, le, rtol=1e-6, atol=1e-6)
        assert gc.keys() == ge.keys() and ge
        for n in ge:
            torch.testing.assert_close(gc[n], ge[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_compiles_and_matches_eager(family):
    overrides, unpadded = FAMILIES[family]
    _compiled_matches_eager(family, overrides, unpadded)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(VARIANTS))
def test_recipe_variant_compiles_and_matches_eager(recipe):
    _compiled_matches_eager(recipe, VARIANTS[recipe], unpadded=False)
