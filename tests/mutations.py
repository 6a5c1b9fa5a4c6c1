"""Planted faults: what the suite must catch, checked on demand (not a test module; pytest does not collect it).

Each fault is a small, realistic bug planted in one source file (an exact text replaced by another) together
with the tests that guard against it. For every selected fault the script makes a copy of this checkout (a
``git clone --shared`` with the working tree's uncommitted changes laid over it and this checkout's ``.venv``
linked in), plants the fault there, checks that the copy's ``scaletrain`` is the one imported, runs the
guarding tests in the copy, and reports CAUGHT (a test failed) or MISSED (all passed). ``--clean`` runs the
same tests unplanted first: they must pass, else a CAUGHT would mean nothing. The planted text must occur
exactly once: a refactor that moves the code makes the fault fail loudly here, to be updated, instead of
silently planting nothing.

    .venv/bin/python tests/mutations.py --list
    .venv/bin/python tests/mutations.py --clean --md docs/TESTING-run.md        # every fault
    .venv/bin/python tests/mutations.py resume-rng safeload-weights-only         # some

Exit status 0 when every fault was caught (and, with ``--clean``, every clean run passed), else 1.
Why a script of our own rather than a mutation-testing tool (mutmut, cosmic-ray): those generate thousands of
operator-level mutants and run the whole suite per mutant; what is wanted here is a short, named list of the
faults this project promises to catch (one per area at least), each against the few launched tests that guard
it, in minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Fault:
    name: str
    area: str
    file: str  # relative to the repository root
    old: str  # exact text, found exactly once
    new: str
    tests: tuple[str, ...]  # pytest node ids (relative to the root) that must fail with the fault planted
    what: str


FAULTS = (
    Fault("resume-rng", "exact resume", "scaletrain/checkpoint/manager.py",
          '            set_rng_state(rank_state.pop("rng"))\n',
          '            rank_state.pop("rng")\n',
          ("tests/integration/test_checkpoint_resume.py::test_resume_is_bitwise_identical_two_ranks",),
          "a resume at the same layout does not restore the RNG states (dropout differs after the resume)"),
    Fault("resume-data-position", "exact resume", "scaletrain/train/trainer.py",
          '            self.stream.load_state_dict(loaded.rank_states[0]["stream"])\n',
          '            pass\n',
          ("tests/integration/test_stop_resume_exact.py",),
          "a resume reads the shards from their start instead of where the checkpoint stopped"),
    Fault("ddp-grad-accum", "engine equivalence", "scaletrain/engine/env.py",
          "        gradient_accumulation_steps=cfg.engine.grad_accum,\n",
          "        gradient_accumulation_steps=1,\n",
          ("tests/integration/test_engine_equivalence.py",),
          "Accelerate DDP sums the micro-batches' gradients instead of averaging them (engine.grad_accum > 1)"),
    Fault("ep-expert-reduce", "expert-parallel equivalence", "scaletrain/parallel/grads.py",
          "        dist.all_reduce(flat, group=group)\n",
          "        pass\n",
          ("tests/unit/test_parallel_grads.py",),
          "expert gradients are not reduced over their expert-data-parallel group"),
    Fault("nonfinite-skip", "non-finite skip", "scaletrain/engine/optim.py",
          "    optimizer.found_inf = flag.to(device)",
          "    optimizer.found_inf = torch.zeros_like(flag).to(device)",
          ("tests/unit/test_device_skip.py", "tests/integration/test_nonfinite.py"),
          "an update with a non-finite gradient is applied instead of withheld"),
    Fault("preemption-signal", "preemption", "scaletrain/train/preemption.py",
          "        first = self.signum is None\n        self.signum = signum\n",
          "        first = self.signum is None\n",
          ("tests/unit/test_preemption.py",),
          "a SIGTERM/SIGINT/SIGUSR1 is swallowed: no checkpoint at the next step boundary, no exit 75"),
    Fault("safeload-weights-only", "safe loading", "scaletrain/safeload.py",
          "            return _orig_torch_load(f, map_location=map_location, weights_only=True)\n",
          "            return _orig_torch_load(f, map_location=map_location, weights_only=False)\n",
          ("tests/unit/test_safeload.py", "tests/integration/test_checkpoint_safe_loading.py"),
          "checkpoint files are unpickled with code execution allowed"),
    Fault("tracking-no-retry", "tracking outage", "scaletrain/tracking/sender.py",
          "                if not _permanent(e):\n",
          "                if False:\n",
          ("tests/unit/test_tracking_sender.py",),
          "an operation the MLflow server could not take (server down) is dropped instead of retried"),
    Fault("layout-moments-torch", "resume at another layout", "scaletrain/engine/engine.py",
          "                st[k].copy_(v.reshape(p.shape))\n",
          "                pass\n",
          ("tests/integration/test_resume_any_layout.py::test_resume_on_the_other_engine_carries_the_state",),
          "a resume at another layout onto torch's optimizer (DDP, ZeRO-0) drops the Adam moments"),
    Fault("layout-moments-deepspeed", "resume at another layout", "scaletrain/engine/deepspeed_backend.py",
          "                safe_set_full_optimizer_state(p, v.float(), k)\n",
          "                pass\n",
          ("tests/integration/test_resume_any_layout.py::test_resume_on_the_other_engine_carries_the_state",),
          "a resume at another layout onto DeepSpeed ZeRO-1/2/3 drops the Adam moments"),
    Fault("oom-recognised", "OOM line", "scaletrain/oom.py",
          "    if isinstance(e, (OutOfMemory, MemoryError)):\n",
          "    if isinstance(e, OutOfMemory):\n",
          ("tests/unit/test_oom_lines.py",),
          "a host MemoryError is not recognised as out of memory (a traceback instead of the one line)"),
    Fault("browser-source", "MLflow UI (browser)", "scaletrain/tracking/provenance.py",
          '    tags = {SOURCE_NAME: command, "mlflow.source.type": "LOCAL", "mlflow.user": user_name()}\n',
          '    tags = {"mlflow.source.type": "LOCAL", "mlflow.user": user_name()}\n',
          ("tests/integration/test_tracking_browser.py",),
          "runs carry no source command: the UI's Source column and run page lose 'scaletrain train'"),
    Fault("browser-commit", "MLflow UI (browser)", "scaletrain/tracking/provenance.py",
          '            tags[f"mlflow.source.git.{tag}"] = git[key]\n',
          '            pass\n',
          ("tests/integration/test_tracking_browser.py",),
          "runs carry no git commit, branch or repository (the UI shows no commit beside the source)"),
    Fault("layout-change-said", "resume at another layout", "scaletrain/checkpoint/engine_state.py",
          "        say_layout_change(engine, ckpt, saved, \"the engine's own files, resharded where needed\")\n",
          "        pass\n",
          ("tests/unit/test_checkpoint_engine_state.py",),
          "a resume at another precision or world size through the engine's own files says nothing of the change"),
    Fault("nonfinite-host-skip", "non-finite skip", "scaletrain/engine/engine.py",
          "            if not math.isfinite(norm):\n                b.skip_update()\n",
          "            if not math.isfinite(norm):\n                b.update()\n",
          ("tests/unit/test_engine_backends.py::test_without_a_fused_optimizer_the_norm_is_read_on_the_host",),
          "where the norm is checked on the host (optim.fused=false, expert parallelism), a non-finite update is applied"),
    Fault("ep-exchange-backward", "expert-parallel equivalence", "scaletrain/parallel/exchange.py",
          "        dist.all_to_all_single(out, grad, input_splits, output_splits, group=ctx.group)\n",
          "        dist.all_to_all_single(out, grad, input_splits, input_splits, group=ctx.group)\n",
          ("tests/unit/test_parallel_exchange.py", "tests/unit/test_moe_expert_parallel.py"),
          "the expert exchange's backward sends gradients with the forward's splits (wrong rows, wrong ranks)"),
    Fault("oom-marker-case", "OOM line", "scaletrain/oom.py",
          "any(m in str(e).lower() for m in _RUNTIME_MARKERS)",
          "any(m in str(e) for m in _RUNTIME_MARKERS)",
          ("tests/unit/test_oom_lines.py",),
          "an allocator message in capitals (CUBLAS_STATUS_ALLOC_FAILED) is not recognised as out of memory"),
    Fault("browser-dataset-context", "MLflow UI (browser)", "scaletrain/tracking/datasets.py",
          "    return DatasetInput(entity, tags=[InputTag(CONTEXT_TAG, context)])\n",
          "    return DatasetInput(entity, tags=[])\n",
          ("tests/integration/test_tracking_browser.py",),
          "the corpus is logged without its train / validation context (the run page's Datasets lose 'train')"),
    Fault("launch-one-voice", "many hosts", "launch.sh",
          'if [[ "$node_rank" != 0 ]]; then  # one voice per job',
          'if [[ "$node_rank" == none ]]; then  # one voice per job',
          ("tests/integration/test_multi_host.py::test_launch_sh_no_ssh_one_launcher_per_host",),
          "every node prints the end-of-job summary and the commands to try next"),
    Fault("netif-route", "many hosts", "scaletrain/engine/netif.py",
          "    src = route_source(master)\n",
          "    src = None\n",
          ("tests/integration/test_multi_host.py::test_own_name_on_127_0_1_1_still_trains",),
          "no interface is chosen: a host whose own name resolves to 127.0.1.1 advertises it and the job hangs"),
    Fault("heartbeat-off", "lost host", "scaletrain/engine/heartbeat.py",
          "    if world_size == 1 or timeout_s <= 0 or not dist.is_initialized():\n",
          "    if True:\n",
          ("tests/integration/test_lost_peer.py::test_a_rank_that_stops_answering_is_found_by_the_heartbeat_within_peer_timeout",),
          "no heartbeat: a rank that stops answering holds the job until the collective timeout (10 min)"),
    Fault("rendezvous-unbounded", "many hosts", "scaletrain/engine/rendezvous.py",
          "    if timeout_s > 0:\n",
          "    if False:\n",
          ("tests/unit/test_rendezvous.py",
           "tests/integration/test_multi_host.py::test_a_wrong_interface_stops_both_hosts_within_the_rendezvous_bound"),
          "the start of the process group is not bounded: a wrong interface holds every host for the collective timeout"),
    Fault("elastic-shared-store", "elastic restart", "launch.sh",
          "  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n",
          "  :\n",
          ("tests/integration/test_elastic_restart.py",),
          "launch.sh --elastic leaves torch's rendezvous store shared: a node that comes back cannot join (the new round times out)"),
    Fault("elastic-experts-own-shard", "elastic restart", "scaletrain/checkpoint/experts.py",
          "        _load_own_shard(ckpt_dir, named, optimizer, ctx)\n        return\n",
          "        return\n",
          ("tests/integration/test_elastic_restart.py::test_accelerate_ddp_with_expert_parallelism_restarts_on_the_survivor_with_its_experts",),
          "a resume at the checkpoint's moe.ep_size keeps the experts the engine's files hold (EP rank 0's) on every rank"),
    Fault("elastic-grad-accum", "elastic restart", "scaletrain/train/global_batch.py",
          "    cfg.engine.grad_accum = plan.grad_accum\n",
          "    pass\n",
          ("tests/integration/test_elastic_restart.py::test_accelerate_ddp_with_expert_parallelism_restarts_on_the_survivor_with_its_experts",),
          "grad_accum is planned but not used: a job restarted on fewer ranks trains a smaller global batch"),
)


def _copy_checkout(dest: Path) -> None:
    """``dest``: this checkout as it is now (HEAD plus uncommitted and untracked, not ignored, files)."""
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(dest)], check=True)
    changed = subprocess.run(["git", "diff", "--name-only", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.split()
    for rel in changed + untracked:
        src, dst = ROOT / rel, dest / rel
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        elif dst.exists():
            dst.unlink()
    (dest / ".venv").symlink_to(ROOT / ".venv")


def _plant(copy: Path, fault: Fault) -> None:
    path = copy / fault.file
    text = path.read_text()
    n = text.count(fault.old)
    if n != 1:
        raise SystemExit(f"mutations.py: fault {fault.name}: its text occurs {n} times in {fault.file} (must be once); "
                         "update the fault to the code as it is now")
    path.write_text(text.replace(fault.old, fault.new))


def _env(copy: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(PYTHONPATH=str(copy), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONDONTWRITEBYTECODE="1")
    return env


def _check_import(copy: Path, env: dict) -> None:
    """The copy's scaletrain, not this checkout's (the .venv's editable install points here): in the copy, in a
    process started elsewhere with the same environment (a launched rank), and through the ``scaletrain``
    console script (what ``launch.sh`` and the CLI tests start: a path on PYTHONPATH comes before the editable
    install's finder, checked here rather than assumed)."""
    probe = [sys.executable, "-c", "import scaletrain; print(scaletrain.__file__)"]
    places = {"in the copy": subprocess.run(probe, cwd=copy, env=env, capture_output=True, text=True,
                                            check=True).stdout.strip(),
              "from another directory": subprocess.run(probe, cwd=tempfile.gettempdir(), env=env, capture_output=True,
                                                       text=True, check=True).stdout.strip()}
    script = Path(sys.executable).parent / "scaletrain"
    if script.exists():  # python -v names the file each module's code object comes from
        err = subprocess.run([sys.executable, "-v", str(script), "--help"], cwd=tempfile.gettempdir(), env=env,
                             capture_output=True, text=True, timeout=300).stderr
        loaded = [ln.split(" from ", 1)[1].strip() for ln in err.splitlines()
                  if ln.startswith("# code object from ") and ln.rstrip().endswith("scaletrain/cli.py")]
        places["through the console script"] = loaded[0] if loaded else "(scaletrain.cli not loaded)"
    for how, where in places.items():
        if not where.startswith(str(copy)):
            raise SystemExit(f"mutations.py: {how}, scaletrain is imported from {where}, not from {copy}")


def _run_tests(fault: Fault, plant: bool, timeout: int) -> tuple[str, float, str]:
    """(result, seconds, the last lines of pytest's output) of the fault's tests in a fresh copy."""
    with tempfile.TemporaryDirectory(prefix=f"mutation-{fault.name}-") as tmp:
        copy = Path(tmp) / "repo"
        _copy_checkout(copy)
        if plant:
            _plant(copy, fault)
        env = _env(copy)
        _check_import(copy, env)
        t0 = time.monotonic()
        try:
            p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                                *fault.tests], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out = -1, f"timed out after {timeout} s\n{e.stdout or ''}"
        secs = time.monotonic() - t0
    tail = "\n".join(ln for ln in out.splitlines() if ln.strip())[-600:]
    if rc == 0:
        return ("MISSED" if plant else "passes"), secs, tail
    if rc == 1 or rc < -1:  # tests failed, or the test process was killed (a signal the fault let through)
        return ("CAUGHT" if plant else "FAILS"), secs, tail
    return f"ERROR (pytest exit {rc})", secs, tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="faults to plant (default: all)")
    ap.add_argument("--list", action="store_true", help="list the faults and their tests, plant nothing")
    ap.add_argument("--clean", action="store_true", help="first run each fault's tests without it: they must pass")
    ap.add_argument("--md", type=Path, help="also write the table as markdown to this file")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per pytest run")
    args = ap.parse_args(argv)
    by_name = {f.name: f for f in FAULTS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; --list shows them")
    faults = [by_name[n] for n in args.names] or list(FAULTS)
    if args.list:
        for f in faults:
            print(f"{f.name:26} {f.area:28} {f.file}\n{'':26} {f.what}\n{'':26} tests: {' '.join(f.tests)}")
        return 0
    rows, ok = [], True
    for f in faults:
        clean = ""
        if args.clean:
            clean, csecs, ctail = _run_tests(f, plant=False, timeout=args.timeout)
            ok &= clean == "passes"
            if clean != "passes":
                print(f"{f.name}: the tests fail without the fault:\n{ctail}", flush=True)
        result, secs, tail = _run_tests(f, plant=True, timeout=args.timeout)
        ok &= result == "CAUGHT"
        print(f"{f.name:26} {result:8} {secs:6.0f} s  clean: {clean or '-'}", flush=True)
        if result != "CAUGHT":
            print(tail, flush=True)
        rows.append((f, result, secs, clean))
    table = ["| fault | area | what is planted | guarding tests | result | seconds | clean run |",
             "|---|---|---|---|---|---|---|"]
    for f, result, secs, clean in rows:
        tests = "<br>".join(f"`{t}`" for t in f.tests)
        table.append(f"| `{f.name}` | {f.area} | {f.what} (`{f.file}`) | {tests} | {result} | {secs:.0f} | {clean or '-'} |")
    print("\n".join(table))
    if args.md:
        args.md.write_text("\n".join(table) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
