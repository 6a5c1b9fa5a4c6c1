"""Every recipe's model at initialisation: loss about ln V on random tokens, activations far inside the
fp16 range, and one fp16 loss-scaled step that is not skipped and moves every parameter.

The recipes are built with their own architecture, depth and options; only the width is reduced
(d 288, FFN 288: still >= V = 268 for the one-hot models) so the test stays cheap on a CPU.

Margin of the initial loss: after the final LayerNorm the decoder state has unit RMS, and every
output row (a N(0, 1/d) embedding row or a one-hot row) has norm about 1, so the logits start with a
standard deviation near 1; on targets unrelated to the model that costs about sigma^2 / 2 = 0.5 nats
above ln V (measured: +0.18 to +0.70 over the recipes). We allow [-0.25, +1.0]. A logit scale of
sqrt(d) (the one-hot output scale the reference code starts from) gives about +40 nats at d 288.
"""
from __future__ import annotations

import math

import pytest
import torch

from scaletrain.config import load_config, recipe_names
from scaletrain.models import build_model
from scaletrain.models.loss import label_smoothed_ce
from scaletrain.vocab import BYTE_OFFSET, LANG_OFFSET, PAD

N_LANGS = 8
D = 288
FP16_MAX = 65504.0
HEADROOM = 64.0  # activations and logits at init must stay below 65504 / 64
SHRINK = [f"model.d_model={D}", f"model.ffn_dim={D}", "model.max_positions=64", "data.max_bytes=60",
          "data.max_tokens=200"]


def build(recipe: str):
    """(model, vocabulary size, token range) for ``recipe`` at width D; subword recipes get a stand-in
    vocabulary of 300 pieces (the same one ``scaletrain model summary`` uses without shards)."""
    cfg = load_config(recipe, SHRINK)
    if cfg.model.embedding == "charaware":  # fp16 convolutions crawl on a CPU: a narrower character CNN
        cfg = load_config(recipe, SHRINK + ["model.charaware.dim=8", "model.charaware.max_len=8"])
    pieces = None
    if cfg.data.tokenizer == "byte":
        V, lo, hi = LANG_OFFSET + N_LANGS, BYTE_OFFSET, LANG_OFFSET
    else:
        n = 300
        V, lo, hi = n + N_LANGS, 4, n
        pieces = [""] * 4 + [chr(0x61 + i % 26) * (1 + i % 6) for i in range(n - 4)] + [""] * N_LANGS
    torch.manual_seed(0)
    return build_model(cfg.model, V, pieces=pieces, moe=cfg.moe), V, (lo, hi)


def batch(V: int, lo: int, hi: int):
    g = torch.Generator().manual_seed(1)
    src = torch.randint(lo, hi, (4, 24), generator=g)
    tgt = torch.randint(lo, hi, (4, 25), generator=g)
    src[:, 0] = V - N_LANGS  # source and target language tags
    tgt[:, 0] = V - N_LANGS + 1
    src[1, 15:] = PAD
    tgt[1, 15:] = PAD
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:].clone()
    tgt_out[tgt_in.eq(PAD)] = PAD
    return src, tgt_in, tgt_out


RECIPES = recipe_names()


def test_the_recipes_are_all_here():
    assert {"base", "embeddingless", "byte_ncf", "byte_wsf", "moce_d5", "moe_base", "subword_cg"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_initial_loss_is_about_ln_v_and_activations_fit_fp16(recipe):
    model, V, (lo, hi) = build(recipe)
    model.eval()
    src, tgt_in, tgt_out = batch(V, lo, hi)
    peak = {}

    def record(mod, inp, out, name=None):
        if torch.is_tensor(out) and out.is_floating_point():
            peak[name] = float(out.detach().abs().max())

    hooks = [m.register_forward_hook(lambda m, i, o, n=n: record(m, i, o, n)) for n, m in model.named_modules()]
    with torch.no_grad():
        logits = model(src, tgt_in)
    for h in hooks:
        h.remove()
    loss, _, n = label_smoothed_ce(logits.float(), tgt_out, epsilon=0.0, ignore_index=PAD)
    excess = float(loss / n) - math.log(V)
    assert -0.25 < excess < 1.0, f"{recipe}: initial loss {float(loss / n):.2f} nats/token, ln V = {math.log(V):.2f}"
    worst = max(peak, key=peak.get)
    assert peak[worst] < FP16_MAX / HEADROOM, f"{recipe}: |{worst}| reaches {peak[worst]:.0f} at init"
    assert float(logits.abs().max()) < FP16_MAX / HEADROOM


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_fp16_loss_scaled_step_is_taken_and_moves_every_parameter(recipe):
    """The GPU suite's step/<variant>/fp16 check on the CPU (autocast fp16 and GradScaler run there):
    at the GradScaler's first scale (65536) no gradient overflows, so the step is not skipped."""
    model, V, (lo, hi) = build(recipe)
    model.train()
    src, tgt_in, tgt_out = batch(V, lo, hi)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(src, tgt_in)
    assert logits.dtype == torch.float16
    loss, _, n = label_smoothed_ce(logits.float(), tgt_out, epsilon=0.1, ignore_index=PAD)
    aux = model.last_aux_loss
    scaler.scale(loss / n + (aux if aux is not None else 0.0)).backward()
    bad = [k for k, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"{recipe}: non-finite scaled gradients in {bad[:4]}"
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**16, f"{recipe}: the step was skipped (overflow)"
    still = [k for k, p in model.named_parameters() if torch.equal(p.detach(), before[k])]
    assert not still, f"{recipe}: {len(still)} parameters did not move, e.g. {still[:3]}"
