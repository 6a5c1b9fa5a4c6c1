"""One engine over thin backends (``scaletrain/engine/engine.py``).

The step API is written once, in ``Engine``; a backend (DeepSpeed, Accelerate's DDP) only implements the hooks
``Backend`` declares (start, wrap, backward, the optimizer step, its own state): no backend adds a member of its
own, no class restates the API as a protocol, nothing outside the engine probes it with ``getattr``, and the
expert-parallel gradients and the ZeRO stage are made in one place each. Then the shared step logic, run for real
in this process over a one-process backend (``helpers.local_backend_class``): a withheld update is counted by the
LR schedule on the device, so the LRs and parameters do not depend on when the host reads the flag; an abandoned
step changes nothing; without a fused optimizer the norm is read on the host.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from helpers import local_engine, tiny_model
from scaletrain.config import load_config
from scaletrain.engine import Backend, Engine
from scaletrain.engine.ddp_backend import DDPBackend
from scaletrain.engine.deepspeed_backend import DeepSpeedBackend
from scaletrain.models import build_model

PKG = Path(__file__).resolve().parents[2] / "scaletrain"
STEP_API = {"setup", "train", "forward", "backward", "step", "abandon_step", "lr", "loss_scale", "partitioned",
            "full_state_dict", "inference_module", "state_dict", "load_state_dict", "save_native", "load_native"}


def _public(cls) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")}


def test_the_engine_holds_the_whole_step_api():
    assert STEP_API <= _public(Engine)
    assert not issubclass(Engine, Backend)


@pytest.mark.parametrize("backend", [DeepSpeedBackend, DDPBackend])
def test_a_backend_only_implements_the_hooks_backend_declares(backend):
    own = _public(backend) - {"name", "native_checkpoint"}  # settings, not members
    assert own <= _public(Backend), f"{backend.__name__} adds {sorted(own - _public(Backend))}"
    assert not {"step", "abandon_step", "lr", "full_state_dict", "inference_module", "setup"} & _public(backend)


def _trees(root: Path):
    for p in sorted(root.rglob("*.py")):
        yield p, ast.parse(p.read_text())


def test_no_protocol_restates_the_engine_and_nothing_probes_it():
    for p, tree in _trees(PKG / "engine"):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                assert "Protocol" not in bases, f"{p.name}: {node.name} is a Protocol"
    probes = []
    for p, tree in _trees(PKG):
        if (PKG / "engine") in p.parents:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" and node.args
                    and ast.unparse(node.args[0]) in ("eng", "engine", "self.engine")):
                probes.append(f"{p.relative_to(PKG.parent)}:{node.lineno}")
    assert not probes, f"getattr probes of the engine: {probes}"


def test_expert_gradients_and_the_zero_stage_are_made_once():
    calls, parses = [], []
    for p, tree in _trees(PKG):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "ExpertParallelGrads":
                calls.append(f"{p.name}:{node.lineno}")
        parses += [f"{p.name}:{i}" for i, line in enumerate(p.read_text().splitlines(), 1) if '.get("stage"' in line]
    assert len(calls) == 1 and calls[0].startswith("engine.py:"), calls
    assert len(parses) == 1 and parses[0].startswith("ds_config.py"), parses


# ---- the shared step logic, for real ---------------------------------------------------------------------
def _engine(*overrides, **backend_kw):
    cfg = load_config("small", [*tiny_model(), "data.max_bytes=40", "data.max_tokens=600", "engine.compile=false",
                                "optim.warmup_steps=4", "optim.lr=1e-2",
                                "optim.warmup_init_lr=0", *overrides])
    eng = local_engine(cfg, **backend_kw)
    torch.manual_seed(0)
    eng.setup(build_model(cfg.model, 300))
    return eng


def _update(eng, seed: int, nan: bool = False):
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(4, 260, (3, 9), generator=g), torch.randint(4, 260, (3, 8), generator=g)
    logits = eng.forward(src, tgt[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten(), reduction="sum")
    eng.backward(loss * (float("nan") if nan else 1.0))
    return eng.step()


def _run(read_each_step: bool):
    eng = _engine()
    infos, params = [], []
    for s in range(1, 6):
        info = _update(eng, s, nan=s == 2)
        pending = info.pending
        if read_each_step:
            info.resolve()
        infos.append((info, pending))
        params.append({k: v.clone() for k, v in eng.module.state_dict().items()})
    return eng, infos, params


def test_a_withheld_update_is_counted_on_the_device_whenever_the_host_reads_it():
    eager, e_infos, e_params = _run(read_each_step=True)
    lazy, l_infos, l_params = _run(read_each_step=False)
    assert all(pending for _, pending in l_infos)  # nothing read in the steps (a device flag, norm and LR)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(e_params, l_params) for k in a)  # reading changes nothing
    assert all(torch.equal(e_params[0][k], e_params[1][k]) for k in e_params[0])  # update 2 withheld
    assert [(i.skipped, i.nonfinite) for i, _ in l_infos] == [(False, False), (True, True)] + [(False, False)] * 3
    assert [i.lr for i, _ in e_infos] == [i.lr for i, _ in l_infos]
    f = [1e-2 * n / 4 for n in (2, 3)] + [1e-2 * (4 / 5) ** 0.5]  # after 1, 1, 2, 3, 4 applied updates
    assert [i.lr for i, _ in l_infos] == pytest.approx([f[0], f[0], f[1], 1e-2, f[2]], rel=1e-12)
    assert float(lazy.schedule.applied) == 4 and lazy.schedule.state_dict() == {"applied": 4}
    assert {float(s["step"]) for s in lazy.optimizer.state.values()} == {4.0}


def test_an_abandoned_step_changes_nothing():
    eng = _engine()
    _update(eng, 1)
    before = {k: v.clone() for k, v in eng.module.state_dict().items()}
    lr = eng.lr
    g = torch.Generator().manual_seed(2)
    eng.forward(torch.randint(4, 260, (3, 9), generator=g), torch.randint(4, 260, (3, 7), generator=g))
    eng.abandon_step(0)  # micro-batch 0 of 1 ran out of memory before its backward
    info = eng.step()
    assert info.skipped and not info.nonfinite and eng.lr == lr and eng.schedule.state_dict() == {"applied": 1}
    assert all(torch.equal(before[k], v) for k, v in eng.module.state_dict().items())
    assert all(p.grad is None for p in eng.module.parameters())
    _update(eng, 3)
    assert eng.schedule.state_dict() == {"applied": 2}


def test_without_a_fused_optimizer_the_norm_is_read_on_the_host():
    eng = _engine("optim.fused=false")
    assert not eng.schedule.tensor_lr and not torch.is_tensor(eng.optimizer.param_groups[0]["lr"])
    ok = _update(eng, 1)
    before = {k: v.clone() for k, v in eng.module.state_dict().items()}
    bad = _update(eng, 2, nan=True)
    assert not bad.pending and bad.skipped and bad.nonfinite and not ok.skipped
    assert all(torch.equal(before[k], v) for k, v in eng.module.state_dict().items())  # the update withheld
    assert eng.schedule.state_dict() == {"applied": 1} and bad.lr == ok.lr
