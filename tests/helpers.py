"""What several test files share that is not a fixture (fixtures stay in conftest.py): the tiny-model
overrides, the launcher and CLI commands, small decoding checks. Importable from tests/unit and
tests/integration (pyproject.toml puts tests/ on pytest's path) and from driver scripts that put tests/
on sys.path themselves."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A small but real corpus for integration tests: scripts Latin, Cyrillic, Arabic, Devanagari, Japanese.
TEST_LANGS = ["de", "ru", "ar", "hi", "ja"]
# Scripts the launchers run, relative to ROOT (the launchers' working directory).
DIST_DRIVER = "tests/integration/dist_driver.py"  # train one recipe, save this rank's parameters
REPLAY_DRIVER = "tests/integration/test_engine_replay.py"  # train fixed-batch jobs (engine equivalence)
# The engines a test trains through in its own process (world of one): config overrides per name.
IN_PROCESS_ENGINES = {
    "deepspeed": ["engine.backend=deepspeed", "engine.ds_config=zero0.json"],
    "accelerate": ["engine.backend=accelerate", "engine.accelerate=ddp"],
    "accelerate-deepspeed": ["engine.backend=accelerate", "engine.accelerate=deepspeed", "engine.ds_config=zero0.json"],
}


def reset_accelerate() -> None:
    """Accelerate keeps one process-wide state (mixed precision, the DeepSpeed plugin): each run in this process
    starts its own."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def tiny_model(d_model: int = 32, n_heads: int = 2, layers: int | tuple[int, int] = 1, ffn_dim: int = 64,
               max_positions: int = 64, dropout: float | None = 0.0) -> list[str]:
    """Config overrides for a tiny model: ``model.d_model``, ``model.n_heads``, ``model.encoder_layers`` and
    ``model.decoder_layers`` (``layers``: both, or ``(encoder, decoder)``), ``model.ffn_dim``,
    ``model.max_positions``, ``model.dropout``. A value of None leaves that key to the recipe."""
    enc, dec = layers if isinstance(layers, tuple) else (layers, layers)
    keys = dict(d_model=d_model, n_heads=n_heads, encoder_layers=enc, decoder_layers=dec, ffn_dim=ffn_dim,
                max_positions=max_positions, dropout=dropout)
    return [f"model.{k}={v}" for k, v in keys.items() if v is not None]


def ten_step_run(max_bytes: int, max_tokens: int) -> list[str]:
    """Config overrides for a 10-step fp32 run on DeepSpeed ZeRO-0 with batches of at most ``max_bytes`` per
    sentence and ``max_tokens`` per batch: no validation, no checkpoint before the last, no resume, no MLflow."""
    return [
        f"data.max_bytes={max_bytes}", f"data.max_tokens={max_tokens}", "optim.lr=3e-3", "optim.warmup_steps=4",
        "optim.warmup_init_lr=0", "train.max_steps=10", "train.log_every=5", "train.valid_every=0",
        "train.valid_max_batches=2", "train.save_every=0", "train.resume=false", "tracking.enabled=false",
        "engine.precision=fp32", "engine.grad_accum=1", "engine.backend=deepspeed",
        "engine.ds_config=ds_configs/zero0.json",
    ]


# ---- processes -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlruns.db",
               PYTHONUNBUFFERED="1")
    return env


def deepspeed_cmd(nproc: int, script: str, *args: str, runner: bool = False) -> list[str]:
    """``nproc`` ranks of ``script`` on this host under DeepSpeed's per-node launcher (``launch.py``), started
    as launch.sh starts a single-node job (``python -m scaletrain.engine.launch``: the launcher in one
    process, DeepSpeed imported without MLflow). ``runner=True``: through the ``deepspeed`` command (its
    runner, a second launcher process) instead, for tests of what the runner itself does."""
    if runner:
        exe = Path(sys.executable).with_name("deepspeed")
        return [str(exe), "--num_gpus", str(nproc), "--master_port", str(free_port()), "--no_local_rank", script, *args]
    return [sys.executable, "-m", "scaletrain.engine.launch", "--nproc", str(nproc), "--master_port", str(free_port()),
            "--", script, *args]


# What a process must have finished before its interpreter exits: torch.distributed's C++ threads (gloo's
# workers and transport loop, the TCPStore server, NCCL's watchdog) and ours.
TORCH_COMM_THREADS = ("gloo", "tcpstore", "nccl")
EXIT_PROBE = """
import atexit, json, os, sys, threading


def _scaletrain_exit_probe():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    dist = sys.modules.get("torch.distributed")
    report = {"rank": os.environ.get("RANK"), "argv": sys.argv, "os_threads": sorted(names),
              "process_group": bool(dist is not None and dist.is_available() and dist.is_initialized()),
              "our_threads": [t.name for t in threading.enumerate() if t.name.startswith("scaletrain-")]}
    with open(os.path.join(os.environ["SCALETRAIN_EXIT_PROBE"], f"exit-{os.getpid()}.json"), "w") as f:
        json.dump(report, f)


atexit.register(_scaletrain_exit_probe)  # registered first: runs after every other exit handler
"""


def exit_probe(tmp_path: Path, env: dict) -> Path:
    """Make every Python process started with ``env`` record, at interpreter exit (after every other exit
    handler), what is still alive: its OS threads' names, whether torch.distributed still has a process
    group, and scaletrain's own threads; one ``exit-PID.json`` per process in the returned directory (a
    ``sitecustomize`` module put first on PYTHONPATH)."""
    probe, reports = tmp_path / "exit_probe", tmp_path / "exit_reports"
    probe.mkdir()
    reports.mkdir()
    (probe / "sitecustomize.py").write_text(EXIT_PROBE)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe), env.get("PYTHONPATH")) if p)
    env["SCALETRAIN_EXIT_PROBE"] = str(reports)
    return reports


def assert_ranks_exited_cleanly(reports: Path, world: int) -> None:
    """Every training rank (a process with RANK set that ran ``train``) ended with no process group, no
    torch.distributed thread and none of ours still alive."""
    import json

    ranks = [json.loads(f.read_text()) for f in sorted(reports.glob("exit-*.json"))]
    ranks = [r for r in ranks if r["rank"] is not None and "train" in r["argv"]]
    assert sorted(int(r["rank"]) for r in ranks) == list(range(world)), ranks
    for r in ranks:
        comm = [n for n in r["os_threads"] if any(k in n for k in TORCH_COMM_THREADS)]
        assert not r["process_group"] and not comm and not r["our_threads"], r


def run(cmd, env, timeout=600, cwd=None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def cli(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    """``python -m scaletrain ARGS`` as a user runs it; the caller checks the exit status."""
    return subprocess.run([sys.executable, "-m", "scaletrain", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def two_rank_training(out: Path, recipe: str, *overrides: str, tmp_path: Path, steps: int = 10):
    """Train ``recipe`` on 2 ranks under the ``deepspeed`` launcher (DIST_DRIVER), check what every 2-rank run
    must show (world size 2, ``steps`` steps on both ranks, falling loss, identical parameters on both ranks,
    the final checkpoint loads as exactly those parameters) and return ``(model, cfg, vocab, trainer_state)``
    of that checkpoint."""
    import json

    import torch

    from scaletrain.checkpoint import load_for_inference

    out.mkdir(exist_ok=True)
    cmd = deepspeed_cmd(2, DIST_DRIVER, str(out), recipe, *overrides)
    run(cmd, launcher_env(tmp_path))
    # DeepSpeed's per-rank shared-memory allreduce segments of this run were unlinked (RAM in /dev/shm)
    port = cmd[cmd.index("--master_port") + 1]
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))
    res = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in res] == [2, 2] and res[0]["steps"] == res[1]["steps"] == steps
    assert res[0]["train_loss"][-1][1] < res[0]["train_loss"][0][1]
    p0, p1 = torch.load(out / "params_rank0.pt"), torch.load(out / "params_rank1.pt")
    assert p0.keys() == p1.keys() and all(torch.equal(p0[k], p1[k]) for k in p0)
    model, cfg, vocab, state, _ = load_for_inference(out)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], p0[k]) for k in p0)
    return model, cfg, vocab, state


# ---- models and data -------------------------------------------------------------------------------
def assert_grad_close(actual, expected, msg: str = "", **kw) -> None:
    """``torch.testing.assert_close`` of two gradients that must both exist: assert_close itself passes
    when both are None (a parameter no loss reached, e.g. a branch removed from the forward)."""
    import torch

    missing = [w for w, g in (("actual", actual), ("expected", expected)) if g is None]
    assert not missing, f"{msg}: no gradient ({' and '.join(missing)} {'are' if len(missing) > 1 else 'is'} None)"
    torch.testing.assert_close(actual, expected, msg=(lambda m: f"{msg}: {m}") if msg else None, **kw)


def decode_all(m, src, tgt):
    """Logits of every target position by incremental decoding (``encode`` once, ``decode_step`` per token)."""
    import torch

    enc = m.encode(src)
    cache, steps = None, []
    for t in range(tgt.shape[1]):
        logits, cache = m.decode_step(tgt[:, t], t, enc, cache)
        steps.append(logits)
    return torch.stack(steps, 1)


def full_forward_logprob(model, src_row, tag, tokens) -> float:
    """Log-probability of ``tokens`` + EOS after language tag ``tag`` from one full forward pass (float64, the
    ids decoding may emit)."""
    import torch

    from scaletrain.eval.decode_step import allowed_mask
    from scaletrain.vocab import EOS

    with torch.no_grad():
        lp = torch.log_softmax(model(src_row, torch.tensor([[tag] + tokens])).double()[0], -1)
    lp = lp + allowed_mask(lp.shape[-1], "cpu", torch.float64)
    return float(sum(lp[t, tok] for t, tok in enumerate(tokens + [EOS])))


def valid_examples(shards, n: int) -> list:
    """The first ``n`` examples of the valid split with a 3-30 byte source."""
    from scaletrain.data.shards import read_split

    out = []
    for ex in read_split(shards, "valid"):
        if 3 <= len(ex.src) <= 30:
            out.append(ex)
        if len(out) == n:
            break
    return out


def _rank_entry(rank: int, world: int, port: int, fn, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int = 2, *args) -> None:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks in forked processes (the children reuse the
    imported torch); an exception on any rank fails the call."""
    import torch.multiprocessing as mp

    mp.start_processes(_rank_entry, args=(world, free_port(), fn, args), nprocs=world, start_method="fork")


def assert_resume_bitwise(runs: Path, prefix: str, n: int, world: int = 2) -> None:
    """A run stopped after ``n`` updates and resumed (RUNS/PREFIX_half) equals the uninterrupted one
    (RUNS/PREFIX_full): every rank's consolidated parameters bitwise, the second half's losses exactly."""
    import json

    import torch

    for r in range(world):
        a = torch.load(runs / f"{prefix}_full" / f"params_rank{r}.pt")
        b = torch.load(runs / f"{prefix}_half" / f"params_rank{r}.pt")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (r, k)
    full = json.loads((runs / f"{prefix}_full" / "result_rank0.json").read_text())
    res = json.loads((runs / f"{prefix}_half" / "result_rank0.json").read_text())
    assert res["train_loss"] == full["train_loss"][n:]


def start_slow_run(cmd: list[str], env: dict, log: Path, step_seconds: float) -> subprocess.Popen:
    """``cmd`` (a launcher running tests/integration/slow_driver.py, each step ``step_seconds`` longer)
    in a session of its own (so ``os.killpg`` ends all of it), stdout and stderr to ``log``."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, env={**env, "SLOW_STEP_SECONDS": str(step_seconds)}, cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_log(p: subprocess.Popen, log: Path, text: str, timeout: float = 240) -> None:
    """Until ``text`` appears in ``log``; fails with the log's tail if ``p`` exits or time runs out first."""
    import time

    deadline = time.time() + timeout
    while text not in log.read_text():
        assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def launch_checkout(tmp_path: Path) -> Path:
    """A directory ``launch.sh`` runs in as in a checkout of its own (it works from the directory it is in):
    ``launch.sh``, ``scripts/``, ``ds_configs/``, ``pyproject.toml`` and ``.venv`` linked from this
    repository, and nothing else. What the script finds there (the bundled corpus in ``shards/``, runs in
    ``runs/``, the MLflow store ``mlruns.db``) and what it makes is the test's, whatever the repository's own
    checkout holds (a user's runs, a built corpus) and untouched by it."""
    d = tmp_path / "checkout"
    d.mkdir()
    for name in ("launch.sh", "scripts", "ds_configs", "pyproject.toml", ".venv"):
        if (ROOT / name).exists():
            (d / name).symlink_to(ROOT / name)
    return d


def run_launch_sh(args, checkout: Path, env=None, timeout: float = 900) -> subprocess.CompletedProcess:
    """``bash CHECKOUT/launch.sh ARGS`` (``checkout``: :func:`launch_checkout`) with stdout and stderr in one
    byte stream (as a log file gets them); on a timeout the script's whole session (launcher and ranks) is
    killed before the error is raised."""
    import signal
    import time

    p = subprocess.Popen(["bash", str(checkout / "launch.sh"), *args], cwd=checkout, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
                try:
                    if os.getsid(pid) == p.pid:
                        os.kill(pid, sig)
                except OSError:
                    pass
            time.sleep(5)
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, b"")


def make_wheel(folder: Path, name: str, requires: tuple[str, ...] = ()) -> Path:
    """A made-up pure-Python wheel ``<name>-1.0-py3-none-any.whl`` of module ``name`` (``__version__ = '1.0'``) in
    ``folder`` (created), with ``requires`` as its dependencies: what scripts/gpu_wheels.sh brings, in small."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    whl = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info/"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{name}/__init__.py", "__version__ = '1.0'\n")
        z.writestr(info + "METADATA", meta)
        z.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(info + "RECORD", "")
    return whl


# ---- tracking ----------------------------------------------------------------------------------------
def log_toy_checkpoints(tr, root):
    """Through tracker ``tr`` (a ``scaletrain.tracking.Tracker``): a toy corpus as the run's input, checkpoints
    at steps 10 and 20 (directories under ``root``) as logged models with their validation nll, step 10's
    deleted (keep_last) before step 20's is recorded. Returns the dataset."""
    import json
    import shutil

    from scaletrain.tracking.checkpoint_models import CheckpointModels
    from scaletrain.tracking.datasets import corpus_dataset

    man = {"languages": ["de", "en"], "splits": {"train": {"n_examples": 8}, "test": {"n_examples": 2}},
           "source": {"name": "toy"}}
    ds = corpus_dataset(man, json.dumps(man).encode(), root / "shards")
    tr.checkpoint_models = CheckpointModels(prefix="toy", dataset={"name": ds["name"], "digest": ds["digest"]})
    tr.log_input(ds, "train")
    for step, nll in ((10, 3.0), (20, 2.0)):
        (root / f"step-{step:07d}").mkdir(parents=True)
        tr.log_metrics({"valid/nll": nll}, step=step)
        if step == 20:
            shutil.rmtree(root / "step-0000010")
        tr.log_checkpoint(root / f"step-{step:07d}", step)
    return ds


def assert_toy_checkpoint_models(c, rid, ds):
    """What :func:`log_toy_checkpoints` logged is in the store of MLflow client ``c``, each thing once."""
    run = c.get_run(rid)
    assert [(d.dataset.name, d.dataset.digest) for d in run.inputs.dataset_inputs] == [(ds["name"], ds["digest"])]
    models = c.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{rid}'",
                                    order_by=[{"field_name": "metrics.valid/nll", "ascending": True}])
    assert [(m.name, m.tags["scaletrain.checkpoint.exists"], m.tags["scaletrain.best"]) for m in models] == [
        ("toy-step-20", "true", "true"), ("toy-step-10", "false", "false")]
    assert [[(x.key, x.step, x.value, x.dataset_digest) for x in m.metrics] for m in models] == [
        [("valid/nll", 20, 2.0, ds["digest"])], [("valid/nll", 10, 3.0, ds["digest"])]]
    assert sorted(o.step for o in run.outputs.model_outputs) == [10, 20]
    assert sorted((m.step, m.value) for m in c.get_metric_history(rid, "valid/nll")) == [(10, 3.0), (20, 2.0)]


# ---- engines without a launcher --------------------------------------------------------------------
def local_backend_class():
    """``LocalBackend``: a :class:`scaletrain.engine.Backend` for one plain process (torch's backward and our
    AdamW, no library, no process group), so tests run the real :class:`~scaletrain.engine.Engine` (its step,
    schedule, checkpoints) in-process. ``skip``: the updates (1-based) to drop like an fp16 overflow
    (``loss_scaled``: no update, no LR step); ``partitioned``: the answer of ``partitioned()`` (ZeRO-3),
    whose gathered state dict is then the module's; ``fail_with``: an exception its state dict raises (a
    checkpoint save failing inside the engine, as a full disk does)."""
    import torch

    from scaletrain.engine import Backend
    from scaletrain.engine.optim import build_optimizer

    class LocalBackend(Backend):
        name = "local"

        def __init__(self, skip=(), partitioned=False, fail_with=None):
            self.skip, self._partitioned, self.updates, self.micro = set(skip), partitioned, 0, 0
            self.loss_scaled, self.fail_with = bool(skip), fail_with

        def start(self, cfg):
            self.grad_accum = cfg.engine.grad_accum

        def wrap(self, model, ep, cfg):
            self.model = self.module = model
            self.optimizer = build_optimizer(model, cfg)
            return self.optimizer

        def backward(self, loss):
            (loss / self.grad_accum).backward()
            self.micro += 1

        def at_boundary(self):
            return self.micro % self.grad_accum == 0

        def skip_microsteps(self, n):
            self.micro += n + 1  # the failed micro-batch and the n that will not run

        def update(self):
            self.updates += 1
            skipped = self.updates in self.skip
            if not skipped:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return skipped, None

        def skip_update(self):
            self.updates += 1
            self.optimizer.zero_grad(set_to_none=True)

        def partitioned(self):
            return self._partitioned

        def gathered_state_dict(self):
            return {k: v.detach().float().cpu().clone() for k, v in self.module.state_dict().items()}

        def state_dict(self):
            if self.fail_with is not None:
                raise self.fail_with
            return {}

    return LocalBackend


def local_engine(cfg, **backend_kw):
    """The real Engine over ``local_backend_class()`` (world of one, this process)."""
    from scaletrain.engine import Engine

    return Engine(cfg, local_backend_class()(**backend_kw))


def engine_holding(model, **backend_kw):
    """``local_engine`` of the ``small`` recipe set up with ``model`` (any module: checkpoint tests)."""
    from scaletrain.config import load_config

    eng = local_engine(load_config("small", ["engine.compile=false"]), **backend_kw)
    eng.setup(model)
    return eng
