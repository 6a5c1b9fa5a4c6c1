"""Soak test of a long job (not in CI): 2-rank training under the ``deepspeed`` launcher with
random faults, resumed after each one by re-running the same command, then checked against an uninterrupted run.

    python benchmarks/soak.py --minutes 20 --faults 10          # the full soak: 20 minutes, 10 faults
    python benchmarks/soak.py --minutes 4 --faults 3 --seed 1   # a quick look

Faults (random order and times, each kind at least once when --faults >= 3):
  kill_rank   SIGKILL of one random rank: the other stops naming it, the job is re-run and resumes
  term_group  SIGTERM to the job's process group (scheduler preemption): checkpoint, exit 75, re-run
  tracking    the MLflow server (``mlflow server`` on 127.0.0.1, SQLite) is killed for 5-30 s while training goes on

Phases: (1) an uninterrupted reference run of the same job, bounded by ``train.max_minutes`` (40% of --minutes
of training time), fixes the number of steps S; (2) the soaked job trains to S steps while the faults are
injected at random steps spread over 0.05-0.9 S (so it takes the reference's time plus ~20 s per restart); (3) ``scaletrain tracking sync`` uploads anything the server missed. Passes when the final weights equal
the reference's bit for bit, the run is FINISHED, and every step 1..S has each train/ metric exactly once in
MLflow. Writes SOAK_DIR/soak_report.json and prints a summary; exit 0 = pass.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LANGS = ["de", "ru", "ar", "hi", "ja"]
JOB = ["model.d_model=128", "model.n_heads=4", "model.encoder_layers=2", "model.decoder_layers=2", "model.ffn_dim=256",
       "model.max_positions=64", "model.dropout=0.1", "data.max_bytes=40", "data.max_tokens=600", "optim.lr=3e-3",
       "optim.warmup_steps=20", "train.log_every=1", "train.valid_every=50", "train.valid_max_batches=2",
       "train.save_every=0", "train.save_every_minutes=0.1", "train.keep_last=3", "engine.precision=fp32",
       "engine.threads=1", "tracking.enabled=true", "tracking.end_timeout=5", "tracking.experiment=soak"]
KINDS = ("kill_rank", "term_group", "tracking")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mlflow server`` on 127.0.0.1 with a SQLite store; stop() kills it, start() brings it back (same port)."""

    def __init__(self, root: Path):
        self.root, self.port, self.proc = root, free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise SystemExit("soak: mlflow server did not start; see " + str(self.root / "server.log"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None


class Job:
    """One session of the soaked job: the same command every time (a user re-running it after a fault)."""

    def __init__(self, args, out: Path, shards: Path, uri: str, steps: int, extra: list[str], session: int):
        self.out = out
        self.log = out.parent / f"{out.name}-session{session:02d}.log"
        cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "--no_local_rank",
               "--module", "scaletrain", "train", "--config", "small", *JOB, f"data.shards={shards}",
               f"train.out_dir={out}", f"train.max_steps={steps}", f"tracking.uri={uri}", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.t0 = time.monotonic()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def last_step(self) -> int:
        steps = [int(line.split("step")[1].split("|")[0]) for line in self.text().splitlines()
                 if "| loss" in line and "step" in line]
        return max(steps, default=-1)

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the job's rank processes."""
        import psutil

        out = {}
        try:
            for c in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    env = c.environ()
                    if "RANK" in env and "scaletrain" in " ".join(c.cmdline()):
                        out[int(env["RANK"])] = c.pid
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        return out

    def wait_gone(self, pids, timeout: float) -> None:
        """Wait for the runner and the given rank processes, then remove whatever is left of the group."""
        import psutil

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            if self.proc.poll() is not None and not alive:
                break
            time.sleep(0.2)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def latest_step(out: Path) -> int:
    f = out / "checkpoints" / "latest"
    try:
        return int(f.read_text().strip().split("-")[1])
    except (OSError, IndexError, ValueError):
        return -1


def prepare(shards: Path) -> None:
    if (shards / "manifest.json").is_file():
        return
    from scaletrain.prepare import prepare_gettext

    prepare_gettext(package="django", langs=LANGS, out=shards, progress=False)


def reference(args, root: Path, shards: Path, server: Server) -> tuple[int, float]:
    out = root / "reference"
    t0 = time.monotonic()
    job = Job(args, out, shards, server.uri, 10**7,
              [f"train.max_minutes={args.minutes * 0.4:.3f}", "tracking.experiment=soak-reference"], 0)
    rc = job.proc.wait()
    if rc != 0:
        raise SystemExit(f"soak: the reference run failed ({rc}); see {job.log}")
    state = json.loads((out / "train_summary.json").read_text())
    return int(state["steps"]), time.monotonic() - t0


def inject(kind: str, job: Job, server: Server, rng: random.Random) -> dict:
    ev = {"kind": kind, "at_step": job.last_step(), "t": round(time.monotonic() - job.t0, 1)}
    if kind == "tracking":
        down = rng.uniform(5, 30)
        server.stop()
        time.sleep(down)
        server.start()
        ev["down_s"] = round(down, 1)
        return ev
    ranks = job.ranks()
    t0 = time.monotonic()
    if kind == "kill_rank":
        r = rng.choice(sorted(ranks))
        os.kill(ranks[r], signal.SIGKILL)
        ev["rank"] = r
    else:
        os.killpg(job.proc.pid, signal.SIGTERM)
    job.wait_gone(list(ranks.values()), timeout=60)
    ev["stopped_in_s"] = round(time.monotonic() - t0, 1)
    text = job.text()
    if kind == "kill_rank":
        ev["line_names_dead_rank"] = f"rank {ev['rank']} (pid {ranks[ev['rank']]} on" in text
    else:
        ev["preempted_json"] = (job.out / "preempted.json").is_file()
    return ev


def soak(args, root: Path, shards: Path, server: Server, steps: int) -> tuple[list[dict], int]:
    """The faulted job. Each fault comes when the job's log first shows a random step between the current one
    and 0.9 S (a share of what is left per fault still to come) and, for kills and preemptions, once this session
    wrote a checkpoint: every fault lands while the job runs, whatever the machine's speed."""
    rng = random.Random(args.seed)
    kinds = list(KINDS[: min(args.faults, 3)]) + [rng.choice(KINDS) for _ in range(args.faults - 3)]
    rng.shuffle(kinds)
    n = len(kinds)
    out = root / "soaked"
    session = 1
    job = Job(args, out, shards, server.uri, steps, [], session)
    events: list[dict] = []
    for i, kind in enumerate(kinds):
        cur = max(job.last_step(), int(steps * 0.05))  # the next fault: a random share of what is left to 0.9 S
        target = cur + int(max(0, int(steps * 0.9) - cur) * rng.uniform(0.3, 0.9) / (n - i))
        start_ckpt = latest_step(out)
        # a kill or preemption waits for a checkpoint written by this session too: each session makes progress
        while job.proc.poll() is None and job.last_step() < steps and (
                job.last_step() < target or (kind != "tracking" and latest_step(out) <= start_ckpt)):
            time.sleep(0.2)
        if kind != "tracking":
            time.sleep(rng.uniform(0, 5))  # land anywhere in the checkpoint interval: steps get re-done
        if job.proc.poll() is not None or job.last_step() >= steps:
            break  # the job finished training before this fault: fewer faults (the report says so)
        ev = inject(kind, job, server, rng)
        events.append(ev)
        print(f"soak: fault {len(events)}/{n}: {ev}", flush=True)
        if kind != "tracking":
            session += 1
            job = Job(args, out, shards, server.uri, steps, [], session)
    rc = job.proc.wait()
    if rc != 0:
        raise SystemExit(f"soak: the last session failed ({rc}); see {job.log}")
    return events, session


def check(root: Path, server: Server, steps: int) -> dict:
    import torch
    from mlflow import MlflowClient

    from scaletrain.checkpoint import load_model_weights

    ref, soaked = root / "reference" / "checkpoints", root / "soaked" / "checkpoints"
    tag = f"step-{steps:07d}"
    a = load_model_weights(ref / (ref / "latest").read_text().strip())
    b = load_model_weights(soaked / tag)
    identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sync = subprocess.run([sys.executable, "-m", "scaletrain", "tracking", "sync", str(root / "soaked")], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    run_id = json.loads((root / "soaked" / "tracking" / "run.json").read_text())["run_id"]
    c = MlflowClient(server.uri)
    run = c.get_run(run_id)
    runs = c.search_runs([run.info.experiment_id])  # one job = one run, whatever the restarts
    keys = sorted(k for k in run.data.metrics if k.startswith("train/") and k not in ("train/seconds", "train/steps"))
    problems = {}
    for k in keys:
        hist = [m.step for m in c.get_metric_history(run_id, k)]
        want = list(range(1, steps + 1))
        if sorted(hist) != want:
            missing = sorted(set(want) - set(hist))
            dup = sorted({s for s in hist if hist.count(s) > 1})
            problems[k] = {"points": len(hist), "missing": missing[:20], "n_missing": len(missing),
                           "duplicated": dup[:20], "n_duplicated": len(dup)}
    return {"bit_identical": identical, "sync_rc": sync.returncode, "sync_out": (sync.stdout + sync.stderr)[-500:],
            "run_status": run.info.status, "runs_in_experiment": {r.info.run_id: r.info.status for r in runs},
            "metric_keys": len(keys), "metric_problems": problems}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock length to aim for (default 20)")
    ap.add_argument("--faults", type=int, default=10, help="faults to inject (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="runs/soak", help="work directory (default runs/soak; emptied first)")
    ap.add_argument("--shards", default="", help="shard directory (default: the Django corpus prepared in --dir)")
    args = ap.parse_args(argv)
    import shutil

    root = Path(args.dir).resolve()
    shards = Path(args.shards).resolve() if args.shards else root.parent / "soak-shards"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    prepare(shards)
    os.environ.setdefault("SCALETRAIN_AUTO_PRECISION", "fp32")
    server = Server(root / "mlflow")
    server.start()
    t0 = time.monotonic()
    try:
        steps, ref_s = reference(args, root, shards, server)
        print(f"soak: reference run: {steps} steps in {ref_s:.0f}s", flush=True)
        events, sessions = soak(args, root, shards, server, steps)
        result = check(root, server, steps)
    finally:
        server.stop()
    faults_ok = all(e.get("line_names_dead_rank", True) and e.get("preempted_json", True) for e in events)
    report = {"minutes": round((time.monotonic() - t0) / 60, 2), "steps": steps, "reference_s": round(ref_s, 1),
              "faults": events, "sessions": sessions, **result}
    report["passed"] = bool(result["bit_identical"] and not result["metric_problems"] and faults_ok
                            and result["run_status"] == "FINISHED" and len(result["runs_in_experiment"]) == 1
                            and len(events) == args.faults)
    (root / "soak_report.json").write_text(json.dumps(report, indent=1))
    kinds = {k: sum(e["kind"] == k for e in events) for k in KINDS}
    print(f"soak: {report['minutes']} min, {len(events)} faults {kinds}, {sessions} sessions, {steps} steps; "
          f"bit-identical {result['bit_identical']}; run {result['run_status']}; metric problems "
          f"{ {k: (v['n_missing'], v['n_duplicated']) for k, v in result['metric_problems'].items()} or 'none'}; "
          f"{'PASS' if report['passed'] else 'FAIL'} ({root / 'soak_report.json'})", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
