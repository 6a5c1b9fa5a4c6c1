"""Variants without a Hugging Face architecture: `scaletrain export --out model.safetensors` carries
config, languages and (subword) the SentencePiece model, and `translate` / `evaluate` load that file
directly, with no training checkpoint left: the same translations of real lines as from the
checkpoint."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, launcher_env, tiny_model
from scaletrain.checkpoint import load_for_inference, save_vocab_files
from scaletrain.config import dump_yaml, load_config
from scaletrain.data.batch import collate
from scaletrain.data.shards import load_manifest, read_split
from scaletrain.data.spm_models import load_shard_vocab
from scaletrain.prepare import add_spm_model
from scaletrain.models import build_model
from scaletrain.vocab import ByteVocab

TINY = [*tiny_model(n_heads=4, layers=2, max_positions=160), "data.max_bytes=120",
        "eval.max_len_a=0.0", "eval.max_len_b=12", "eval.beam=2"]


def save_checkpoint(path, cfg, model, langs, vocab=None):
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.yaml").write_text(dump_yaml(cfg))
    (path / "langs.json").write_text(json.dumps(langs))
    (path / "trainer_state.json").write_text(json.dumps({"step": 7}))
    save_vocab_files(vocab, path)


def cli(tmp_path, *args, stdin=None):
    env = launcher_env(tmp_path)
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], cwd=ROOT, env=env, input=stdin,
                          capture_output=True, timeout=300)


def test_msc_export_translates_without_checkpoint(django_shards, tmp_path):
    torch.manual_seed(0)
    cfg = load_config("msc", [*TINY, "model.conv.kernels=[0,1,3,5]", f"data.shards={django_shards}"])
    langs = load_manifest(django_shards).languages
    model = build_model(cfg.model, ByteVocab(langs).size)
    ck = tmp_path / "run" / "step-0000007"
    save_checkpoint(ck, cfg, model, langs)
    lines = b"".join(e.src + b"\n" for e in read_split(django_shards, "test") if e.src_lang == langs.index("de"))
    want = cli(tmp_path, "translate", "--checkpoint", str(ck), "--src-lang", "de", "--tgt-lang", "en", "--quiet",
               stdin=lines)
    assert want.returncode == 0, want.stderr.decode()[-2000:]
    out = tmp_path / "export" / "msc.safetensors"
    p = cli(tmp_path, "export", str(ck), "--out", str(out), "--dtype", "fp32")
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    shutil.rmtree(tmp_path / "run")  # no training checkpoint left
    got = cli(tmp_path, "translate", "--checkpoint", str(out), "--src-lang", "de", "--tgt-lang", "en", "--quiet",
              stdin=lines)
    assert got.returncode == 0, got.stderr.decode()[-2000:]
    assert got.stdout == want.stdout and got.stdout.count(b"\n") == lines.count(b"\n")
    ev = cli(tmp_path, "evaluate", "--checkpoint", str(out), "--max-lines", "2", "--no-track", "--json",
             str(tmp_path / "ev.json"))
    assert ev.returncode == 0, ev.stderr.decode()[-2000:]
    rep = json.loads((tmp_path / "ev.json").read_text())
    assert rep["step"] == 7 and rep["checkpoint"] == str(out)


def test_subword_export_carries_its_sentencepiece_model(django_shards, tmp_path):
    d = tmp_path / "shards"
    shutil.copytree(django_shards, d)
    add_spm_model(d, 600, character_coverage=0.98)
    torch.manual_seed(0)
    cfg = load_config("subword_base", [*TINY, f"data.shards={d}", "data.spm_vocab_size=600"])
    langs = load_manifest(d).languages
    vocab = load_shard_vocab(langs, "spm", d)
    model = build_model(cfg.model, vocab.size, pieces=vocab.pieces()).eval()
    ck = tmp_path / "ck"
    save_checkpoint(ck, cfg, model, langs, vocab)
    out = tmp_path / "export" / "sub.safetensors"
    p = cli(tmp_path, "export", str(ck), "--out", str(out))
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    shutil.rmtree(ck)
    m2, cfg2, vocab2, state, path = load_for_inference(out)
    assert vocab2.kind == "spm" and vocab2.sha256 == vocab.sha256 and state["step"] == 7
    exs = read_split(d, "test")[:16]
    ids = [vocab.encode(e.src.decode()) for e in exs]
    assert [vocab2.encode(e.src.decode()) for e in exs] == ids
    b = collate(exs)  # byte ids are fine for a logits comparison: both models see the same tensors
    src = b.src.clamp(max=vocab.size - 1)
    with torch.no_grad():
        torch.testing.assert_close(m2(src, b.tgt_in.clamp(max=vocab.size - 1)), model(src, b.tgt_in.clamp(max=vocab.size - 1)))
    # the tokenizer file is checked: a changed SentencePiece model is refused
    spm = next(out.parent.glob("sub.*.model"))
    raw = spm.read_bytes()
    spm.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(Exception, match="sha256|SentencePiece|spm"):
        load_for_inference(out)
