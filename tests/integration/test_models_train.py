"""Every paper variant trains end-to-end in the real loop on the bundled corpus, saves, loads and decodes.

For each packaged recipe (tiny dimensions, ~10 steps): `scaletrain.train.Trainer` (DeepSpeed engine,
world of one, in this process) trains, the loss falls, the final checkpoint loads through
`checkpoint.load_for_inference` with exactly the trained weights, and greedy decoding of real
validation sentences (incremental, KV cache) gives the tokens a full forward pass picks. MoCE also
runs on 2 ranks through the `deepspeed` launcher, and its routing statistics come out as metrics.
"""
from __future__ import annotations

import math

import pytest
import torch

from helpers import ten_step_run, tiny_model, two_rank_training, valid_examples
from scaletrain.eval import generate as G
from scaletrain.eval.decode_step import allowed_mask
from scaletrain.checkpoint import load_for_inference
from scaletrain.config import load_config
from scaletrain.data.batch import collate
from scaletrain.models.routing_stats import routing_metrics
from scaletrain.vocab import BYTE_OFFSET, EOS, LANG_OFFSET

COMMON = ten_step_run(max_bytes=40, max_tokens=1000)  # every run adds the model: LEARNED or ONEHOT (+ variant keys)
LEARNED = tiny_model(n_heads=4, layers=(2, 1), dropout=0.1)
# one-hot needs d_model >= vocabulary size (4 specials + 256 bytes + 5 languages = 265)
ONEHOT = tiny_model(d_model=272, n_heads=4, layers=1, dropout=0.1)
VARIANTS = {
    "embeddingless": ONEHOT,
    "byte_ncf": ONEHOT + ["model.lobef.byte_layers=1"],
    "byte_wsf": ONEHOT + ["model.lobef.byte_layers=1"],
    "msc": LEARNED + ["model.conv.kernels=[0,3,5,7]"],
    "msha": LEARNED + ["model.conv.kernels=[0,1,3,5]"],
    "moce_d5": LEARNED,
    "moce_d6_lid": LEARNED,
}
MAX_OUT = 8


pytestmark = pytest.mark.usefixtures("in_process_training")


def check_decoding(model, examples):
    """Greedy decoding (incremental) == argmax of the full forward pass at every step."""
    batch = collate(examples)
    tags = batch.tgt_in[:, 0]
    assert all(LANG_OFFSET <= int(t) for t in tags)
    greedy = G.generate(model, batch.src, tags, beam=1, max_len_a=0, max_len_b=MAX_OUT)
    assert len(greedy) == len(examples)
    for i, ex in enumerate(examples):
        one = collate([ex])
        toks = greedy[i]
        assert len(toks) <= MAX_OUT and all(BYTE_OFFSET <= t < LANG_OFFSET for t in toks)
        with torch.no_grad():
            lg = model(one.src, torch.tensor([[int(one.tgt_in[0, 0])] + toks]))[0].double()
        lp = torch.log_softmax(lg, -1) + allowed_mask(lg.shape[-1], "cpu", torch.float64)
        picks = lp.argmax(-1).tolist()
        assert picks[: len(toks)] == toks, (i, picks, toks)
        if len(toks) < MAX_OUT:  # stopped by EOS, not by the length limit
            assert picks[len(toks)] == EOS


def check_routing_metrics(metrics: dict, langs: list[str], kernels: list[int]) -> None:
    assert metrics, "MoCE logged no routing statistics"
    seen = {k.split("/")[2] for k in metrics}
    assert "all" in seen and seen - {"all"} <= set(langs) and len(seen) > 2
    rmax = (max(kernels) - 1) / 2
    for lang in seen:
        shares = [metrics[f"routing/L0/{lang}/share_k{k}"] for k in kernels]
        assert all(0.0 <= s <= 1.0 for s in shares)
        assert sum(shares) == pytest.approx(1.0, abs=1e-5)
        assert 0.0 <= metrics[f"routing/L0/{lang}/mean_radius"] <= rmax


@pytest.mark.parametrize("recipe", list(VARIANTS))
def test_variant_trains_saves_loads_decodes(recipe, django_shards, tmp_path, isolated_env):
    from scaletrain.train import Trainer

    out = tmp_path / "run"
    cfg = load_config(recipe, [f"data.shards={django_shards}", f"train.out_dir={out}", *COMMON, *VARIANTS[recipe]])
    trainer = Trainer(cfg)
    res = trainer.fit()
    trainer.close()
    assert res.steps == 10 and [s for s, _ in res.train_loss] == [5, 10]
    first, last = res.train_loss[0][1], res.train_loss[-1][1]
    assert math.isfinite(last) and last < first, res.train_loss
    # routing statistics of the training steps (MoCE only), as the loop logged them at step 10;
    # the loop reads them with reset, and validation passes do not add to them
    langs = trainer.vocab.langs
    metrics = trainer.logger.last_routing
    if cfg.model.arch == "moce":
        check_routing_metrics(metrics, langs, cfg.model.conv.kernels)
        assert routing_metrics(trainer.engine.module, langs) == {}  # consumed by the loop
    else:
        assert metrics == {}
    trained = {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}
    # the final checkpoint loads as exactly the trained model
    model, cfg2, vocab, state, ckpt = load_for_inference(out)
    assert ckpt.name == "step-0000010" and state["step"] == 10 and cfg2.model == cfg.model
    loaded = model.state_dict()
    assert loaded.keys() == trained.keys()
    for k in trained:
        assert torch.equal(loaded[k], trained[k]), k
    check_decoding(model, valid_examples(django_shards, 6))


@pytest.mark.slow
def test_moce_two_ranks_deepspeed_launcher(django_shards, tmp_path):
    out = tmp_path / "run"
    model, cfg, vocab, state = two_rank_training(
        out, "moce_d5_lid", f"data.shards={django_shards}", f"train.out_dir={out}", *COMMON, *LEARNED,
        "train.max_steps=10", tmp_path=tmp_path)
    assert cfg.model.arch == "moce" and cfg.model.moce.lid and state["world_size"] == 2
    check_decoding(model, valid_examples(django_shards, 6))
