"""./launch.sh end to end on 2 CPU ranks (the `deepspeed` launcher), tiny model: nothing is compiled at start
(a gcc/c++/ninja that fails and records its calls is first on PATH, the torch extensions cache is empty),
the output holds our lines and none of the libraries' known noise, the progress bar does not swallow the
evaluation header, the closing lines name this run's path in the commands to try next, and the ranks exit
with nothing of torch.distributed left running (helpers.exit_probe)."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

from helpers import (ROOT, assert_ranks_exited_cleanly, exit_probe, free_port, launch_checkout, run_launch_sh,
                     tiny_model)

NOISE = (
    "Setting accelerator to CPU",  # DeepSpeed's accelerator probe
    "CUDA_VISIBLE_DEVICES",  # DeepSpeed's launcher on a machine without GPU
    "Unable to find hostfile",
    "cmd = ", "spawned with command", "exits successfully", "WORLD INFO DICT",  # the launcher's INFO lines
    "gcc ", "c++ ", "ninja", "built successfully", "JIT", "Loading extension module",  # op builds
    "Creating initial MLflow database tables", "Updating database tables",  # MLflow's store start
    "Matplotlib is building the font cache",
    "[INFO]", "[WARNING] [real_accelerator",
)


def _shims(tmp_path):
    """gcc, cc, c++, g++, ninja that record their call and fail."""
    d = tmp_path / "shims"
    d.mkdir()
    calls = tmp_path / "compiler_calls.log"
    for name in ("gcc", "cc", "c++", "g++", "ninja", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-g++"):
        p = d / name
        p.write_text(f"#!/bin/sh\necho \"{name} $*\" >> {calls}\nexit 1\n")
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return d, calls


def test_launch_sh_trains_quietly_without_compiling(tmp_path, django_shards):
    shims, calls = _shims(tmp_path)
    ext = tmp_path / "torch_extensions"
    ext.mkdir()
    out = tmp_path / "run"
    env = dict(os.environ)
    env.update(PATH=f"{shims}:{env['PATH']}", TORCH_EXTENSIONS_DIR=str(ext),
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlruns.db", MPLCONFIGDIR=str(tmp_path / "mpl"),
               PYTHONUNBUFFERED="1")
    for k in ("DS_ACCELERATOR", "SCALETRAIN_VERBOSE", "MLFLOW_LOGGING_LEVEL", "OMP_NUM_THREADS"):
        env.pop(k, None)
    overrides = [f"data.shards={django_shards}", *tiny_model(), "data.max_tokens=600", "data.max_bytes=60",
                 "train.max_steps=4", "train.log_every=2", "train.valid_every=0", "train.valid_max_batches=2",
                 "train.save_every=0", "optim.warmup_steps=2", "eval.max_len_a=1.0", "eval.max_len_b=10",
                 "tracking.system_metrics=false"]
    reports = exit_probe(tmp_path, env)
    p = run_launch_sh(["--out", str(out), "--master_port", str(free_port()), *overrides], launch_checkout(tmp_path),
                      env=env)
    text = p.stdout.decode("utf-8", errors="replace")  # bytes: text mode would turn \r into \n
    assert p.returncode == 0 and "terminate called" not in text, text[-6000:]
    assert_ranks_exited_cleanly(reports, world=2)  # nothing left to race the interpreter's exit (SIGABRT)
    assert not calls.exists(), calls.read_text()  # nothing compiled, not even a compatibility probe
    assert not any(ext.iterdir()), list(ext.iterdir())
    found = [n for n in NOISE if n in text]
    assert not found, (found, text[-6000:])
    # the thread choice, once per process that logs (rank 0, then evaluate)
    assert len(re.findall(r"threads \d+: \d+ usable core\(s\) \(affinity \d+\) / 2 rank\(s\) on this node$", text, re.M)) == 1
    assert len(re.findall(r"threads \d+: \d+ usable core\(s\) \(affinity \d+\) / 1 rank\(s\) on this node", text)) == 1
    for key in ("== training", "step      2 | loss", "trained 4 steps", "== evaluating",
                "sentences/s", "BLEU", "== next"):
        assert key in text, (key, text[-6000:])
    # the evaluation's header starts a line of its own (tqdm's bar into a pipe used to swallow it) and no
    # redraw (\r) reaches the log
    assert re.search(r"^evaluation test\.full\.\S+\.step4: test, all \d+ lines, beam 1,", text, re.M), text
    assert re.search(rf"^checkpoint {re.escape(str(out))}\S*step-0*4, [\d.]+ sentences/s", text, re.M), text
    assert "\r" not in text, text
    nxt = text[text.index("== next"):].splitlines()
    q = str(out)
    assert any(ln.strip().startswith("echo ") and f"scaletrain translate --checkpoint {q} --src-lang" in ln for ln in nxt)
    assert any(f"scaletrain evaluate --checkpoint {q} --beam 4" in ln for ln in nxt)
    assert any(f"scaletrain compare {q}" in ln for ln in nxt)
    assert any(f"scaletrain export {q} --out {q}/model.safetensors" in ln for ln in nxt)
    assert any(f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlruns.db" in ln and "# then open http://127.0.0.1:5000"
               "/#/experiments/" in ln and "/runs/" in ln and ln.endswith("?workflowType=machine_learning") for ln in nxt)
    # the suggested translate command works as printed
    cmd = next(ln.strip() for ln in nxt if "scaletrain translate" in ln)
    t = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**env, "PATH": f"{ROOT / '.venv' / 'bin'}:{env['PATH']}"})
    assert t.returncode == 0 and len(t.stdout.splitlines()) == 1, (t.stdout, t.stderr)


def test_verbose_shows_the_libraries_lines_again(tmp_path, django_shards):
    """One process, one step: quiet by default; --verbose lets DeepSpeed's own lines through again (at its
    own default level: its warnings)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "SCALETRAIN_VERBOSE")}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlruns.db", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    args = ["train", "--config", "small", f"data.shards={django_shards}", *tiny_model(), "data.max_tokens=600",
            "data.max_bytes=60", "train.max_steps=1", "train.valid_every=0", "train.valid_max_batches=1",
            "train.save_every=0", "tracking.enabled=false"]
    outs = {}
    for flag in ((), ("--verbose",)):
        p = subprocess.run([sys.executable, "-m", "scaletrain", *flag, *args, f"train.out_dir={tmp_path / str(len(flag))}"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        outs[bool(flag)] = p.stdout + p.stderr
    assert "trained 1 steps" in outs[False] and "trained 1 steps" in outs[True]
    assert "Setting accelerator to CPU" not in outs[False] and "[WARNING]" not in outs[False]
    assert "Setting accelerator to CPU" in outs[True], outs[True][-3000:]
