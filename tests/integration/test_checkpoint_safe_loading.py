"""Loading a checkpoint never runs code from it.

Real checkpoints of each engine (DeepSpeed ZeRO-2 and ZeRO-3, Accelerate DDP and Accelerate with the
DeepSpeed plugin) are written by 2-step runs in a fresh process; then every pickle file kind in them
gets a ``__reduce__`` payload (it would create a marker directory) and its ``index.json`` checksum is
rewritten to match, as an attacker editing a downloaded checkpoint would. Resume (both engines) and the
loaders of ``evaluate``/``translate`` (``load_for_inference``), ``export`` and ``average`` must refuse the
file with one line naming it, and the marker must not exist.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, launcher_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_driver import plant  # noqa: E402

DRIVER = str(Path(__file__).resolve().parent / "ckpt_driver.py")

# engine setup -> (overrides, pickle files of its checkpoint read by resume, ... read by the inference loaders)
ENGINES = {
    "ds_zero2": (["engine.ds_config=zero2.json"],
                 ["rank00000.pt", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
                 ["mp_rank_00_model_states.pt"]),
    "ds_zero3": (["engine.ds_config=zero3.json"],
                 ["rank00000.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt",
                  "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
                 ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]),
    "acc_ddp": (["engine.backend=accelerate", "engine.accelerate=ddp"],
                ["rank00000.pt", "optimizer.bin"], []),
    "acc_ds": (["engine.backend=accelerate", "engine.accelerate=deepspeed", "engine.ds_config=zero2.json"],
               ["rank00000.pt", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
               ["mp_rank_00_model_states.pt"]),
}


def _py(*args, env):
    p = subprocess.run([sys.executable, DRIVER, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def runs(django_shards, tmp_path_factory):
    base = tmp_path_factory.mktemp("safe_ckpts")
    env = launcher_env(base)
    _py("train", str(base), str(django_shards), "2", json.dumps({name: o for name, (o, _, _) in ENGINES.items()}), env=env)
    return base


def _copy_run(runs: Path, name: str, dst: Path) -> Path:
    shutil.copytree(runs / name, dst / name)
    return dst / name


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENGINES))
def test_resume_refuses_a_planted_payload_in_every_file(runs, django_shards, tmp_path, name):
    overrides, resume_files, _ = ENGINES[name]
    run = _copy_run(runs, name, tmp_path)
    result = tmp_path / "result.json"
    batches = [resume_files]
    res = {}
    for files in batches:
        _py("resume-planted", str(run), str(django_shards), json.dumps(overrides), json.dumps(files), str(result),
            env=launcher_env(tmp_path))
        res.update(json.loads(result.read_text()))
    for f in resume_files:
        assert not res[f]["ran"], f"{name}: loading {f} ran the payload"
        err = res[f]["error"]
        assert err and f in err and "refused to load" in err and "\n" not in err, (f, err)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ENGINES if ENGINES[n][2]])
def test_inference_loaders_refuse_a_planted_payload(runs, tmp_path, name):
    from scaletrain.checkpoint import average_checkpoints, load_for_inference
    from scaletrain.export import export_checkpoint
    from scaletrain.errors import ScaletrainError

    for f in ENGINES[name][2]:
        run = _copy_run(runs, name, tmp_path / f)
        ck = run / "checkpoints" / "step-0000002"
        marker = tmp_path / f"marker-{f}"
        plant(ck / f, str(marker))
        for load in (lambda: load_for_inference(run),  # evaluate, translate
                     lambda: export_checkpoint(run, tmp_path / "x.safetensors"),
                     lambda: average_checkpoints([ck], tmp_path / "avg")):
            with pytest.raises(ScaletrainError, match="refused to load") as e:
                load()
            assert str(ck / f) in str(e.value) and not marker.exists()


@pytest.mark.slow
def test_translate_cli_names_the_refused_file_in_one_line(runs, tmp_path):
    run = _copy_run(runs, "ds_zero2", tmp_path)
    f = run / "checkpoints" / "step-0000002" / "mp_rank_00_model_states.pt"
    plant(f, str(tmp_path / "marker"))
    p = subprocess.run([sys.executable, "-m", "scaletrain", "translate", "--checkpoint", str(run), "--src-lang", "de",
                        "--tgt-lang", "en"], input="Hallo\n", env=launcher_env(tmp_path), cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and not (tmp_path / "marker").exists()
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("[")  # DeepSpeed's log lines
             and not re.match(r"\d\d:\d\d:\d\d threads \d+: ", ln)]  # the CPU thread choice (translate logs it)
    assert len(lines) == 1 and str(f) in lines[0] and "refused to load" in lines[0], p.stderr
    assert "posix.mkdir" in lines[0]  # the global the file asked for
