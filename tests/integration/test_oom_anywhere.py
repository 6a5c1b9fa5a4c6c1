"""Out of memory anywhere is one line (``scaletrain.oom``), in this process through the CLI on the real engine
(world of one): a ``torch.OutOfMemoryError`` injected in the optimizer step (AdamW), a validation forward,
in-training BLEU's decoder step, a checkpoint write, ``evaluate``'s and ``translate``'s decoding and
``export``'s writing comes out as exactly one ``scaletrain: error:`` line naming the stage, the batch and the
setting to lower, exit 71, with nothing written after it (every file of the run directory hashed at the
moment of the failure and again after the command). Under ``train.on_oom=skip`` a validation batch is left out
and counted (``valid/oom_batches``), the loss taken over the batches that ran. The micro-batch forward is
``test_oom_step.py``."""
from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.oom import OOM_EXIT
from test_nonfinite import TINY

pytestmark = pytest.mark.usefixtures("in_process_training", "isolated_env")  # trains in this process

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB (injected)"


def files(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (an empty dict if it does not exist)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def one_line(capsys, rc: int) -> str:
    """The command's single error line (asserting there is exactly one and no traceback) and its exit code."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("scaletrain: error:")]
    assert rc == OOM_EXIT and len(lines) == 1 and "Traceback" not in err, (rc, err[-3000:])
    return lines[0]


def with_trainer(monkeypatch, inject):
    """``scaletrain train`` builds its Trainer through this; ``inject(trainer)`` plants the fault."""
    import scaletrain.train.trainer as tm

    real = tm.Trainer

    def trainer(cfg):
        t = real(cfg)
        inject(t)
        return t

    monkeypatch.setattr(tm, "Trainer", trainer)


def train(shards, out, *over) -> int:
    return main(["train", "--config", "small", *TINY, f"data.shards={shards}", f"train.out_dir={out}", *over])


def test_optimizer_step_stops_even_under_skip_and_the_run_fails_with_the_line(django_shards, tmp_path, monkeypatch,
                                                                              capsys):
    seen, closed = {}, []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **kw):  # the update that allocates (Adam's moments at the first one)
        seen["n"] = seen.get("n", 0) + 1
        if seen["n"] == 3:
            seen["files"] = files(tmp_path / "checkpoints")
            raise torch.OutOfMemoryError(OOM)
        return real_step(self, *a, **kw)

    def inject(t):  # how the job's record ends (the recorder's tag: test_oom_lines.py)
        real_close = t.close
        monkeypatch.setattr(t, "close", lambda *a: (closed.append(a), real_close(*a))[1])

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with_trainer(monkeypatch, inject)
    rc = train(django_shards, tmp_path, "train.max_steps=5", "train.on_oom=skip")
    line = one_line(capsys, rc)
    assert "out of memory in the optimizer step" in line and "data.max_tokens=600" in line, line
    assert "engine.ds_config=zero1.json" in line and "train.on_oom=skip cannot skip" in line, line
    assert "[host: this process holds" in line and "GiB RAM]" in line, line  # CPU: the process's memory
    ck = tmp_path / "checkpoints"
    assert f"the last checkpoint, {ck / 'step-0000002'}, is intact and the newest" in line, line
    assert files(ck) == seen["files"] and (ck / "latest").read_text().strip() == "step-0000002"
    assert closed == [("FAILED", line.removeprefix("scaletrain: error: "))]


def _fail_forward(monkeypatch, t, when):
    """The model runs out of memory in a forward for which ``when(trainer, grad_enabled)`` is true."""
    model, real = t.engine.module, t.engine.module.forward

    def forward(*a, **kw):
        if when(t, torch.is_grad_enabled()):
            raise torch.OutOfMemoryError(OOM)
        return real(*a, **kw)

    monkeypatch.setattr(model, "forward", forward)


def test_validation_stops_naming_the_batch(django_shards, tmp_path, monkeypatch, capsys):
    seen = {"calls": 0}

    def when(t, grad):  # the second batch of the validation at step 2 (after the one at step 0)
        if grad or t.state.step != 2:
            return False
        seen["calls"] += 1
        if seen["calls"] == 2:
            seen["files"] = files(tmp_path / "checkpoints")
            return True
        return False

    with_trainer(monkeypatch, lambda t: _fail_forward(monkeypatch, t, when))
    rc = train(django_shards, tmp_path, "train.max_steps=4", "train.valid_every=2", "train.valid_max_batches=3")
    line = one_line(capsys, rc)
    assert "out of memory in validation at step 2, batch 2, a batch of " in line and "data.max_tokens=600" in line
    assert "lower data.max_tokens" in line and "train.on_oom=skip" in line, line
    ck = tmp_path / "checkpoints"
    assert files(ck) == seen["files"] and (ck / "latest").read_text().strip() == "step-0000001", line


def test_validation_under_skip_leaves_the_batch_out_and_counts_it(django_shards, tmp_path, monkeypatch, caplog):
    from scaletrain.data.loader import ShardLoader
    from scaletrain.train import Trainer
    from scaletrain.train.unit import validation

    t = Trainer(load_config("small", [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp_path}",
                                      "train.on_oom=skip", "train.valid_max_batches=3"]))
    it = iter(ShardLoader.for_run(t.cfg.data, "valid", vocab=t.vocab))
    b1, _, b3 = next(it), next(it), next(it)
    expected = validation(t.engine, t.unit, [b1, b3], 3).nll  # the batches that run
    logged = []

    class Metrics:  # the evaluator's tracker, keeping what it is given
        def log_metrics(self, m, step):
            logged.append(dict(m))

    t.evaluator.tracker = Metrics()
    calls, fail = [0], {2}  # forward calls that run out of memory

    def when(_, grad):
        calls[0] += 1
        return calls[0] in fail

    _fail_forward(monkeypatch, t, when)
    with caplog.at_level(logging.WARNING, logger="scaletrain"):
        v = t.evaluator.validation_loss()
    assert calls[0] == 3 and v == pytest.approx(expected, rel=1e-6) and t.state.valid_history[-1] == (0, v)
    assert logged[-1]["valid/oom_batches"] == 1.0 and logged[-1]["valid/nll"] == v
    assert any("1 validation batch(es) ran out of memory and were left out" in r.getMessage()
               and "over the 2 that ran" in r.getMessage() for r in caplog.records)
    calls[0], fail = 0, {1}
    t.evaluator.valid_max_batches = 1  # every batch fails: no loss to report, NaN (never a best)
    assert math.isnan(t.evaluator.validation_loss()) and logged[-1]["valid/oom_batches"] == 1.0
    t.close()


def test_in_training_bleu_decoding_names_eval_batch_tokens(django_shards, tmp_path, monkeypatch, capsys):
    from scaletrain.models.transformer import Transformer

    seen = {}

    def decode_step(self, *a, **kw):
        seen.setdefault("files", files(tmp_path / "checkpoints"))
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(Transformer, "decode_step", decode_step)
    rc = train(django_shards, tmp_path, "train.max_steps=3", "train.bleu_every=2", "eval.valid_lines=1",
               "eval.batch_tokens=700")
    line = one_line(capsys, rc)
    assert "out of memory in in-training BLEU decoding, a batch of " in line and "eval.batch_tokens=700" in line
    assert "lower eval.batch_tokens" in line and "step-0000001, is intact" in line, line
    ck = tmp_path / "checkpoints"
    assert files(ck) == seen["files"] and (ck / "latest").read_text().strip() == "step-0000001"


def test_checkpoint_write_removes_the_partial_and_keeps_latest(django_shards, tmp_path, monkeypatch, capsys):
    seen = {}

    def inject(t):
        real = t.engine.save_native  # DeepSpeed's files (the default engine), into step-N.partial
        assert t.engine.native_checkpoint

        def save_native(path):
            if path.name.startswith("step-0000002"):
                seen["files"] = files(tmp_path / "checkpoints")
                path.mkdir(parents=True, exist_ok=True)
                (path / "half-written.pt").write_bytes(b"\0" * 100)
                raise torch.OutOfMemoryError(OOM)
            return real(path)

        monkeypatch.setattr(t.engine, "save_native", save_native)

    with_trainer(monkeypatch, inject)
    rc = train(django_shards, tmp_path, "train.max_steps=3")
    line = one_line(capsys, rc)
    ck = tmp_path / "checkpoints"
    assert "out of memory in writing checkpoint step-0000002" in line and "train.on_save_error=continue" in line
    assert f"the previous checkpoint {ck / 'step-0000001'} is intact" in line, line
    assert files(ck) == seen["files"] and (ck / "latest").read_text().strip() == "step-0000001"


def test_an_oom_no_stage_names_in_training_names_the_step_and_the_checkpoint(django_shards, tmp_path, monkeypatch,
                                                                             capsys):
    from scaletrain.train.prefetch import Prefetcher

    real, seen = Prefetcher.take, {"n": 0}

    def take(self):  # the step's batches moving to the device
        seen["n"] += 1
        if seen["n"] == 3:
            seen["files"] = files(tmp_path / "checkpoints")
            raise torch.OutOfMemoryError(OOM + "\nOf the allocated memory 77.1 GiB is allocated by PyTorch")
        return real(self)

    monkeypatch.setattr(Prefetcher, "take", take)
    line = one_line(capsys, train(django_shards, tmp_path, "train.max_steps=4"))
    ck = tmp_path / "checkpoints"
    assert line.startswith("scaletrain: error: out of memory in training step 3, OutOfMemoryError: CUDA out of memory: "
                           f"lower data.max_tokens; the last checkpoint, {ck / 'step-0000002'}, is intact"), line
    assert files(ck) == seen["files"]


@pytest.fixture(scope="module")
def tiny_ckpt(django_shards, tmp_path_factory):
    """A run directory with the checkpoint of one update of the tiny model (trained in this process)."""
    import os

    from scaletrain.train import train as run_training

    saved = dict(os.environ)
    out = tmp_path_factory.mktemp("oom_run")
    run_training(load_config("small", [*TINY, f"data.shards={django_shards}", f"train.out_dir={out}",
                                       "train.max_steps=1", "eval.max_len_b=8", "eval.max_len_a=0.5"]))
    os.environ.clear()
    os.environ.update(saved)
    return out


def test_evaluate_names_the_batch_and_batch_tokens_and_writes_no_record(tiny_ckpt, monkeypatch, capsys):
    from scaletrain.models.transformer import Transformer

    def decode_step(self, *a, **kw):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(Transformer, "decode_step", decode_step)
    before = files(tiny_ckpt)
    rc = main(["evaluate", "--checkpoint", str(tiny_ckpt), "--max-lines", "1", "--no-track", "--threads", "1",
               "--batch-tokens", "300"])
    line = one_line(capsys, rc)
    assert "out of memory in evaluate, decoding the test split on cpu, a batch of " in line, line
    assert "--batch-tokens=300" in line and "lower --batch-tokens" in line, line
    assert files(tiny_ckpt) == before and not (tiny_ckpt / "eval").exists()


def test_translate_names_the_batch_and_what_stdout_already_holds(tiny_ckpt, monkeypatch, capsys):
    import scaletrain.eval.generate as gen  # what translate_examples calls (eval/requests.py)

    real, calls = gen.generate_with_scores, [0]

    def generate_with_scores(*a, **kw):
        calls[0] += 1
        if calls[0] == 2:
            raise torch.OutOfMemoryError(OOM)
        return real(*a, **kw)

    monkeypatch.setattr(gen, "generate_with_scores", generate_with_scores)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Save changes\nDelete the file\nNext\n"))
    langs = json.loads(next(tiny_ckpt.glob("checkpoints/step-*/langs.json")).read_text())
    rc = main(["translate", "--checkpoint", str(tiny_ckpt), "--src-lang", langs[0], "--tgt-lang", langs[1],
               "--batch-lines", "1", "--batch-tokens", "500", "--threads", "1"])
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.startswith("scaletrain: error:")]
    assert rc == OOM_EXIT and len(lines) == 1 and "Traceback" not in out.err, out.err
    assert "out of memory in translate, a batch of 1 lines x beam" in lines[0] and "--batch-tokens=500" in lines[0]
    assert "stdout holds the translations of the first 1 input lines only (the batch of lines 2-2 failed)" in lines[0]
    assert len(out.out.splitlines()) == 1


def test_export_leaves_out_as_it_was(tiny_ckpt, tmp_path, monkeypatch, capsys):
    import safetensors.torch as st  # what scaletrain.checkpoint.engine_state.save_safetensors calls

    def save_file(tensors, path, metadata=None):  # half the bytes, then the allocation fails
        Path(path).write_bytes(b"\0" * 64)
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(st, "save_file", save_file)
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"an earlier export")
    rc = main(["export", str(tiny_ckpt), "--out", str(out)])
    line = one_line(capsys, rc)
    assert "out of memory in export --format safetensors, consolidating checkpoint" in line, line
    assert f"{out} is as it was" in line and "[host: this process holds" in line, line
    assert out.read_bytes() == b"an earlier export" and sorted(p.name for p in tmp_path.iterdir()) == [out.name]
