"""Resume refusals and warm start (scaletrain.checkpoint.compat, scaletrain.checkpoint.warm_start), in-process
over the real Engine with a minimal backend (tiny model, a 2-step run shared by every test, copied per test).

A resume with another model shape, vocabulary or corpus stops with one line naming each key and both values,
before anything in the run directory changes (a stale partial and preempted.json stay, no MLflow store is
made); the keys that may change resume. ``train.init_from`` loads another run's weights exactly into a fresh
run (step 0, a new optimizer), maps the language tags of another language set by name, refuses another model
with one line, and is ignored by a run that resumes."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from scaletrain.checkpoint import load_model_weights, write_index
from scaletrain.checkpoint.compat import corpus_record, model_differences
from scaletrain.config import load_config
from scaletrain.errors import ScaletrainError
from scaletrain.prepare import prepare_gettext
from test_engine_loop import TINY, SkippingEngine

CKPT = "step-0000002"
pytestmark = pytest.mark.usefixtures("isolated_env")


def _trainer(shards, out, *over):
    from scaletrain.train import Trainer

    cfg = load_config("small", [*TINY, f"data.shards={shards}", f"train.out_dir={out}", "train.resume=true",
                                "train.max_steps=3", *over])
    return Trainer(cfg, engine=SkippingEngine(cfg, skip=()))


def _fit(trainer):
    try:
        return trainer.fit()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def base(django_shards, tmp_path_factory):
    """A 2-step run (checkpoint step-0000002) on the shared corpus."""
    out = tmp_path_factory.mktemp("compat") / "base"
    _fit(_trainer(django_shards, out, "train.max_steps=2"))
    return out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Other corpora: the same languages shuffled otherwise (other shards), and another language set."""
    root = tmp_path_factory.mktemp("corpora")
    prepare_gettext(package="django", langs=["de", "ru", "ar", "hi", "ja"], out=root / "reshuffled", seed=1,
                    progress=False)
    prepare_gettext(package="django", langs=["ja", "de", "fr"], out=root / "langs", progress=False)
    return root


@pytest.fixture
def run(base, tmp_path):
    """A copy of the base run to resume (with a stale partial and preempted.json a refusal must leave)."""
    out = tmp_path / "run"
    shutil.copytree(base, out)
    (out / "checkpoints" / "step-0000003.partial").mkdir()
    (out / "preempted.json").write_text("{}")
    return out


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest()
                                       if p.is_file() else "dir") for p in sorted(root.rglob("*"))}


def _refused(trainer, out: Path, tmp_path: Path) -> str:
    before = _snapshot(out)
    with pytest.raises(ScaletrainError) as e:
        _fit(trainer)
    assert _snapshot(out) == before  # nothing written, removed or touched
    assert not (tmp_path / "mlruns.db").exists()  # no MLflow store made, no run touched
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"cannot resume from {out / 'checkpoints' / CKPT}: ")
    return line


TRACKED = ["tracking.enabled=true"]


@pytest.mark.parametrize("over, says", [
    (["model.d_model=48", "model.ffn_dim=96"],
     ["model.d_model: checkpoint 32, this run 48", "model.ffn_dim: checkpoint 64, this run 96",
      "start a new train.out_dir for this model"]),
    (["moe.num_experts=2", "moe.every=1"],
     ["moe.num_experts: checkpoint 0, this run 2", "moe.every: checkpoint 2, this run 1"]),
    (["optim.betas=[0.8,0.9]"],
     ["optim.betas: checkpoint [0.9, 0.98], this run [0.8, 0.9]", "a new value would be ignored"]),
], ids=["model", "moe", "optimizer"])
def test_resume_refuses_another_model(run, django_shards, tmp_path, over, says):
    line = _refused(_trainer(django_shards, run, *TRACKED, f"tracking.uri=sqlite:///{tmp_path}/mlruns.db", *over),
                    run, tmp_path)
    for s in says:
        assert s in line, line


def test_resume_refuses_another_vocabulary(run, corpora, tmp_path):
    line = _refused(_trainer(corpora / "langs", run, *TRACKED, f"tracking.uri=sqlite:///{tmp_path}/mlruns.db"),
                    run, tmp_path)
    assert "languages (langs.json; their order gives the tag ids): checkpoint en,de,ru,ar,hi,ja, this run " \
           "en,ja,de,fr" in line, line
    assert f"train.init_from={run / 'checkpoints' / CKPT} (its weights, the language tags mapped by name" in line


def test_resume_refuses_another_corpus_unless_allowed(run, corpora, tmp_path, caplog):
    other = corpora / "reshuffled"
    line = _refused(_trainer(other, run, *TRACKED, f"tracking.uri=sqlite:///{tmp_path}/mlruns.db"), run, tmp_path)
    digest = corpus_record(json.loads((other / "manifest.json").read_text()), str(other))["digest"]
    assert f"this run {digest[:12]} ({other})" in line and "train.resume_other_corpus=true" in line, line
    # allowed: the run carries on (step 3 after 2) and the stream starts at the new corpus's beginning
    t = _trainer(other, run, "train.resume_other_corpus=true")
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        res = _fit(t)
    assert res.steps == 3 and t.engine.updates == 1 and "resuming" in caplog.text
    state = json.loads((run / "checkpoints" / "step-0000003" / "trainer_state.json").read_text())
    assert state["corpus"]["digest"] == digest
    stream = torch.load(run / "checkpoints" / "step-0000003" / "rank00000.pt")["stream"]
    saved = torch.load(run / "checkpoints" / CKPT / "rank00000.pt")["stream"]
    assert (saved["epoch"], saved["window"], saved["batch"]) == (0, 0, 2)  # where the old corpus was
    assert (stream["epoch"], stream["window"], stream["batch"]) == (0, 0, 1)  # one batch of the new one


def test_allowed_changes_resume(run, django_shards, caplog):
    t = _trainer(django_shards, run, "train.max_steps=4", "train.log_every=1", "model.dropout=0.2",
                 "model.kernels=torch", "optim.lr=1e-3", "optim.warmup_steps=2", "data.num_workers=0",
                 "moe.aux_loss_coef=0.5", "train.keep_last=5")
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        res = _fit(t)
    assert f"resumed from {run / 'checkpoints' / CKPT} at step 2" in caplog.text
    assert res.steps == 4 and t.engine.updates == 2
    assert "not checked" not in caplog.text  # the base run recorded its corpus


def test_checkpoint_without_corpus_record_resumes_unchecked(run, django_shards, caplog):
    ckpt = run / "checkpoints" / CKPT
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["corpus"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_index(ckpt)  # as a checkpoint of an earlier version was written
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        assert _fit(_trainer(django_shards, run)).steps == 3
    assert "records no corpus identity" in caplog.text and "the corpus is not checked" in caplog.text


# ---- warm start ------------------------------------------------------------------------------------
def test_warm_start_loads_the_weights_exactly(base, django_shards, tmp_path, caplog):
    out = tmp_path / "warm"
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        t = _trainer(django_shards, out, f"train.init_from={base}", "train.max_steps=1")
    want = load_model_weights(base / "checkpoints" / CKPT)
    got = t.engine.module.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert t.state.step == 0 and not t.engine.optimizer.state  # a fresh run: no update, no moments
    assert f"warm start from {base / 'checkpoints' / CKPT} (step 2" in caplog.text
    res = _fit(t)
    assert res.steps == 1 and t.engine.updates == 1
    ck = out / "checkpoints" / "step-0000001"
    assert json.loads((ck / "engine.json").read_text())["schedule"] == {"applied": 1}  # the schedule from 0
    record = json.loads((ck / "trainer_state.json").read_text())["init_from"]
    assert record == {"checkpoint": str((base / "checkpoints" / CKPT).resolve()), "step": 2}
    assert torch.load(ck / "rank00000.pt")["stream"]["batch"] == 1  # the data from the start


def test_warm_start_maps_language_tags_by_name(base, corpora, tmp_path, caplog):
    from scaletrain.vocab import LANG_OFFSET

    with caplog.at_level(logging.INFO, logger="scaletrain"):
        warm = _trainer(corpora / "langs", tmp_path / "warm", f"train.init_from={base}")
    fresh = _trainer(corpora / "langs", tmp_path / "fresh")  # the same seed: the initialisation warm started from
    src = load_model_weights(base / "checkpoints" / CKPT)["embeddings.weight"]
    w = warm.engine.module.state_dict()["embeddings.weight"]
    f = fresh.engine.module.state_dict()["embeddings.weight"]
    old = ["en", "de", "ru", "ar", "hi", "ja"]
    assert w.shape[0] == LANG_OFFSET + 4 and src.shape[0] == LANG_OFFSET + 6
    assert torch.equal(w[:LANG_OFFSET], src[:LANG_OFFSET])  # specials and bytes
    for j, code in enumerate(["en", "ja", "de"]):  # by name: ja was id 265, is 261 now
        assert torch.equal(w[LANG_OFFSET + j], src[LANG_OFFSET + old.index(code)]), code
    assert torch.equal(w[LANG_OFFSET + 3], f[LANG_OFFSET + 3]) and not torch.equal(w[LANG_OFFSET + 3], src[-1])  # fr
    assert "tags of en, ja, de copied by name, fr freshly initialised, ru, ar, hi left out" in caplog.text
    for t in (warm, fresh):
        t.close()


@pytest.mark.parametrize("over, says", [
    (["model.d_model=48"], "model.d_model: checkpoint 32, this run 48"),
    (["model.share_embeddings=false"], "model.share_embeddings: checkpoint true, this run false"),
], ids=["d_model", "embeddings"])
def test_warm_start_refuses_another_model(base, django_shards, tmp_path, over, says):
    out = tmp_path / "warm"
    with pytest.raises(ScaletrainError) as e:
        _trainer(django_shards, out, f"train.init_from={base}", *over)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"cannot warm-start from {base / 'checkpoints' / CKPT} "
                                                "(train.init_from): ") and says in line, line
    assert not out.exists()


def test_warm_start_names_parameters_whose_shapes_differ(base, django_shards, tmp_path):
    """What the config comparison cannot see (a weight file of another shape) is named by parameter."""
    from scaletrain.checkpoint.warm_start import load_exactly

    t = _trainer(django_shards, tmp_path / "x")
    sd = load_model_weights(base / "checkpoints" / CKPT)
    sd["encoder_layers.0.ffn.fc1.weight"] = torch.zeros(65, 32)
    with pytest.raises(ScaletrainError, match=r"encoder_layers\.0\.ffn\.fc1\.weight: checkpoint \[65, 32\], this "
                                              r"run \[64, 32\]"):
        load_exactly(t.engine.module, sd, Path("CKPT"))
    t.close()


def test_a_resumed_run_ignores_init_from(run, django_shards, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        res = _fit(_trainer(django_shards, run, f"train.init_from={tmp_path / 'nowhere'}"))
    assert res.steps == 3 and "train.init_from=" in caplog.text and "ignored" in caplog.text


def test_model_differences_skip_regularisation_and_layout_keys():
    a = {"model": {"d_model": 32, "dropout": 0.1, "moce": {"dispatch": "auto"}},
         "moe": {"num_experts": 4, "ep_size": 1, "capacity_factor": 0.0}}
    b = {"model": {"d_model": 32, "dropout": 0.3, "moce": {"dispatch": "dense"}},
         "moe": {"num_experts": 4, "ep_size": 2, "capacity_factor": 1.0}}
    assert model_differences(a, b) == []
    b["moe"]["num_experts"] = 8
    assert model_differences(a, b) == [("moe.num_experts", 4, 8)]


def test_corpus_identity_is_the_shards_not_the_manifest_bytes(django_shards):
    m = json.loads((django_shards / "manifest.json").read_text())
    rec = corpus_record(m, "a")
    m2 = {**m, "tokenizers": [{"type": "spm"}], "scaletrain_version": "0"}  # a tokenizer added later
    assert corpus_record(m2, "b")["digest"] == rec["digest"]
    m3 = json.loads(json.dumps(m))
    m3["splits"]["train"]["shards"][0]["sha256"] = "0" * 64
    assert corpus_record(m3, "a")["digest"] != rec["digest"]


def test_cli_refusal_is_one_line_and_exit_2(run, django_shards, tmp_path):
    """``scaletrain train`` as a user runs it: exit 2, one line, the run directory and MLflow untouched."""
    from helpers import cli

    before = _snapshot(run)
    p = cli("train", "--config", "small", *TINY, f"data.shards={django_shards}", f"train.out_dir={run}",
            "engine.backend=accelerate", "engine.accelerate=ddp", "model.d_model=48", "tracking.enabled=true",
            f"tracking.uri=sqlite:///{tmp_path}/mlruns.db")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"scaletrain: error: cannot resume from {run / 'checkpoints' / CKPT}: model.d_model: "
                               "checkpoint 32, this run 48; ")
    assert _snapshot(run) == before and not (tmp_path / "mlruns.db").exists()


@pytest.mark.usefixtures("in_process_training")
def test_warm_start_into_deepspeed_zero3(base, django_shards, tmp_path):
    """The weights are loaded before the engine wraps the model: ZeRO-3 partitions the loaded values."""
    from scaletrain.train import Trainer

    cfg = load_config("small", [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp_path / 'w'}",
                                f"train.init_from={base}", "engine.backend=deepspeed", "engine.ds_config=zero3.json",
                                "engine.precision=fp32"])
    t = Trainer(cfg)
    try:
        assert t.engine.zero_stage == 3
        got, want = t.engine.full_state_dict(), load_model_weights(base / "checkpoints" / CKPT)
        assert got.keys() == want.keys() and all(torch.equal(got[k].float(), want[k]) for k in want)
    finally:
        t.close()


def test_tokenizer_refusals_and_a_tokenizer_added_to_the_corpus(run, django_shards, tmp_path):
    """Another tokenizer or SentencePiece model is refused on resume and at a warm start; SentencePiece models
    added to the same shards later change manifest.json but not the corpus: a byte run resumes there."""
    from scaletrain.prepare import add_spm_model

    shards = tmp_path / "dj"
    shutil.copytree(django_shards, shards)
    for n in (600, 640):
        add_spm_model(shards, n, character_coverage=0.98)
    spm = [f"data.shards={shards}", "data.tokenizer=spm"]
    line = _refused(_trainer(shards, run, *spm[1:], "data.spm_vocab_size=600"), run, tmp_path)
    assert "data.tokenizer: checkpoint byte, this run spm" in line and "corpus" not in line, line
    sub = tmp_path / "sub"
    _fit(_trainer(shards, sub, *spm[1:], "data.spm_vocab_size=600", "train.max_steps=2"))
    ck = sub / "checkpoints" / CKPT
    line = _refused(_trainer(shards, sub, *spm[1:], "data.spm_vocab_size=640"), sub, tmp_path)
    assert "vocabulary size before the language tags (the SentencePiece model's): checkpoint 600, this run 640" \
           in line and "SentencePiece model sha256 (vocab.json): checkpoint " in line, line
    with pytest.raises(ScaletrainError, match=r"cannot warm-start from .*: vocabulary size before the language tags"):
        _trainer(shards, tmp_path / "w", *spm[1:], "data.spm_vocab_size=640", f"train.init_from={ck}")
    assert _fit(_trainer(shards, run)).steps == 3  # the byte run on its shards with models added: same corpus
