"""The engine's part of a checkpoint (``scaletrain/checkpoint/engine_state.py``), with the real engine over a
one-process backend: ``engine.json`` records the layout and the LR schedule's position, the state dicts come
back exactly, a checkpoint Accelerate's ``save_state`` wrote (before ``engine.json``) resumes with its
schedule position, DeepSpeed's ``lr_scheduler`` entry is read where that is all there is, and another
library's checkpoint or one without a schedule position is refused in one line."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from helpers import engine_holding
from scaletrain.checkpoint import load_engine_state, save_engine_state
from scaletrain.checkpoint.engine_state import saved_schedule
from scaletrain.errors import ScaletrainError


def _trained(seed: int = 0, updates: int = 3):
    torch.manual_seed(seed)
    eng = engine_holding(torch.nn.Linear(4, 3))
    for _ in range(updates):
        eng.backward(eng.module(torch.randn(5, 4)).pow(2).sum())
        eng.step()
    return eng


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.module.state_dict().values(), b.module.state_dict().values()))


def test_engine_json_records_the_layout_and_the_state_comes_back(tmp_path):
    eng = _trained()
    save_engine_state(eng, tmp_path / "ck")
    record = json.loads((tmp_path / "ck" / "engine.json").read_text())
    assert record == {"format": 1, "backend": "local", "zero_stage": 0, "world_size": 1, "ep_size": 1,
                      "precision": eng.cfg.engine.precision, "schedule": {"applied": 3}}
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["engine.json", "model.safetensors", "optimizer.bin"]
    fresh = _trained(seed=1, updates=0)
    load_engine_state(fresh, tmp_path / "ck")
    assert _same(fresh, eng) and fresh.schedule.state_dict() == {"applied": 3} and fresh.lr == eng.lr
    for p, q in zip(fresh.optimizer.state.values(), eng.optimizer.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in q)
    assert torch.is_tensor(fresh.optimizer.param_groups[0]["lr"])  # the schedule's LR again, not the saved one


def test_a_checkpoint_of_accelerates_save_state_resumes_with_its_schedule(tmp_path):
    """model.safetensors, optimizer.bin, scheduler.bin (a LambdaLR state), random_states_0.pkl; no engine.json."""
    eng = _trained(updates=5)
    d = tmp_path / "old"
    d.mkdir()
    save_file({k: v.contiguous() for k, v in eng.module.state_dict().items()}, str(d / "model.safetensors"))
    torch.save(eng.optimizer.state_dict(), d / "optimizer.bin")
    torch.save({"last_epoch": 5, "base_lrs": [1.0], "_step_count": 6}, d / "scheduler.bin")
    torch.save({"step": 0}, d / "random_states_0.pkl")
    fresh = _trained(seed=1, updates=0)
    load_engine_state(fresh, d)
    assert _same(fresh, eng) and fresh.schedule.state_dict() == {"applied": 5} and fresh.lr == eng.lr


def test_deepspeeds_lr_scheduler_entry_is_read_where_it_is_all_there_is(tmp_path):
    torch.save({"module": {}, "lr_scheduler": {"last_epoch": 7, "base_lrs": [1.0]}},
               tmp_path / "mp_rank_00_model_states.pt")
    assert saved_schedule(tmp_path)["last_epoch"] == 7
    (tmp_path / "engine.json").write_text(json.dumps({"format": 1, "schedule": {"applied": 9}}))
    assert saved_schedule(tmp_path) == {"applied": 9}  # engine.json first
    (tmp_path / "engine.json").write_text("{")
    with pytest.raises(ScaletrainError, match=r"engine.json: unreadable engine record"):
        saved_schedule(tmp_path)


def test_another_librarys_files_or_no_schedule_are_one_line(tmp_path):
    eng = _trained(updates=1)
    ds = tmp_path / "ds"
    ds.mkdir()
    torch.save({"module": {}}, ds / "mp_rank_00_model_states.pt")
    with pytest.raises(ScaletrainError, match=r"ds: not an Accelerate DDP checkpoint \(no optimizer.bin\); it was "
                                              r"written by another engine \(DeepSpeed\)"):
        load_engine_state(eng, ds)
    save_engine_state(eng, tmp_path / "ck")
    (tmp_path / "ck" / "engine.json").unlink()
    with pytest.raises(ScaletrainError, match=r"ck: no LR schedule position \(engine.json missing\)"):
        load_engine_state(eng, tmp_path / "ck")


def test_a_resume_at_another_engine_or_precision_says_what_changed_once(tmp_path, caplog):
    """Same world size, another engine: through the whole state (reshard.py), the same weights and moments,
    and one log line naming the change; another precision on the same engine: the engine's own files, one
    line; the same layout: no line."""
    eng = _trained()
    save_engine_state(eng, tmp_path / "ck")
    record = json.loads((tmp_path / "ck" / "engine.json").read_text())
    (tmp_path / "ck" / "engine.json").write_text(json.dumps({**record, "backend": "deepspeed"}))
    fresh = _trained(seed=1, updates=0)
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        load_engine_state(fresh, tmp_path / "ck")
    said = [r.getMessage() for r in caplog.records if "another layout" in r.getMessage()]
    assert said == ["resume of ck at another layout: backend deepspeed -> local; through the whole state"]
    assert _same(fresh, eng) and fresh.schedule.state_dict() == {"applied": 3}
    for p, q in zip(fresh.optimizer.state.values(), eng.optimizer.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in ("exp_avg", "exp_avg_sq"))
    caplog.clear()
    fp16 = _trained(seed=1, updates=0)
    fp16.loss_scale = lambda: 65536.0  # an fp16 engine's: the scale is not carried through the whole state
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        load_engine_state(fp16, tmp_path / "ck")
    assert [r.getMessage() for r in caplog.records if "another layout" in r.getMessage()] == [
        "resume of ck at another layout: backend deepspeed -> local; through the whole state; the fp16 loss scale "
        "restarts at 65536 (not carried): the first updates may be skipped as overflows while it comes down"]
    caplog.clear()
    other = "bf16" if record["precision"] != "bf16" else "fp32"
    (tmp_path / "ck" / "engine.json").write_text(json.dumps({**record, "precision": other}))
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        load_engine_state(_trained(seed=1, updates=0), tmp_path / "ck")
    said = [r.getMessage() for r in caplog.records if "another layout" in r.getMessage()]
    assert said == [f"resume of ck at another layout: precision {other} -> {record['precision']}; the engine's own "
                    "files, resharded where needed"]
    caplog.clear()
    (tmp_path / "ck" / "engine.json").write_text(json.dumps(record))
    with caplog.at_level(logging.INFO, logger="scaletrain"):
        load_engine_state(_trained(seed=1, updates=0), tmp_path / "ck")
    assert not [r for r in caplog.records if "another layout" in r.getMessage()]
