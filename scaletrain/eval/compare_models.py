"""The papers' comparison at equal time (``scaletrain compare-models``).

Trains each model for the same minutes on the same shards, one process per model, evaluates each on the
held-out test split and writes ``scaletrain compare``'s table and plot into one folder::

    OUT/plan.json                       the settings every model shares (checked on a re-run) and the
                                        precision that engine.precision: auto means for all of them
    OUT/recipes/NAME.yaml               the recipe of a model without a packaged catalogs_NAME recipe
    OUT/runs/NAME-sSEED/                each training run (checkpoints, train.log, train_summary.json,
                                        eval.log, eval_test.json, eval/test/{src,ref,hyp}.*.txt)
    OUT/mlruns.db                       the MLflow store of these runs
    OUT/compare.{md,csv,json,png}       compare's table (config keys that differ, parameters, steps, valid
                                        nll, test BLEU/chrF per group, tokens/s; a run that failed as a
                                        column of its own, its reason in the row "failed") and its plot
    OUT/compare.plot.json               the plot's numbers and structure

Models are named by recipe: ``base`` runs the packaged ``catalogs_base`` (a model recipe plus
``overlays/catalogs.yaml``: the shards, token budget, precision, schedule, budget and evaluation settings
every model shares); a recipe without a catalogs_ twin (``msha``, ``moce_d6``) gets the same overlay
through ``OUT/recipes/NAME.yaml`` (``base: [NAME, overlays/catalogs]``). Every run gets the same overrides:
``train.max_minutes`` (``--minutes``), the size preset (``--size``), ``--set KEY=VALUE``, the shards, the seed,
its own ``train.out_dir`` and the folder's MLflow store.

Resumable: a run whose ``train_summary.json`` says it finished is not trained again (an interrupted one
resumes from its latest checkpoint: ``train.max_minutes`` is a budget for the whole job); an evaluation
whose ``eval_test.json`` exists is not run again; a table or plot already written is never overwritten
(a different one goes to ``compare-N.*``). A run that fails is reported, shown in the table as failed with
its reason, and the others go on; a re-run retries it. SIGINT (Ctrl-C) or SIGTERM stops the command: the
running training gets SIGTERM, checkpoints at its next step boundary and exits (an evaluation is stopped;
its result is written only when complete), no other run starts, and a re-run resumes. Exit codes: 0 every
run trained and evaluated, 1 some run failed (the others are kept and in the table), 2 bad input (nothing
ran), 128 + the signal number when interrupted (130 for SIGINT, 143 for SIGTERM).

Why a subcommand and not a script under ``benchmarks/``: it must work from an installed wheel (recipes
and overlays are package data), share ``scaletrain``'s one-line errors and ``--help``, and it is a
user-facing workflow (the papers' orderings at a scale a user can run), not a measurement of our code.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from scaletrain.errors import ScaletrainError

DEFAULT_MODELS = ("base", "embeddingless", "byte_ncf", "msc", "moce_d5_lid", "subword_cg")
REFERENCE = "base"  # the byte Transformer: trained with --base-seeds (two seeds by default)
EXPERIMENT = "compare-models"
TABLE_FILES = ("compare.md", "compare.csv", "compare.json", "compare.png", "compare.plot.json")

#: Size presets: d_model, ffn_dim, encoder = decoder layers, tokens per update, warm-up, validation batches,
#: and a logging interval short enough for the throughput rows of the table (tokens/s is logged every
#: train.log_every steps; the overlay's 100 is more than a CPU run of a few minutes makes).
#: d_model stays >= 320 so the one-hot models (Embeddingless, Byte-nCF: V <= d) fit ~60 languages; heads
#: are each recipe's own (MSC's 8 kernels are one per head). "paper" keeps the recipes' sizes (d 512, 6+6).
SIZES: dict[str, dict | None] = {
    "paper": None,
    "small": {"d_model": 320, "ffn_dim": 1280, "layers": 3, "max_tokens": 4096, "warmup": 200, "valid_batches": 8,
              "log_every": 20},
    "tiny": {"d_model": 320, "ffn_dim": 640, "layers": 2, "max_tokens": 2048, "warmup": 50, "valid_batches": 4,
             "log_every": 5},
}
PLAN_KEYS = ("minutes", "size", "set", "shards", "beam", "eval_lines")


@dataclass(frozen=True)
class ModelRun:
    model: str  # the name the user gave (a recipe name)
    seed: int
    recipe: str  # what `train --config` gets: a packaged recipe or OUT/recipes/NAME.yaml

    @property
    def name(self) -> str:
        return f"{self.model}-s{self.seed}"


def parse_seeds(text: str, flag: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ScaletrainError(f"{flag}: give comma-separated integers, e.g. 1,2 (got {text!r})") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ScaletrainError(f"{flag}: give distinct seeds >= 0, e.g. 1,2 (got {text!r})")
    return seeds


def size_overrides(size: str, arch: str) -> list[str]:
    """The dotted overrides of a size preset for a model of ``arch`` (Byte-nCF splits its encoder layers
    between byte layers and the layers after the fusion, as the paper's 4 + 2)."""
    if size not in SIZES:
        raise ScaletrainError(f"--size: choose one of {', '.join(SIZES)} (got {size!r})")
    p = SIZES[size]
    if p is None:
        return []
    n = p["layers"]
    enc = [f"model.lobef.byte_layers={n - 1}", "model.encoder_layers=1"] if arch in ("byte_ncf", "byte_wsf") \
        else [f"model.encoder_layers={n}"]
    return [f"model.d_model={p['d_model']}", f"model.ffn_dim={p['ffn_dim']}", *enc, f"model.decoder_layers={n}",
            f"data.max_tokens={p['max_tokens']}", f"optim.warmup_steps={p['warmup']}",
            f"train.valid_max_batches={p['valid_batches']}", f"eval.batch_tokens={max(p['max_tokens'], 4096)}",
            f"train.log_every={p['log_every']}"]


def _recipe_for(model: str, out: Path) -> str:
    """The packaged ``catalogs_MODEL`` recipe, else ``OUT/recipes/MODEL.yaml`` = MODEL + the catalogs overlay."""
    from scaletrain.config import recipe_names

    names = recipe_names()
    if f"catalogs_{model}" in names:
        return f"catalogs_{model}"
    if model not in names:
        raise ScaletrainError(f"--models: no recipe {model!r}; packaged recipes: {', '.join(names)}")
    path = out / "recipes" / f"{model}.yaml"
    text = f"# {model} with the catalogs data/budget overlay (written by scaletrain compare-models)\n" \
           f"base: [{model}, overlays/catalogs]\n"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    elif path.read_text(encoding="utf-8") != text:
        raise ScaletrainError(f"{path} was changed by hand; move it away or use another --out")
    return str(path)


def plan_runs(models: Sequence[str], seeds: Sequence[int], base_seeds: Sequence[int], out: Path) -> list[ModelRun]:
    if not models:
        raise ScaletrainError("--models: name at least one model")
    if len(set(models)) != len(models):
        raise ScaletrainError(f"--models: a model is named twice ({', '.join(models)})")
    runs = []
    for m in models:
        recipe = _recipe_for(m, out)
        runs += [ModelRun(m, s, recipe) for s in (base_seeds if m == REFERENCE else seeds)]
    return runs


def check_plan(out: Path, plan: dict) -> None:
    """Write ``OUT/plan.json``, or check that the folder's earlier runs had the same shared settings."""
    from scaletrain.fileio import atomic_write_text

    path = out / "plan.json"
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        diff = [k for k in PLAN_KEYS if old.get(k) != plan.get(k)]
        if diff:
            k = diff[0]
            raise ScaletrainError(f"{out} holds runs made with {k} = {old.get(k)!r}, not {plan.get(k)!r}: models "
                                  "compared in one folder share every setting; use the same settings or another --out")
        return
    atomic_write_text(path, json.dumps(plan, indent=2) + "\n")


def pinned_precision(out: Path) -> tuple[str, str]:
    """What ``engine.precision: auto`` means for every run of the folder, and why: resolved once (recorded in
    ``plan.json`` on the first run and read back after), so every model trains in the same precision. A
    per-process choice is not stable on a loaded CPU, where the GEMM probe behind it flips between runs."""
    try:
        plan = json.loads((out / "plan.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        plan = {}
    if plan.get("precision"):
        return plan["precision"], plan.get("precision_reason", "")
    from scaletrain.engine.precision import resolve_precision

    res = resolve_precision("auto")
    return res.precision, res.reason


def run_overrides(run: ModelRun, out: Path, plan: dict) -> list[str]:
    """Every override of one run (validated: a bad ``--set`` fails here, before anything trains)."""
    from scaletrain.config import load_config

    arch = load_config(run.recipe).model.arch
    ov = size_overrides(plan["size"], arch)
    ov += [f"data.shards={plan['shards']}", f"train.max_minutes={plan['minutes']}", f"train.seed={run.seed}",
           f"data.seed={run.seed}", f"train.out_dir={out / 'runs' / run.name}",
           f"tracking.uri=sqlite:///{out / 'mlruns.db'}", f"tracking.experiment={EXPERIMENT}",
           f"tracking.run_name={run.name}"]
    if plan["beam"]:
        ov.append(f"eval.beam={plan['beam']}")
    ov += list(plan["set"])
    load_config(run.recipe, ov)
    return ov


def _finished(run_dir: Path) -> dict | None:
    """The run's train_summary.json when it finished its budget (not preempted)."""
    try:
        s = json.loads((run_dir / "train_summary.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return None if s.get("preempted") else s


class Interruption:
    """SIGINT / SIGTERM while the runs go on: remembered, and passed on to the running child process as SIGTERM
    (a training checkpoints at its next step boundary and exits; the trainer reads a second SIGINT as "stop
    now", which a Ctrl-C that reached the child too must not become). The command then waits for the child,
    starts nothing else and exits 128 + the signal number. Installed from the main thread only."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self.child: subprocess.Popen | None = None
        self._old: dict = {}

    def __enter__(self) -> "Interruption":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _on_signal(self, signum, frame) -> None:
        self.signum = self.signum or signum
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    def run(self, cmd: list[str], log: Path, env: dict | None = None) -> int:
        """``cmd`` with its output appended to ``log``; its exit code (-N: killed by signal N)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"\n$ {' '.join(cmd)}\n")
            f.flush()
            if self.signum is not None:
                return -self.signum
            self.child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            if self.signum is not None:  # it came while the child was starting: the handler saw no child
                self.child.send_signal(signal.SIGTERM)
            try:
                return self.child.wait()
            finally:
                self.child = None


def _tail(log: Path, n: int = 5) -> str:
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join("    " + x for x in lines[-n:])


def _failure(what: str, rc: int, log: Path, seconds: float | None = None) -> str:
    """What failed, as its first line (``training exited 2: <the error line of its log>``), then the log's tail.
    The error line is the last ``scaletrain: error:`` line of this attempt's output (after the last ``$ cmd``
    line: the log keeps every attempt), else its last line."""
    try:
        lines = [x.strip() for x in log.read_text(encoding="utf-8", errors="replace").splitlines() if x.strip()]
    except OSError:
        lines = []
    starts = [i for i, x in enumerate(lines) if x.startswith("$ ")]
    lines = lines[starts[-1] + 1:] if starts else lines
    errors = [x for x in lines if x.startswith("scaletrain: error:")]
    why = (errors or lines or ["no output"])[-1].removeprefix("scaletrain: error: ")
    after = f"after {seconds:.0f}s, " if seconds is not None else ""
    return f"{what} exited {rc}: {why}\n    ({after}log {log})\n" + _tail(log)


def train_and_evaluate(run: ModelRun, ov: list[str], out: Path, eval_lines: int, echo,
                       precision: str = "", runner: Interruption | None = None) -> str | None:
    """Train (unless finished) and evaluate (unless done) one run; None, or what failed (its first line the
    reason, the log's tail after it). ``precision``: what ``engine.precision: auto`` resolves to in the
    training process; ``runner`` runs the child processes (signals passed on)."""
    from scaletrain.engine.precision import ENV

    runner = runner or Interruption()
    run_dir, logs = out / "runs" / run.name, out / "logs"
    summary = _finished(run_dir)
    if summary is None:
        t0 = time.time()
        env = {**os.environ, ENV: precision} if precision else None
        rc = runner.run([sys.executable, "-m", "scaletrain", "train", "--config", run.recipe, *ov],
                        logs / f"{run.name}.train.log", env)
        summary = _finished(run_dir)
        if rc != 0 or summary is None:
            return _failure("training", rc, logs / f"{run.name}.train.log", time.time() - t0)
        echo(f"  trained: {summary['steps']} steps, {summary['tokens']:,} target tokens in "
             f"{summary['train_seconds']:.0f}s; valid nll {summary['valid_nll'][-1][1]:.3f}")
    else:
        echo(f"  already trained ({summary['steps']} steps): not trained again")
    result = run_dir / "eval_test.json"
    if result.is_file():
        echo("  already evaluated: not evaluated again")
        return None
    cmd = [sys.executable, "-m", "scaletrain", "evaluate", "--checkpoint", str(run_dir), "--json", str(result)]
    if eval_lines:
        cmd += ["--max-lines", str(eval_lines)]
    rc = runner.run(cmd, logs / f"{run.name}.eval.log")
    if rc != 0 or not result.is_file():
        return _failure("evaluation", rc, logs / f"{run.name}.eval.log")
    r = json.loads(result.read_text(encoding="utf-8"))
    avg = {a["name"]: a for a in r["model"]["averages"]} if isinstance(r.get("model"), dict) else {}
    a = avg.get("all", {})
    echo(f"  evaluated {r['lines']} test lines: BLEU {_num(a.get('bleu'))}, chrF {_num(a.get('chrf'))}; "
         f"{r.get('cut_invalid_utf8', 0)} stopped at invalid UTF-8")
    return None


def _num(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _table_stem(out: Path, texts: dict[str, str]) -> tuple[str, bool]:
    """Where the table goes: the first ``compare``/``compare-N`` whose files hold these texts (nothing to
    write but a missing plot), or the first whose files do not exist. Returns (stem, texts already there)."""
    n = 1
    while True:
        stem = "compare" if n == 1 else f"compare-{n}"
        paths = {ext: out / f"{stem}{ext}" for ext in texts}
        if not any(p.exists() for p in paths.values()) and not (out / f"{stem}.png").exists():
            return stem, False
        if all(p.is_file() and p.read_text(encoding="utf-8") == texts[ext] for ext, p in paths.items()):
            return stem, True
        n += 1


FAILED_ROW = "failed"


def _failed_runs(out: Path, failed: dict[str, str]) -> list:
    """A table column per failed run: its MLflow run where training got as far as creating one (its config and
    curves), else a column with its name alone."""
    from scaletrain.tracking.compare import RunData, load_runs
    from scaletrain.tracking.journal import RUN_FILE

    cols = []
    for name in failed:
        run_dir = out / "runs" / name
        col = None
        if (run_dir / "tracking" / RUN_FILE).is_file():
            try:
                col = load_runs([str(run_dir)], project_dir=out)[0]
            except ScaletrainError:
                col = None
        cols.append(col or RunData(name, name, "FAILED", {}, {}, {}))
    return cols


def write_table(out: Path, run_dirs: Sequence[Path], failed: dict[str, str] | None = None) -> tuple[list[Path], str]:
    """``scaletrain compare`` of the runs as Markdown, CSV and JSON, and its plot, under a name that
    overwrites nothing; returns the files written (none if the same table is there) and the Markdown.
    ``failed`` (run name -> why): runs that failed, each a column too, its reason in the row ``failed``."""
    from scaletrain.tracking.compare import compare, load_runs, plot_comparison, plot_data_path
    from scaletrain.fileio import atomic_write_text

    failed = failed or {}
    run_dirs = [d for d in run_dirs if d.name not in failed]
    ok = load_runs([str(d) for d in run_dirs], project_dir=out) if run_dirs else []
    runs = ok + _failed_runs(out, failed)
    cmp = compare(runs)
    if failed:
        at = next(i for i, (name, _) in enumerate(cmp.rows) if name == "status") + 1
        cmp.rows.insert(at, (FAILED_ROW, [None] * len(ok) + list(failed.values())))
    texts = {".md": cmp.format("md") + "\n", ".csv": cmp.format("csv"), ".json": cmp.format("json") + "\n"}
    stem, there = _table_stem(out, texts)
    written = []
    if not there:
        for ext, text in texts.items():
            atomic_write_text(out / f"{stem}{ext}", text)
            written.append(out / f"{stem}{ext}")
    if not (out / f"{stem}.png").exists():
        try:
            png = plot_comparison(runs, out / f"{stem}.png")
            written += [png, plot_data_path(png)]
        except Exception as e:  # noqa: BLE001 - a plot must not lose the table
            print(f"warning: could not plot the comparison: {e}", file=sys.stderr)
    return written, texts[".md"]


def compare_models(models: Sequence[str] = DEFAULT_MODELS, *, out: str | os.PathLike = "results/compare-models",
                   seeds: Sequence[int] = (1,), base_seeds: Sequence[int] = (1, 2), minutes: float = 10.0,
                   size: str = "paper", sets: Sequence[str] = (), shards: str = "shards/catalogs", beam: int = 0,
                   eval_lines: int = 0, dry_run: bool = False, echo=print) -> int:
    """Train, evaluate and compare (module doc); returns 0, 1 when a run failed (the others are kept and the
    table shows it as failed), or 128 + N when signal N interrupted it."""
    if not minutes > 0:
        raise ScaletrainError(f"--minutes must be > 0 (got {minutes})")
    if beam < 0 or eval_lines < 0:
        raise ScaletrainError("--beam and --eval-lines must be >= 0 (0 = the recipe's beam / every test line)")
    size_overrides(size, "transformer")  # the preset exists
    out = Path(out).resolve()
    shards_path = Path(shards).resolve()
    if not (shards_path / "manifest.json").is_file():
        raise ScaletrainError(f"{shards_path} has no manifest.json; build the corpus first: scaletrain prepare "
                              "--catalogs system,packages --max-per-lang 20000 --max-bytes 256 --valid-frac 0.01 "
                              "--test-frac 0.02 --spm-vocab-size 8000 (or pass --shards DIR)")
    plan = {"minutes": minutes, "size": size, "set": list(sets), "shards": str(shards_path), "beam": beam,
            "eval_lines": eval_lines}
    out.mkdir(parents=True, exist_ok=True)
    runs = plan_runs(list(models), list(seeds), list(base_seeds), out)
    overrides = {r.name: run_overrides(r, out, plan) for r in runs}  # every run validated before any trains
    if dry_run:
        for r in runs:
            echo(f"{r.name}: scaletrain train --config {r.recipe} {' '.join(overrides[r.name])}")
        return 0
    precision, why = pinned_precision(out)
    check_plan(out, {**plan, "precision": precision, "precision_reason": why})
    echo(f"engine.precision auto -> {precision} for every model ({why})")
    failed: dict[str, str] = {}
    with Interruption() as runner:
        for i, r in enumerate(runs, 1):
            echo(f"[{i}/{len(runs)}] {r.name} ({r.recipe}, {minutes:g} min, size {size})")
            err = train_and_evaluate(r, overrides[r.name], out, eval_lines, echo, precision, runner)
            if runner.signum is not None:
                return _interrupted(runner.signum, r.name, echo)
            if err:
                echo(f"  FAILED: {err}")
                failed[r.name] = err.splitlines()[0]
    done = sorted(d for d in (out / "runs").iterdir() if (d / "eval_test.json").is_file()) \
        if (out / "runs").is_dir() else []
    if done or failed:
        written, md = write_table(out, done, failed)
        echo(md)
        echo(f"wrote {', '.join(str(p) for p in written)}" if written else f"the table of these runs is already in {out}")
    if failed:
        echo(f"failed: {', '.join(failed)}; re-run the same command to retry them (finished runs are kept)")
        return 1
    return 0


def _interrupted(signum: int, during: str, echo) -> int:
    echo(f"interrupted by {signal.Signals(signum).name} during {during}: no other run started; re-run the same "
         "command to resume (finished runs are kept, an interrupted training resumes from its checkpoint)")
    return 128 + signum

