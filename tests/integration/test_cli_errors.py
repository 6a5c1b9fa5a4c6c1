"""CLI errors: one line naming the problem, exit code != 0, no traceback (unless --debug)."""
import os

import pytest

from helpers import cli


def assert_one_line_error(p, *needles):
    assert p.returncode != 0
    err = p.stderr.strip()
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_unknown_config_key():
    p = cli("train", "--config", "small", "optim.lrr=1")
    assert_one_line_error(p, "unknown config key 'optim.lrr'")


def test_unknown_language_code(tmp_path):
    p = cli("prepare", "--langs", "de,xx", "--out", str(tmp_path / "o"))
    assert_one_line_error(p, "xx")
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_package_without_catalogs(tmp_path):
    p = cli("prepare", "--package", "pytest", "--out", str(tmp_path / "o"))
    assert_one_line_error(p, "pytest")
    p = cli("prepare", "--package", "no_such_pkg_zz", "--out", str(tmp_path / "o"))
    assert_one_line_error(p, "no_such_pkg_zz")


def test_existing_output_dir_refused_then_overwrite(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    p = cli("prepare", "--langs", "de", "--out", str(out))
    assert_one_line_error(p, str(out), "--overwrite")
    assert (out / "keep.txt").read_text() == "mine"  # nothing already written is touched
    p = cli("prepare", "--langs", "de", "--out", str(out), "--overwrite")
    assert p.returncode == 0, p.stderr
    assert (out / "manifest.json").is_file()


def test_debug_shows_traceback():
    p = cli("--debug", "train", "--config", "small", "optim.lrr=1")
    assert p.returncode != 0 and "Traceback" in p.stderr and "ScaletrainError" in p.stderr


def test_missing_checkpoint(tmp_path):
    p = cli("evaluate", "--checkpoint", str(tmp_path))
    assert_one_line_error(p, "is not a checkpoint")


def test_help_lists_commands():
    p = cli("--help")
    assert p.returncode == 0
    for c in ("prepare", "train", "evaluate"):
        assert c in p.stdout


HEAVY = ("deepspeed", "accelerate", "mlflow", "transformers", "matplotlib")


def test_missing_shards_fail_before_the_engines_libraries_load(tmp_path):
    """`scaletrain train` with a wrong data.shards: the line comes before DeepSpeed, Accelerate, MLflow or
    transformers is imported (-X importtime lists every import), within seconds, with nothing created."""
    import subprocess
    import sys
    import time

    from helpers import ROOT

    t0 = time.time()
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "scaletrain", "train", "--config", "small",
                        f"data.shards={tmp_path / 'missing'}", f"train.out_dir={tmp_path / 'run'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    secs = time.time() - t0
    imported = {ln.split("|")[-1].strip().split(".")[0] for ln in p.stderr.splitlines() if ln.startswith("import time:")}
    p.stderr = "\n".join(ln for ln in p.stderr.splitlines() if not ln.startswith("import time:"))
    assert_one_line_error(p, "config key 'data.shards'", str(tmp_path / "missing"), "scaletrain prepare")
    assert "torch" in imported  # the parse really was traced
    assert not imported & set(HEAVY), imported & set(HEAVY)
    assert secs < 15, secs  # a sanity bound only (the machine may be busy): the import check above is the test
    assert not (tmp_path / "run").exists()


def test_unwritable_out_dir_fails_before_the_engines_libraries_load(tmp_path, django_shards):
    (tmp_path / "file").write_text("x")
    p = cli("train", "--config", "small", f"data.shards={django_shards}", f"train.out_dir={tmp_path / 'file' / 'run'}")
    assert_one_line_error(p, "config key 'train.out_dir'", "cannot be created")


def test_launch_sh_builds_only_the_bundled_corpus(tmp_path):
    """A typo in data.shards: one line naming the key and the path and how to build shards, exit 2, no shard
    directory made, no run directory, no launcher started."""
    from helpers import launch_checkout, run_launch_sh

    checkout = launch_checkout(tmp_path)
    typo = "shards/djangoo"
    out = tmp_path / "run"
    p = run_launch_sh(["--out", str(out), f"data.shards={typo}"], checkout, timeout=300)
    text = p.stdout.decode()
    assert p.returncode == 2, text
    lines = text.strip().splitlines()  # nothing was started ("== preparing", "== training"): one line
    assert len(lines) == 1 and "config key 'data.shards'" in lines[0] and typo in lines[0], lines
    assert "scaletrain prepare --out" in lines[0]
    assert not (checkout / "shards").exists() and not out.exists() and not (checkout / "mlruns.db").exists()


def _dry_run(checkout, env, *args) -> str:
    from helpers import run_launch_sh

    p = run_launch_sh(["--dry-run", *args], checkout, env=env, timeout=300)
    text = p.stdout.decode()
    assert p.returncode == 0, text
    return text


def test_launch_sh_default_job_is_sized_for_the_machine(tmp_path, django_shards):
    """No --recipe: the small model on the bundled corpus without a GPU; on a machine whose nvidia-smi lists a
    GPU, one rank per GPU with the catalogs_gpu recipe, whose corpus (shards/catalogs, from every gettext
    catalog of the machine) launch.sh builds when missing. --dry-run checks everything and starts nothing:
    no corpus, run directory or MLflow store appears in the checkout. A corpus already built is not built
    again (a checkout after its first ./launch.sh)."""
    from helpers import launch_checkout

    checkout = launch_checkout(tmp_path)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n"
                                     "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the checkout's own store
    text = _dry_run(checkout, env)  # the default run directory, runs/small-<time>, is not made either
    assert "recipe small, 2 process(es) per node" in text and "shards shards/django (to build" in text
    gpu = _dry_run(checkout, {**env, "PATH": f"{fake}:{env['PATH']}"}, "--out", str(tmp_path / "b"))
    assert "recipe catalogs_gpu, 2 process(es) per node" in gpu and "GPUs seen 2" in gpu
    assert "shards shards/catalogs (to build: scaletrain prepare --out shards/catalogs --catalogs system,packages" in gpu
    assert sorted(p.name for p in checkout.iterdir()) == [".venv", "ds_configs", "launch.sh", "pyproject.toml",
                                                          "scripts"]
    assert not (tmp_path / "b").exists()
    (checkout / "shards").mkdir()
    (checkout / "shards" / "django").symlink_to(django_shards)  # built by an earlier ./launch.sh
    text = _dry_run(checkout, env, "--out", str(tmp_path / "c"))
    assert "shards shards/django, out" in text and "to build" not in text, text


def test_launch_sh_elastic_maps_onto_torchrun_and_refuses_what_does_not_fit(tmp_path, django_shards):
    """``--elastic MIN:MAX``: the torchrun command with its bounded rendezvous timeouts (the one
    test_elastic_restart runs on two hosts); options that contradict it: one line, exit 2, nothing started."""
    from helpers import launch_checkout, run_launch_sh

    checkout = launch_checkout(tmp_path)
    base = ["--nproc", "2", "--out", "runs/job", f"data.shards={django_shards}", "engine.precision=fp32"]
    text = _dry_run(checkout, None, "--elastic", "1:4", "--master_addr", "node0", *base)
    assert (f"== dry run: would run on each node: torchrun --nnodes=1:4 --nproc-per-node=2 --max-restarts=3 "
            "--rdzv-backend=c10d --rdzv-endpoint=node0:29500 --rdzv-id=job "
            "--rdzv-conf=join_timeout=600,last_call_timeout=30,close_timeout=30 -m scaletrain train --config small ") \
        in text, text
    assert "2 process(es) per node x 4 node(s)" in text  # checked for the largest world
    for args, needle in ((["--elastic", "4:1", "--master_addr", "n0"], "--elastic must be MIN:MAX"),
                         (["--elastic", "1:2"], "--elastic needs --master_addr"),
                         (["--elastic", "1:2", "--master_addr", "n0", "--node_rank", "1"], "--node_rank does not go"),
                         (["--elastic", "1:2", "--master_addr", "n0", "--no_ssh"], "drop --no_ssh")):
        p = run_launch_sh([*args, *base], checkout, timeout=120)
        lines = p.stdout.decode().strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and needle in lines[0], lines
    p = run_launch_sh(["--elastic", "1:2", "--master_addr", "n0", f"data.shards={django_shards}"], checkout, timeout=120)
    assert p.returncode == 2 and "--elastic needs --out DIR" in p.stdout.decode(), p.stdout.decode()
    assert not (checkout / "runs").exists()
