"""Checks that must pass before any process is launched: one clear message, nothing started.

    python -m scaletrain.engine.preflight --config small engine.precision=fp16 ...
    python -m scaletrain.engine.preflight --config small --print-precision   # what auto resolves to here
    python -m scaletrain.engine.preflight --config small --launch-plan ...    # what launch.sh needs, KEY=VALUE
    python -m scaletrain.engine.preflight --config small --init-tracking-store  # a fresh clone's MLflow store

runs the same checks the engines run at start-up (``launch.sh`` calls it once before the launcher).
:func:`check_inputs` (the shard manifest and the output directory) imports neither torch nor any
library of the engines: ``scaletrain train`` runs it right after loading the config, so a wrong path fails
in a second or two instead of after DeepSpeed's start.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from scaletrain.errors import ScaletrainError

BUNDLED_SHARDS = "shards/django"  # what `scaletrain prepare` (no corpus arguments) writes; launch.sh builds it
CATALOGS_SHARDS = "shards/catalogs"  # the catalogs corpus of the catalogs_* recipes (the GPU default job)
# The corpora launch.sh builds when their directory is missing: path -> `scaletrain prepare` arguments. The
# catalogs corpus reads whatever gettext catalogs the machine has (docs/RESULTS.md: the same command).
BUILT_CORPORA = {
    BUNDLED_SHARDS: (),
    CATALOGS_SHARDS: ("--catalogs", "system,packages", "--max-per-lang", "20000", "--max-bytes", "256",
                      "--valid-frac", "0.01", "--test-frac", "0.02", "--spm-vocab-size", "8000"),
}


def built_corpus(path: str, cwd: str | Path | None = None) -> str | None:
    """Which of :data:`BUILT_CORPORA` ``path`` is (``shards/django`` or ``shards/catalogs`` under the working
    directory, however spelled), or None."""
    base = Path(cwd) if cwd is not None else Path.cwd()
    p = Path(path)
    p = (p if p.is_absolute() else base / p).resolve()
    return next((name for name in BUILT_CORPORA if p == (base / name).resolve()), None)


def is_bundled_shards(path: str, cwd: str | Path | None = None) -> bool:
    """True for the bundled corpus' shard directory (``shards/django`` under the working directory)."""
    return built_corpus(path, cwd) == BUNDLED_SHARDS


def shards_problem(cfg) -> str | None:
    """Why ``data.shards`` cannot be trained on (one line), or None. Remote sources (URLs, ``pipe:``) are
    read by the data stream itself."""
    from scaletrain.data.sources import is_remote

    shards = cfg.data.shards
    if is_remote(shards) or str(shards).startswith("pipe:"):
        return None
    how = (f"build shards there with `scaletrain prepare --out {shards} ...` (see `scaletrain prepare --help`; "
           f"the bundled corpus: `scaletrain prepare --out {BUNDLED_SHARDS}`) or fix the path")
    p = Path(shards)
    if not p.is_dir():
        return f"config key 'data.shards': {shards} does not exist; {how}"
    if not (p / "manifest.json").is_file():
        return f"config key 'data.shards': {shards} has no manifest.json (not a prepared shard directory); {how}"
    return None


def check_inputs(cfg) -> None:
    """The shard manifest (present, readable, has the splits training reads; the SentencePiece model of
    ``data.tokenizer: spm``) and the output directory (a directory, or creatable, and writable); one
    ``ScaletrainError`` line naming the key. Touches nothing."""
    problem = shards_problem(cfg)
    if problem:
        raise ScaletrainError(problem)
    from scaletrain.data.sources import is_remote

    shards = cfg.data.shards
    if not (is_remote(shards) or str(shards).startswith("pipe:")):
        from scaletrain.data.shards import load_manifest

        m = load_manifest(shards)
        for split in ("train", "valid"):
            if split not in m.splits:
                raise ScaletrainError(f"config key 'data.shards': {shards}/manifest.json has no {split!r} split "
                                      f"(it has: {', '.join(m.splits) or 'none'}); re-run `scaletrain prepare`")
        if cfg.data.tokenizer == "spm":
            from scaletrain.data.spm_models import find_spm_model

            find_spm_model(shards, cfg.data.spm_vocab_size)
    check_out_dir(cfg.out_dir)


def check_out_dir(out: Path) -> None:
    """``train.out_dir`` is a directory, or can be created as one, and we can write in it: a directory made
    and removed again in it (or in its nearest existing parent) proves both, for root and read-only
    file systems too (``os.access`` says yes to root everywhere)."""
    import tempfile

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ScaletrainError(f"config key 'train.out_dir': {out} exists and is not a directory; choose another "
                              "path (launch.sh: --out DIR)")
    probe = out
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    why = f"{probe} is not a directory" if not probe.is_dir() else None
    if why is None:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".scaletrain-write-check-", dir=probe))
        except OSError as e:
            why = f"{e.strerror or e} in {probe}"
    if why:
        what = "is not writable" if probe == out else "cannot be created"
        raise ScaletrainError(f"config key 'train.out_dir': {out} {what} ({why}); choose another path "
                              "(launch.sh: --out DIR)")


def uses_deepspeed(cfg) -> bool:
    return cfg.engine.backend == "deepspeed" or (cfg.engine.backend == "accelerate" and cfg.engine.accelerate == "deepspeed")


def preflight(cfg, world_size: int = 1, cuda_available: bool | None = None, precision_hw: dict | None = None) -> dict | None:
    """Raise ScaletrainError for a configuration that cannot run here; return the resolved DeepSpeed
    config (or None for plain DDP).

    Resolves ``engine.precision: auto`` in ``cfg`` first (:mod:`scaletrain.engine.precision`;
    ``precision_hw`` injects the hardware facts in tests), so the DeepSpeed config and Accelerate's
    mixed precision get the resolved value."""
    import torch

    from scaletrain.engine.ds_config import load_ds_config
    from scaletrain.engine.precision import apply_precision

    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    apply_precision(cfg, cuda=cuda, **(precision_hw or {}))
    if cfg.engine.precision == "fp16" and not cuda:
        raise ScaletrainError(
            "config key 'engine.precision': fp16 needs a GPU (dynamic loss scaling runs on CUDA) and none is visible; "
            "use engine.precision=bf16 (CPU and recent GPUs) or fp32"
        )
    if world_size < 1:
        raise ScaletrainError(f"world size must be >= 1, got {world_size}")
    if uses_deepspeed(cfg):
        return load_ds_config(cfg, world_size)
    return None


def init_tracking_store(cfg, project_dir: str | Path) -> Path | None:
    """Create the run's local MLflow SQLite store if it does not exist yet, so that rank 0 finds it ready:
    on a fresh clone MLflow's schema migrations take 3-10 s (2-core CPU, idle to busy), which ``launch.sh``
    runs in the background beside the corpus preparation and the launcher's start instead of on the way to
    the first step. The store is built under a temporary name and hard-linked into place only if the path is
    still free: a rank that got there first keeps its own, and a killed build leaves no half-made store.
    Returns the store's path, or None when there was nothing to do (tracking off, not a local SQLite URI,
    the store exists)."""
    if not cfg.tracking.enabled:
        return None
    from scaletrain.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(cfg.tracking.uri or None, project_dir)
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return None
    db = Path(uri[len("sqlite:///"):])
    db = db if db.is_absolute() else Path(project_dir) / db
    if db.exists():
        return None
    db.parent.mkdir(parents=True, exist_ok=True)
    for stale in db.parent.glob(f".{db.name}.init-*"):  # left by a killed build
        pid = stale.name.rsplit("-", 1)[-1]
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            stale.unlink(missing_ok=True)
    tmp = db.with_name(f".{db.name}.init-{os.getpid()}")
    try:
        from mlflow import MlflowClient

        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments(max_results=1)
        try:
            os.link(tmp, db)
        except FileExistsError:
            return None
    finally:
        tmp.unlink(missing_ok=True)
    return db


def launch_plan(cfg, world_size: int, local_ranks: int | None = None) -> dict[str, str]:
    """What ``launch.sh`` needs before it starts the launcher, after every check: ``prepare=1`` and the
    ``prepare_args`` of ``scaletrain prepare`` where the shards are one of :data:`BUILT_CORPORA` and not built
    yet (any other missing path is an error)."""
    import torch

    problem = shards_problem(cfg)
    corpus = built_corpus(cfg.data.shards)
    prepare = problem is not None and corpus is not None
    if problem and not prepare:
        raise ScaletrainError(problem)
    if prepare:
        check_out_dir(cfg.out_dir)
    else:
        check_inputs(cfg)
    preflight(cfg, world_size)
    from scaletrain.threads import CpuBudget, plan_threads

    threads, _ = plan_threads(CpuBudget.detect(), local_ranks=max(1, local_ranks or world_size))  # per rank
    plan = {"shards": str(cfg.data.shards), "prepare": str(int(prepare)),
            "prepare_args": " ".join(BUILT_CORPORA[corpus]) if prepare else "", "precision": cfg.engine.precision,
            "threads": str(cfg.engine.threads or threads),
            "backend": cfg.engine.backend, "accelerate": cfg.engine.accelerate, "out_dir": str(cfg.out_dir),
            "cuda": str(int(torch.cuda.is_available()))}
    if uses_deepspeed(cfg):
        from scaletrain.engine.ds_config import resolve_ds_config_path

        plan["ds_json"] = str(resolve_ds_config_path(cfg.engine.ds_config))
    bad = [k for k, v in plan.items() if "\n" in v]
    if bad:
        raise ScaletrainError(f"config key {bad[0]!r}: a line break in a path is not supported")
    return plan


def main(argv: list[str] | None = None) -> int:
    from scaletrain.config import load_config
    from scaletrain.console import quiet_libraries, verbose_from_env

    quiet_libraries(verbose_from_env())  # stdout is launch.sh's to parse; MLflow's store start says nothing

    ap = argparse.ArgumentParser(prog="python -m scaletrain.engine.preflight")
    ap.add_argument("--config", default="small")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--local-ranks", type=int, default=0, help="ranks on this node (default: the world size)")
    ap.add_argument("--print-precision", action="store_true",
                    help="print the resolved engine.precision on stdout (launch.sh exports it to every rank)")
    ap.add_argument("--launch-plan", action="store_true",
                    help="check the shards and the output directory too, and print KEY=VALUE lines for launch.sh")
    ap.add_argument("--init-tracking-store", action="store_true",
                    help="create the run's local MLflow store if missing (launch.sh runs it in the background)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.init_tracking_store:
            init_tracking_store(cfg, os.getcwd())
            return 0
        plan = launch_plan(cfg, args.world_size, args.local_ranks) if args.launch_plan else None
        if plan is None:
            preflight(cfg, args.world_size)
    except ScaletrainError as e:
        print(f"scaletrain: error: {e}", file=sys.stderr)
        return 2
    if plan is not None:
        print("".join(f"{k}={v}\n" for k, v in plan.items()), end="")
    elif args.print_precision:
        print(cfg.engine.precision)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
