"""The subword baseline and the character-aware (CG) decoder end to end on the bundled corpus.

A SentencePiece BPE model is added to a copy of the real shards; `subword_base` and `subword_cg` (tiny
dimensions) train in the real loop on 1 rank in this process and on 2 ranks under the `deepspeed`
launcher; checkpoints carry the tokenizer; `load_for_inference` rebuilds the same model and vocabulary;
greedy decoding of real validation sentences equals the full forward pass; `evaluate`, `translate` and
`average` work on the subword checkpoint without the shards' tokenizer files.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import ten_step_run, tiny_model, two_rank_training, valid_examples
from scaletrain.eval import generate as G
from scaletrain.eval.decode_step import allowed_mask
from scaletrain.eval.requests import translate_examples
from scaletrain.checkpoint import load_for_inference
from scaletrain.config import load_config
from scaletrain.data.batch import collate_arrays
from scaletrain.prepare import add_spm_model
from scaletrain.vocab import SubwordVocab

N_SPM = 600
COMMON = [
    *tiny_model(n_heads=4, dropout=0.1), f"data.spm_vocab_size={N_SPM}", *ten_step_run(max_bytes=30, max_tokens=1200),
]
CG = ["model.charaware.dim=8", "model.charaware.max_len=12"]  # subword_cg only (embedding charaware)
MAX_OUT = 6


@pytest.fixture(scope="module")
def spm_shards(django_shards, tmp_path_factory):
    d = tmp_path_factory.mktemp("spm_train") / "shards"
    shutil.copytree(django_shards, d)
    add_spm_model(d, N_SPM, character_coverage=0.98)
    return str(d)


pytestmark = pytest.mark.usefixtures("in_process_training")


def subword_batch(vocab, examples):
    flat, n = vocab.encode_flat([ex.src for ex in examples])
    z = np.zeros(len(examples), dtype=np.int64)
    return collate_arrays(np.array([e.src_lang for e in examples]), np.array([e.tgt_lang for e in examples]),
                          flat, np.cumsum(n) - n, n, np.zeros(0, np.int32), z, z, lang_offset=vocab.lang_offset)


def check_decoding(model, vocab, examples):
    """Greedy (incremental) == argmax of the full forward pass; only pieces and EOS come out."""
    batch = subword_batch(vocab, examples)
    tags = batch.tgt_in[:, 0]
    assert all(vocab.lang_offset <= int(t) < vocab.size for t in tags)
    greedy = G.generate(model, batch.src, tags, beam=1, max_len_a=0, max_len_b=MAX_OUT, lang_offset=vocab.lang_offset)
    for i, toks in enumerate(greedy):
        assert len(toks) <= MAX_OUT and all(4 <= t < vocab.lang_offset for t in toks)
        with torch.no_grad():
            lg = model(batch.src[i : i + 1], torch.tensor([[int(tags[i])] + toks]))[0].double()
        lp = torch.log_softmax(lg, -1) + allowed_mask(lg.shape[-1], "cpu", torch.float64, vocab.lang_offset)
        picks = lp.argmax(-1).tolist()
        assert picks[: len(toks)] == toks
        if len(toks) < MAX_OUT:
            assert picks[len(toks)] == 2  # EOS


@pytest.mark.parametrize("recipe", ["subword_base", "subword_cg"])
def test_subword_recipes_train_save_load_decode(recipe, spm_shards, tmp_path, isolated_env):
    from scaletrain.train import Trainer

    out = tmp_path / "run"
    cfg = load_config(recipe, [f"data.shards={spm_shards}", f"train.out_dir={out}",
                               *COMMON, *(CG if recipe == "subword_cg" else [])])
    trainer = Trainer(cfg)
    assert isinstance(trainer.vocab, SubwordVocab) and trainer.vocab.size == N_SPM + len(trainer.vocab.langs)
    res = trainer.fit()
    trainer.close()
    assert res.steps == 10
    first, last = res.train_loss[0][1], res.train_loss[-1][1]
    assert math.isfinite(last) and last < first, res.train_loss
    # the baseline is a subword unigram: about log(V) nats per token at most
    assert 0 < res.unigram_nll < math.log(trainer.vocab.size)
    trained = {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}

    # the checkpoint carries the tokenizer; the model reloads from it alone
    ckpt_dir = out / "checkpoints" / "step-0000010"
    meta = json.loads((ckpt_dir / "vocab.json").read_text())
    assert meta["kind"] == "spm" and (ckpt_dir / meta["file"]).is_file()
    model, cfg2, vocab, state, ckpt = load_for_inference(out)
    assert isinstance(vocab, SubwordVocab) and vocab.sha256 == trainer.vocab.sha256 and vocab.langs == trainer.vocab.langs
    assert cfg2.model == cfg.model and cfg2.model.embedding == ("charaware" if recipe == "subword_cg" else "learned")
    loaded = model.state_dict()
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)
    exs = valid_examples(spm_shards, 5)
    check_decoding(model, vocab, exs)
    # translate_examples tokenizes with the checkpoint's vocabulary and decodes pieces to text
    tr = translate_examples(model, exs, vocab, batch_tokens=2000, beam=2, max_len_a=0, max_len_b=MAX_OUT)
    assert len(tr.texts) == len(exs) and all(isinstance(t, str) for t in tr.texts)
    assert tr.texts == [vocab.decode(t) for t in tr.tokens]

    # the tokenizer file in the checkpoint is checked: a record that does not match the file ...
    (ckpt_dir / "vocab.json").write_text(json.dumps({**meta, "sha256": "0" * 64}))
    with pytest.raises(Exception, match="sha256"):
        load_for_inference(out)
    (ckpt_dir / "vocab.json").write_text(json.dumps(meta))
    # ... and a file that is not a SentencePiece model
    (ckpt_dir / meta["file"]).write_bytes(b"not a sentencepiece model")
    with pytest.raises(Exception, match="sha256|SentencePiece|sentencepiece"):
        load_for_inference(out)


def test_subword_checkpoint_through_evaluate_translate_and_average(spm_shards, tmp_path, isolated_env):
    from scaletrain.train import Trainer

    out = tmp_path / "run"
    cfg = load_config("subword_cg", [f"data.shards={spm_shards}", f"train.out_dir={out}", *COMMON, *CG,
                                     "train.save_every=5", "train.keep_last=3"])
    trainer = Trainer(cfg)
    trainer.fit()
    trainer.close()
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "scaletrain"]
    avg = tmp_path / "avg"
    steps = sorted(str(p) for p in (out / "checkpoints").glob("step-*"))
    r = subprocess.run(cmd + ["average", *steps, "--out", str(avg)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert (avg / "vocab.json").is_file()
    _, _, vocab, _, _ = load_for_inference(avg)
    assert isinstance(vocab, SubwordVocab)
    r = subprocess.run(cmd + ["evaluate", "--checkpoint", str(avg), "--split", "test", "--max-lines", "3",
                              "--beam", "1", "--json", str(tmp_path / "ev.json")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    ev = json.loads((tmp_path / "ev.json").read_text())
    dirs = ev["model"]["directions"]
    assert dirs and all(d["n_lines"] > 0 and d["chrf"] is not None and d["chrf"] >= 0 for d in dirs)
    r = subprocess.run(cmd + ["translate", "--checkpoint", str(avg), "--src-lang", "de", "--tgt-lang", "en",
                              "--beam", "1"], input="Guten Morgen\nDanke\n", capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2


@pytest.mark.slow
def test_subword_cg_two_ranks_deepspeed_launcher(spm_shards, tmp_path):
    out = tmp_path / "run"
    model, cfg, vocab, state = two_rank_training(
        out, "subword_cg", f"data.shards={spm_shards}", f"train.out_dir={out}", *COMMON, *CG, tmp_path=tmp_path)
    assert cfg.model.embedding == "charaware" and state["world_size"] == 2 and isinstance(vocab, SubwordVocab)
    check_decoding(model, vocab, valid_examples(spm_shards, 5))
