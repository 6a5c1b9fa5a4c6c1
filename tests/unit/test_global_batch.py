"""engine.global_batch_slots / engine.grad_accum at a resume on another world size
(scaletrain.train.global_batch): the run's global batch is kept; a deliberate change is honoured, in one line."""
from __future__ import annotations

import json

import pytest
import yaml

from scaletrain.config import load_config
from scaletrain.errors import ScaletrainError
from scaletrain.train.global_batch import plan_for_run, plan_global_batch, recorded_batch


def rec(slots, asked, world):
    return {"slots": slots, "asked": asked, "world_size": world}


def test_first_launch_records_world_times_grad_accum():
    p = plan_global_batch(world=2, grad_accum=3)
    assert (p.grad_accum, p.slots, p.asked, p.actual_slots, p.notes) == (3, 6, 3, 6, [])


@pytest.mark.parametrize("world, want_ga", [(1, 4), (2, 2), (4, 1)])
def test_same_command_at_another_world_size_keeps_the_recorded_slots(world, want_ga):
    p = plan_global_batch(world=world, grad_accum=1, recorded=rec(4, 1, 4))  # launched 4 ranks x 1
    assert (p.grad_accum, p.slots, p.actual_slots, p.asked) == (want_ga, 4, 4, 1)
    assert len(p.notes) == (0 if world == 4 else 1)
    if world != 4:
        assert p.notes[0].startswith("global batch kept at 4 batch slots per update: ")


def test_world_size_that_does_not_divide_takes_the_nearest_and_says_so_in_one_line():
    p = plan_global_batch(world=3, grad_accum=1, recorded=rec(4, 1, 2))
    assert (p.grad_accum, p.slots, p.actual_slots) == (1, 4, 3)
    assert len(p.notes) == 1 and "not a multiple of the 3 data-parallel ranks" in p.notes[0]
    assert "3 x 1 = 3 batch slots per update from here on" in p.notes[0]
    p = plan_global_batch(world=2, grad_accum=1, recorded=rec(3, 1, 3))  # 1.5: ties go up
    assert (p.grad_accum, p.actual_slots, p.slots) == (2, 4, 3)
    p = plan_global_batch(world=8, grad_accum=1, recorded=rec(2, 1, 2))  # never below 1
    assert (p.grad_accum, p.actual_slots) == (1, 8)


def test_recorded_slots_survive_a_non_dividing_detour():
    """4 slots on 2 ranks, resumed on 3 (3 slots used), then on 2 again: back to 4."""
    detour = plan_global_batch(world=3, grad_accum=1, recorded=rec(4, 1, 2))
    back = plan_global_batch(world=2, grad_accum=1, recorded=rec(detour.slots, detour.asked, 3))
    assert (back.grad_accum, back.actual_slots) == (2, 4)


def test_a_grad_accum_other_than_the_launch_one_changes_the_global_batch_in_one_line():
    p = plan_global_batch(world=2, grad_accum=3, recorded=rec(2, 1, 2))
    assert (p.grad_accum, p.slots, p.asked) == (3, 6, 3)
    assert len(p.notes) == 1 and "global batch changes from 2 to 2 x 3 = 6 batch slots" in p.notes[0]
    assert "engine.global_batch_slots=2" in p.notes[0]
    # the hand resume of the lost-peer test: 1 rank x grad_accum 2 from 2 ranks x 1 is the same batch
    p = plan_global_batch(world=1, grad_accum=2, recorded=rec(2, 1, 2))
    assert (p.grad_accum, p.slots, p.asked) == (2, 2, 2)
    assert p.notes == ["global batch kept at 2 batch slots per update: 1 data-parallel rank(s) x grad_accum 2 "
                       "(the checkpoint's run: 2 rank(s))"]


def test_a_derived_grad_accum_is_not_taken_for_a_change():
    """Launched 2 x 1; resumed on 1 rank (grad_accum 2 derived, the asked 1 recorded); the same command again."""
    first = plan_global_batch(world=1, grad_accum=1, recorded=rec(2, 1, 2))
    again = plan_global_batch(world=1, grad_accum=1, recorded=rec(first.slots, first.asked, 1))
    assert (first.grad_accum, again.grad_accum, again.slots, again.notes) == (2, 2, 2, [])


def test_configured_slots_win():
    p = plan_global_batch(world=2, grad_accum=1, configured=8)
    assert (p.grad_accum, p.slots, p.notes) == (4, 8, [])
    p = plan_global_batch(world=4, grad_accum=1, configured=8, recorded=rec(4, 1, 4))
    assert (p.grad_accum, p.slots) == (2, 8)
    assert len(p.notes) == 1 and "replaces the checkpoint's 4 batch slots" in p.notes[0]


def test_a_grad_accum_contradicting_configured_slots_is_replaced_in_one_line():
    p = plan_global_batch(world=2, grad_accum=3, configured=8)
    assert (p.grad_accum, p.slots, p.asked) == (4, 8, 3)
    assert p.notes == ["engine.grad_accum=3 would make 2 x 3 = 6 batch slots per update, but "
                       "engine.global_batch_slots=8 fixes the global batch: grad_accum 4 is used (set only one of "
                       "the two keys)"]
    # the launch's own grad_accum on a restart at another size is no contradiction
    p = plan_global_batch(world=1, grad_accum=4, configured=8, recorded=rec(8, 4, 2))
    assert (p.grad_accum, p.notes[0].startswith("global batch kept")) == (8, True)


def test_config_key_checked_and_documented():
    assert load_config("small").engine.global_batch_slots == 0
    with pytest.raises(ScaletrainError, match=r"config key 'engine.global_batch_slots': must be >= 0"):
        load_config("small", ["engine.global_batch_slots=-1"])


def _ckpt(root, world, ga, extra=None):
    d = root / "checkpoints" / "step-0000004"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": 4, "world_size": world, **(extra or {})}))
    (d / "config.yaml").write_text(yaml.safe_dump({"engine": {"grad_accum": ga}}))
    (root / "checkpoints" / "latest").write_text("step-0000004")
    return d


def test_recorded_batch_of_new_and_old_checkpoints(tmp_path):
    old = _ckpt(tmp_path / "old", world=2, ga=3)  # written before the fields: world x config grad_accum
    assert recorded_batch(old) == {"slots": 6, "asked": 3, "world_size": 2}
    new = _ckpt(tmp_path / "new", world=1, ga=6, extra={"global_batch_slots": 6, "grad_accum_asked": 3})
    assert recorded_batch(new) == {"slots": 6, "asked": 3, "world_size": 1}


def test_plan_for_run_sets_the_engine_grad_accum(tmp_path):
    _ckpt(tmp_path, world=2, ga=1)
    cfg = load_config("small", [f"train.out_dir={tmp_path}"])
    plan = plan_for_run(cfg, world=1, is_main=True)
    assert cfg.engine.grad_accum == 2 and plan.slots == 2
    cfg = load_config("small", [f"train.out_dir={tmp_path}", "train.resume=false"])
    assert plan_for_run(cfg, world=1, is_main=True).grad_accum == 1  # no resume: a first launch


def test_a_damaged_record_falls_back_to_an_earlier_checkpoint(tmp_path):
    _ckpt(tmp_path, world=2, ga=2)  # step-0000004: 4 slots
    bad = tmp_path / "checkpoints" / "step-0000008"
    bad.mkdir()
    (bad / "trainer_state.json").write_text('{"step": 8, "world_si')  # torn
    (tmp_path / "checkpoints" / "latest").write_text("step-0000008")
    cfg = load_config("small", [f"train.out_dir={tmp_path}", "engine.grad_accum=2"])  # the launch's command
    assert plan_for_run(cfg, world=1, is_main=True).slots == 4 and cfg.engine.grad_accum == 4
