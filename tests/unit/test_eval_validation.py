"""Validation during training (scaletrain.eval.in_training): the fixed subset, BLEU/chrF of a model with shares
decoded by several ranks, best checkpoint and early stopping (in-process; the 2-rank ZeRO-3 run under the
deepspeed launcher is tests/integration/test_eval_validation_distributed.py)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from scaletrain.eval import scoring as M
from scaletrain.data.batch import Example
from scaletrain.errors import ScaletrainError
from scaletrain.eval.requests import translate_examples
from scaletrain.models import ModelConfig, build_model
from scaletrain.eval.in_training import BestCheckpoint, BleuValidator, first_n_per_direction
from scaletrain.vocab import BYTE_OFFSET, ByteVocab
from toy_decoders import LogitsOnly

VOCAB = ByteVocab(["en", "de", "ja"])


def _examples():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(17):
        s, t = [(0, 1), (1, 0), (0, 2), (2, 0)][i % 4]
        n = int(torch.randint(1, 30, (1,), generator=g))
        out.append(Example(s, t, bytes(torch.randint(97, 123, (n,), generator=g).tolist()),
                           "das ist gut ちょっと".encode() if i % 3 else b""))
    return out


def _model():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=64, max_positions=64,
                      dropout=0.0)
    return build_model(cfg, VOCAB.size).eval()


def test_first_n_per_direction_keeps_order():
    exs = _examples()
    sub = first_n_per_direction(exs, 2)
    assert sub == [exs[i] for i in range(8)]  # directions cycle with period 4
    assert first_n_per_direction(exs, 0) == exs
    assert len(first_n_per_direction(exs, 100)) == len(exs)


def test_validator_scores_every_line_like_evaluate_and_ranks_combine_to_the_same():
    exs = _examples()
    model = _model()
    val = BleuValidator(exs, VOCAB, beam=1, max_len_a=0.5, max_len_b=8, batch_tokens=300, groups={"cjk": ["ja"]})
    one = val.run(model)
    # the reference computation: decode everything, score with the metrics module
    res = translate_examples(model, exs, VOCAB, batch_tokens=300, beam=1, max_len_a=0.5, max_len_b=8)
    L = VOCAB.langs
    rep = M.score_directions(
        [M.Record(L[e.src_lang], L[e.tgt_lang], h, e.tgt.decode(), inv) for e, h, inv in zip(exs, res.texts, res.invalid)],
        groups={"cjk": ["ja"]},
    )
    assert one.lines == one.local_lines == 17 and one.hypotheses == res.texts
    assert one.metrics == M.report_to_metrics(rep, "valid")
    assert "valid/chrf_avg/cjk" in one.metrics and "valid/bleu/en-ja" in one.metrics
    assert one.report.direction("en", "de").n_lines == 5  # lines with an empty reference are scored too

    # three "ranks" decode disjoint interleaved shares; gathering them gives exactly the single-rank result
    class Captured(Exception):
        pass

    parts = {}

    def capture(r):
        def gather(mine):
            parts[r] = mine
            raise Captured  # stop after this rank's share was decoded
        return gather

    for r in (1, 2):
        with pytest.raises(Captured):
            val.run(model, rank=r, world_size=3, gather=capture(r))
    got = val.run(model, rank=0, world_size=3, gather=lambda mine: [mine, parts[1], parts[2]])
    assert got.local_lines == 6 and [len(parts[1]), len(parts[2])] == [6, 5]
    assert got.hypotheses == one.hypotheses and got.metrics == one.metrics
    # a share that went missing is an error, not a silently smaller subset
    with pytest.raises(ScaletrainError, match="decoded by no rank"):
        val.run(model, rank=0, world_size=3, gather=lambda mine: [mine, parts[1]])


def test_validator_for_run_reads_the_fixed_subset(django_shards):
    from scaletrain.config import load_config
    from scaletrain.data.shards import load_manifest, read_split

    cfg = load_config("small", [f"data.shards={django_shards}"])
    vocab = ByteVocab(load_manifest(django_shards).languages)
    val = BleuValidator.for_run(cfg, vocab, n_per_direction=3)
    assert val.examples == first_n_per_direction(read_split(django_shards, "valid"), 3)
    assert len(val.examples) == 30 and val.decode_kw["beam"] == 1 and "latin" in val.groups


class _Babbler(LogitsOnly):
    """Writes 'b' and never EOS: only the length bounds end its lines."""

    max_positions = 1024

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def decode_step(self, tokens, step, enc, cache):
        logits = torch.full((tokens.shape[0], self.vocab_size), -10.0)
        logits[:, BYTE_OFFSET + ord("b")] = 5.0
        return logits, None


def test_validator_for_run_decodes_within_the_bounds_evaluate_uses(django_shards):
    """In-training BLEU and ``evaluate`` decode with one set of bounds (``decoding_bounds``): a model that never
    ends stops at the limit from training's length ratio, not at max_len_a * src + max_len_b."""
    from scaletrain.config import load_config
    from scaletrain.data.shards import load_manifest
    from scaletrain.eval.bounds import RATIO_EXTRA, RATIO_SLACK, decoding_bounds, train_length_ratios

    cfg = load_config("small", [f"data.shards={django_shards}"])
    vocab = ByteVocab(load_manifest(django_shards).languages)
    val = BleuValidator.for_run(cfg, vocab, n_per_direction=2)
    res = val.run(_Babbler(vocab.size))
    ratios = train_length_ratios(load_manifest(django_shards))
    recipe = [int(cfg.eval.max_len_a * len(e.src) + cfg.eval.max_len_b) for e in val.examples]
    want = [min(math.ceil(RATIO_SLACK * ratios[(e.src_lang, e.tgt_lang)] * len(e.src) + RATIO_EXTRA), r)
            for e, r in zip(val.examples, recipe)]
    assert [len(h) for h in res.hypotheses] == want
    assert sum(w < r for w, r in zip(want, recipe)) > len(want) // 2  # mostly below the recipe's own limit
    bounds = decoding_bounds(cfg.eval, django_shards)
    assert {k: val.decode_kw.get(k) for k in bounds} == bounds and bounds["stop_invalid_utf8"] and bounds["length_ratios"]
    ref = translate_examples(_Babbler(vocab.size), val.examples, vocab, batch_tokens=cfg.eval.batch_tokens, beam=1,
                             lenpen=cfg.eval.lenpen, **bounds)  # what evaluate decodes
    assert ref.texts == res.hypotheses and ref.n_at_limit == len(want)


def test_best_checkpoint_max_min_patience_nan():
    b = BestCheckpoint(None, "valid/chrf_avg/all", mode="max", patience=2, min_delta=0.5)
    seq = [10.0, 12.0, 12.3, math.nan, 13.0, 12.9, 12.0]
    ds = [b.update(100 * (i + 1), {"valid/chrf_avg/all": v, "other": 0.0}) for i, v in enumerate(seq)]
    assert [d.improved for d in ds] == [True, True, False, False, True, False, False]
    assert [d.bad_evals for d in ds] == [0, 0, 1, 2, 0, 1, 2]
    assert [d.stop for d in ds] == [False, False, False, True, False, False, True]
    assert (ds[-1].best_value, ds[-1].best_step) == (13.0, 500)
    m = BestCheckpoint(None, "valid/nll", mode="min", patience=0)
    assert [m.update(i, {"valid/nll": v}).improved for i, v in enumerate([3.0, 2.5, 2.6, 1.0])] == [True, True, False, True]
    assert not any(m.update(9, {"valid/nll": 9.0}).stop for _ in range(5))  # patience 0: never stops
    with pytest.raises(ScaletrainError, match="valid/bleu_avg/all.*choose one of: valid/nll"):
        BestCheckpoint(None, "valid/bleu_avg/all").update(1, {"valid/nll": 1.0})
    with pytest.raises(ScaletrainError, match="mode"):
        BestCheckpoint(None, "x", mode="up")


def test_best_checkpoint_resume_state():
    a = BestCheckpoint(None, "m", mode="max", patience=3)
    for i, v in enumerate([1.0, 3.0, 2.0]):
        a.update(i, {"m": v})
    st = json.loads(json.dumps(a.state_dict()))  # goes through the JSON trainer state
    b = BestCheckpoint(None, "m", mode="max", patience=3)
    b.load_state_dict(st)
    assert (b.best_value, b.best_step, b.bad_evals) == (3.0, 1, 1)
    assert b.update(3, {"m": 2.5}).bad_evals == 2 and b.update(4, {"m": 2.5}).stop
    with pytest.raises(ScaletrainError, match="start a new out_dir"):
        BestCheckpoint(None, "other").load_state_dict(st)


def _fake_ckpt(d, step):
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    (d / "mp_rank_00_model_states.pt").write_bytes(os.urandom(1000))
    (d / "config.yaml").write_text("name: x\n")


def test_best_checkpoint_keep_links_survives_rotation_and_replaces(tmp_path):
    root = tmp_path / "checkpoints"
    b = BestCheckpoint(root, "m")
    _fake_ckpt(root / "step-0000100", 100)
    b.update(100, {"m": 1.0})
    best = b.keep(root / "step-0000100")
    assert best == root / "best"
    w = (root / "step-0000100" / "mp_rank_00_model_states.pt").read_bytes()
    assert (best / "mp_rank_00_model_states.pt").read_bytes() == w
    assert os.stat(best / "mp_rank_00_model_states.pt").st_ino == os.stat(root / "step-0000100" / "mp_rank_00_model_states.pt").st_ino
    assert json.loads((best / "best.json").read_text()) == {"metric": "m", "mode": "max", "value": 1.0, "step": 100,
                                                            "source": "step-0000100"}
    import shutil

    shutil.rmtree(root / "step-0000100")  # keep_last rotation deletes the original
    assert (best / "mp_rank_00_model_states.pt").read_bytes() == w
    _fake_ckpt(root / "step-0000200", 200)
    b.update(200, {"m": 2.0})
    b.keep(root / "step-0000200")
    assert json.loads((best / "trainer_state.json").read_text()) == {"step": 200}
    assert sorted(p.name for p in root.iterdir()) == ["best", "step-0000200"]  # no temp dirs left
    with pytest.raises(ScaletrainError, match="not a complete checkpoint"):
        b.keep(tmp_path / "nothing")
