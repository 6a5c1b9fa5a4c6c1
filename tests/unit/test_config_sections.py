"""One config style: every section of the run config documents each of its keys (a docstring under the
field: meaning, unit, allowed values) and checks its own keys (its ``validate``); ``Config.validate``
calls them and keeps only the rules joining two sections. Every component the trainer builds from the
config comes from ``X.for_run(cfg, ...)``."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from scaletrain.config import Config, dump_yaml, field_docs, load_config
from scaletrain.errors import ScaletrainError

ROOT = Path(__file__).resolve().parents[2]


def _sections(cls=Config, seen=None) -> list[type]:
    """``cls`` and every config dataclass below it (model variant sections included)."""
    seen = [] if seen is None else seen
    seen.append(cls)
    for tp in typing.get_type_hints(cls).values():
        if dataclasses.is_dataclass(tp) and tp not in seen:
            _sections(tp, seen)
    return seen


def test_every_section_is_found():
    names = {c.__name__ for c in _sections()}
    assert {"DataConfig", "OptimConfig", "EngineConfig", "TrainConfig", "EvalConfig", "TrackingConfig",
            "ModelConfig", "MoEConfig", "LobefConfig", "ConvConfig", "MoCEConfig", "OneHotConfig",
            "CharAwareConfig"} <= names


@pytest.mark.parametrize("cls", _sections(), ids=lambda c: c.__name__)
def test_every_key_has_a_docstring(cls):
    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]
    assert not missing, f"{cls.__name__}: keys without a docstring: {missing}"
    assert cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("), f"{cls.__name__} has no docstring"


def test_explain_config_prints_each_key_under_its_documentation(capsys):
    """``train --explain-config``: the resolved config as YAML with each key's docstring as comments above it;
    it reads back to the same config as ``--print-config``."""
    import yaml

    from scaletrain.cli import main as cli_main

    assert cli_main(["train", "--config", "moce_d4", "--explain-config", "optim.lr=2e-3"]) == 0
    text = capsys.readouterr().out
    cfg = load_config("moce_d4", ["optim.lr=2e-3"])
    assert yaml.safe_load(text) == yaml.safe_load(dump_yaml(cfg))
    from scaletrain.config import to_dict

    def expect(tree, cls, pad):  # every key directly under the last line of its docstring
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for key, value in tree.items():
            yield f"{pad}# {docs[key].splitlines()[-1]}\n{pad}{key}:"
            if dataclasses.is_dataclass(hints[key]):
                yield from expect(value, hints[key], pad + "  ")

    wanted = list(expect(to_dict(cfg), Config, ""))
    assert len(wanted) > 100 and [w for w in wanted if w not in text] == []
    assert "  # Peak learning rate, reached at the end of the warm-up (> 0).\n  lr: 0.002\n" in text
    assert "    # Conv experts each position is routed to (>= 1).\n    top_k: 2\n" in text


@pytest.mark.parametrize("cls", [c for c in _sections() if c is not Config], ids=lambda c: c.__name__)
def test_every_section_validates_itself(cls):
    assert "validate" in vars(cls), f"{cls.__name__} has no validate() of its own"


@pytest.mark.parametrize("section", ["data", "optim", "engine", "train", "eval", "tracking", "model", "moe"])
def test_config_validate_calls_each_section(section, monkeypatch):
    """A section's own rule reaches users through ``Config.validate`` (and so through load_config)."""
    cfg = Config()
    cfg.validate()
    sec = getattr(cfg, section)

    def refuse(*a, **kw):
        raise ScaletrainError(f"{section} checked")

    monkeypatch.setattr(type(sec), "validate", refuse)
    with pytest.raises(ScaletrainError, match=f"^{section} checked$"):
        cfg.validate()


def test_a_section_checks_its_keys_without_the_rest():
    from scaletrain.config import DataConfig, TrainConfig

    with pytest.raises(ScaletrainError, match=r"^config key 'data.temperature': must be > 0"):
        DataConfig(temperature=0.0).validate()
    with pytest.raises(ScaletrainError, match=r"^config key 'train.patience': early stopping needs train.best_metric"):
        TrainConfig(patience=2).validate()
    TrainConfig(patience=2, best_metric="valid/nll").validate()


def test_the_rule_joining_data_and_model_stays_in_config():
    """``data.max_bytes + 2 <= model.max_positions`` needs both sections: only ``Config.validate`` has it."""
    from scaletrain.config import DataConfig

    DataConfig(max_bytes=5000, max_tokens=20000).validate()
    with pytest.raises(ScaletrainError, match=r"^config key 'data.max_bytes': 5000 \+ 2 \(tag, eos\) exceeds "
                                              r"model.max_positions 1024$"):
        load_config("small", ["data.max_bytes=5000", "data.max_tokens=20000", "model.max_positions=1024"])


def _component_classes() -> dict[str, type]:
    """Classes imported by train/trainer.py that have a ``for_run``."""
    import scaletrain.train.trainer as trainer

    return {n: v for n, v in vars(trainer).items() if inspect.isclass(v) and hasattr(v, "for_run")}


def test_the_trainer_builds_its_components_with_for_run():
    """No component with a ``for_run`` is constructed in trainer.py with its keys unpacked by hand."""
    classes = _component_classes()
    assert {"StepLogger", "Evaluator", "EarlyStopper"} <= set(classes)
    tree = ast.parse((ROOT / "scaletrain/train/trainer.py").read_text(encoding="utf-8"))
    direct = [f"line {n.lineno}: {n.func.id}(...)" for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in classes]
    assert not direct, f"build these with {{Class}}.for_run(cfg, ...): {direct}"


def _passes_keys_through(fn: ast.FunctionDef) -> bool:
    """``for_run``'s body is ``return cls(...)`` of names and attribute reads only (plus its docstring)."""
    body = [n for n in fn.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Call):
        return False
    call = body[0].value
    args = [*call.args, *(k.value for k in call.keywords)]
    return getattr(call.func, "id", "") == "cls" and all(isinstance(a, (ast.Name, ast.Attribute)) for a in args)


def test_a_for_run_exists_only_where_it_computes_something():
    """A component whose keys the trainer can hand over as they are has no ``for_run``: it is built with plain
    values (its constructor is what a test uses too)."""
    found = []
    for p in sorted((ROOT / "scaletrain").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name == "for_run" and _passes_keys_through(node):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"for_run that only passes keys through (build the class directly): {found}"


def test_the_trainer_hands_each_component_its_keys(django_shards, tmp_path):
    from test_engine_loop import TINY, SkippingEngine

    from scaletrain.train import Trainer

    cfg = load_config("small", [*TINY, f"data.shards={django_shards}", f"train.out_dir={tmp_path}",
                                "train.keep_last=7", "train.save_every=11", "train.valid_every=3", "train.bleu_every=0",
                                "train.on_save_error=continue", "train.max_minutes=2", "train.save_every_minutes=3",
                                "train.nonfinite=stop", "train.max_nonfinite=4", "train.on_oom=skip",
                                "train.preempt_grace_seconds=9", "train.best_metric=valid/nll",
                                "train.best_mode=min", "train.patience=5", "train.best_min_delta=0.25"])
    tr = Trainer(cfg, engine=SkippingEngine(cfg, skip=()))
    try:
        ckpt = tr.ckpt
        assert (ckpt.root, ckpt.keep_last, ckpt.save_every, ckpt.on_save_error) == (
            tmp_path / "checkpoints", 7, 11, "continue")
        assert tr.budget.limit == 120.0 and tr.save_timer.every == 180.0
        assert (tr.nonfinite.mode, tr.nonfinite.max_run, tr.nonfinite.dir) == ("stop", 4, tmp_path / "nonfinite")
        assert (tr.oom.mode, tr.oom.max_tokens) == ("skip", cfg.data.max_tokens)
        assert tr.preemption.grace == 9.0
        best = tr.stopper.best
        assert (best.root, best.metric, best.mode, best.patience, best.min_delta) == (
            ckpt.root, "valid/nll", "min", 5, 0.25)
        assert best.update(100, {"valid/nll": 2.0}).improved and not best.update(200, {"valid/nll": 1.9}).improved
        # each says when it is due: the trainer reads the step's values on those steps (Trainer._settle_due)
        assert [s for s in range(1, 13) if ckpt.due(s)] == [11]
        assert [s for s in range(1, 13) if tr.evaluator.due(s)] == [3, 6, 9, 12]
        assert [s for s in range(1, 13) if tr.logger.due(s)] == [2, 4, 6, 8, 10, 12]
    finally:
        tr.close()
    from scaletrain.train.components import EarlyStopper
    from scaletrain.train.state import TrainState

    assert EarlyStopper.for_run(load_config("small"), ckpt.root, tr.engine, TrainState()).best is None
