"""The MLflow record of a training job: everything the trainer records besides its per-step metrics.

:class:`RunRecorder` owns the job's :class:`~scaletrain.tracking.Tracker`, which does not log twice the
steps a resumed job trains again after a crash (``Tracker.replaying_until``). The step logger and the evaluator log their metrics through :attr:`RunRecorder.tracker`; the
recorder does the rest:

* the run (:meth:`~RunRecorder.start`, a collective): created on rank 0 with the flattened config, the world
  and vocabulary sizes and the parameter counts as params and :func:`run_tags` as tags, or resumed from the
  checkpoint's run id (an elastic restart or a re-run: the same run goes on, the restart recorded as tags
  ``restarts`` and ``restart.N``, old and new world size, step, updates redone); every rank learns the id;
* the set-up artifacts of a new run: ``config.yaml``, the engine's resolved settings (the DeepSpeed JSON
  with its batch sizes filled, or the accelerate settings) and the shard manifest;
* one system-metrics sampler per node (its local rank 0), in rank 0's store;
* each written checkpoint in the run's ``checkpoints.json`` (:meth:`~RunRecorder.record_checkpoint`);
* at the end (:meth:`~RunRecorder.finish`, :meth:`~RunRecorder.close`): the job's training seconds and steps,
  the learning-curve and expert-usage plots (a plotting failure is a warning), the end status.

With ``tracking.enabled=false`` the tracker is a no-op one on every rank and nothing here talks to MLflow.
Layer: :mod:`scaletrain.tracking`, the config and the engine's public API (rank, ``broadcast_object``); the
trainer reaches MLflow only through this module.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Mapping

from scaletrain.config import Config, dump_yaml, flatten, to_dict
from scaletrain.tracking import (JOURNAL, NodeSystemMetrics, Tracker, broadcast_run_id, default_run_name,
                                 node_layout, plot_expert_usage, plot_learning_curves, safe_key)
from scaletrain.tracking.checkpoint_models import CheckpointModels
from scaletrain.tracking.datasets import corpus_dataset
from scaletrain.tracking.provenance import NOTE_TAG, git_info, source_tags
from scaletrain.tracking.sync import send_journaled_steps

log = logging.getLogger("scaletrain")
RESTARTS = "restarts.jsonl"  # OUT/tracking/: one line per resume of the job (RunRecorder._record_restart)

__all__ = ["RunRecorder", "run_tags"]


def _restart_kind(r: Mapping) -> str:
    """How a resume came about, for the restart's note: torchrun's agent restarting the workers after a
    failure (its restart count), the agents taking in a node that joined (a larger world: torchrun does not
    count that restart, and the joining node's agent starts at 0), or a re-run."""
    elastic = "TORCHELASTIC_RUN_ID" in os.environ
    if elastic and r["world_size_new"] > r["world_size_old"]:
        return "elastic restart: a node joined"
    return f"elastic restart {r['elastic_restart']}" if r["elastic_restart"] else "a re-run"


class RunRecorder:
    """The MLflow record of the job training ``cfg`` on ``engine`` into ``out_dir`` (made on every rank;
    only rank 0's tracker writes, and each node's local rank 0 samples its system metrics)."""

    def __init__(self, cfg: Config, engine, out_dir):
        self.cfg, self.engine = cfg, engine
        self.out_dir = Path(out_dir)
        t = cfg.tracking
        self.enabled = bool(t.enabled)
        self.tracker = Tracker(
            uri=t.uri or None, experiment=t.experiment, run_name=t.run_name or default_run_name(cfg.name, out_dir),
            is_main=engine.is_main and t.enabled, project_dir=Path.cwd(), local_dir=self.out_dir / "tracking",
            end_timeout=t.end_timeout)
        self.system_metrics: NodeSystemMetrics | None = None

    def resumed_at(self, step: int, old_world: int | None = None) -> None:
        """The job resumed from a checkpoint of ``step`` written by ``old_world`` ranks: the steps after it that
        the journal already has are trained again, not logged again; :meth:`start` records the restart."""
        self.tracker.replaying_until(self.out_dir / "tracking" / JOURNAL, step)
        self._restart = {"step": step, "world_size_old": old_world or self.engine.world_size,
                         "world_size_new": self.engine.world_size,
                         "updates_redone": max(0, self.tracker.replay_until - step),
                         "elastic_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)}

    def _record_restart(self, run_id: str | None) -> None:
        """Rank 0, a resumed job: one console line, one line in ``OUT/tracking/restarts.jsonl`` and the run's
        tags ``restarts`` (how many) and ``restart.N`` (old -> new world size, the step resumed at, the updates
        redone); the run's metrics go on where they stopped (``Tracker.replaying_until``)."""
        r = getattr(self, "_restart", None)
        if r is None or not self.engine.is_main:
            return
        path = self.out_dir / "tracking" / RESTARTS
        n = 1 + (len(path.read_text().splitlines()) if path.is_file() else 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"restart": n, "run_id": run_id, **r}) + "\n")
        how = _restart_kind(r)
        text = (f"world size {r['world_size_old']} -> {r['world_size_new']}, resumed at step {r['step']}, "
                f"{r['updates_redone']} update(s) redone ({how})")
        log.info("restart %d of %s: %s", n, f"MLflow run {run_id}" if run_id else "the job", text)
        if run_id:
            self.tracker.set_tags({"restarts": n, f"restart.{n}": text})
        if run_id and self.enabled and r["updates_redone"]:
            try:  # what the lost session journaled but had not sent: the server gets each step once
                sent = send_journaled_steps(self.tracker.client, run_id, self.out_dir / "tracking" / JOURNAL,
                                            r["step"], self.tracker.replay_until)
            except Exception as e:  # noqa: BLE001 - the server is away: the journal keeps them for `tracking sync`
                log.warning("the re-done steps' metrics the lost session had not sent could not be sent now (%s); "
                            "`scaletrain tracking sync %s` sends them later", str(e).splitlines()[0] if str(e) else
                            type(e).__name__, self.out_dir)
            else:
                if sent:
                    log.info("%d metric value(s) of steps %d-%d that the lost session journaled but had not sent: "
                             "sent now", sent, r["step"] + 1, self.tracker.replay_until)

    # ---- the start ------------------------------------------------------------------------------
    def start(self, resumed_run_id: str | None, step: Callable[[], int], *, manifest, vocab_size: int,
              param_counts: Mapping[str, int]) -> str | None:
        """Collective: resume ``resumed_run_id`` (the checkpoint's) or create the run with its params, tags
        and set-up artifacts (rank 0); give every rank the run id; start this node's system-metrics sampler
        (logging at ``step()``). Returns the run id (None with tracking off)."""
        cfg, eng = self.cfg, self.engine
        run_id = None
        if eng.is_main and self.enabled:
            dataset = corpus_dataset(manifest.to_dict(), _manifest_bytes(cfg), cfg.data.shards)
            if resumed_run_id:
                run_id = self.tracker.resume(resumed_run_id)
            else:
                params = flatten(to_dict(cfg))
                params.update({"world_size": eng.world_size, "vocab_size": vocab_size})
                params.update({f"params.{k}": v for k, v in param_counts.items()})
                tags = {**run_tags(cfg, eng, manifest), NOTE_TAG: run_note(cfg, eng, dataset, param_counts)}
                run_id = self.tracker.start(params, tags=tags)
                self.tracker.log_text(dump_yaml(cfg), "config.yaml")
                self._log_setup_artifacts()
            self.tracker.log_input(dataset, "train")  # once per run: the store keeps one input per dataset
            self.tracker.checkpoint_models = checkpoint_models(cfg, self.out_dir, dataset, param_counts)
        run_id = broadcast_run_id(run_id, eng.is_main)
        self._record_restart(run_id)
        self._start_system_metrics(run_id, step)
        return run_id

    def _log_setup_artifacts(self) -> None:
        """The engine's resolved settings (DeepSpeed JSON with batch sizes filled, or the accelerate
        settings) and the shard manifest."""
        cfg, eng = self.cfg, self.engine
        if eng.ds_config is not None:
            self.tracker.log_dict(eng.ds_config, "engine/ds_config.json")
        if cfg.engine.backend == "accelerate":
            self.tracker.log_dict({"accelerate": cfg.engine.accelerate, "mixed_precision": cfg.engine.precision,
                                   "gradient_accumulation_steps": cfg.engine.grad_accum,
                                   "num_processes": eng.world_size, "zero_stage": eng.zero_stage},
                                  "engine/accelerate.yaml")
        manifest = Path(cfg.data.shards) / "manifest.json"
        if manifest.is_file():
            self.tracker.log_artifact(manifest, "data")

    def _start_system_metrics(self, run_id: str | None, step: Callable[[], int]) -> None:
        """One system-metrics sampler per node (its local rank 0), on the run rank 0 created, in rank 0's
        store (collective: the store's URI is broadcast)."""
        t, eng = self.cfg.tracking, self.engine
        if not (t.enabled and t.system_metrics):
            return
        uri = eng.parallel.broadcast_object(self.tracker.uri if eng.is_main else None)
        if eng.local_rank != 0 or not run_id:
            return
        node = f"node{node_layout(eng.rank, eng.world_size)[0]}"
        try:
            self.system_metrics = NodeSystemMetrics(
                uri, run_id, node, interval=t.system_metrics_interval, step=step,
                journal_dir=self.out_dir / "tracking" / "system" / node).start()
        except Exception as e:  # noqa: BLE001 - e.g. psutil missing: training goes on without them
            log.warning("system metrics on %s not started: %s", node, e)

    # ---- during the job -------------------------------------------------------------------------
    def record_checkpoint(self, saved: Path | None, step: int) -> None:
        """Add a written checkpoint to the run's ``checkpoints.json`` artifact and make it a logged model of
        the run with the validation metrics of its step (rank 0; local writes, the sending is in the
        background). ``saved`` None: nothing was written."""
        if saved is not None and self.engine.is_main and self.enabled:
            self.tracker.log_checkpoint(saved, step)

    # ---- the end --------------------------------------------------------------------------------
    def finish(self, *, step: int, train_seconds: float, run_id: str | None, preempted: bool) -> None:
        """Training is over (the final checkpoint is written): this node's last system-metrics sample (waiting
        1 s at most when preempted: the grace period is short), then on rank 0 the job's training seconds and
        steps, handed to the sender without waiting, and the plots."""
        self.stop_system_metrics(1.0 if preempted else None)
        if self.engine.is_main:
            self.tracker.log_metrics({"train/seconds": train_seconds, "train/steps": step}, step=step)
            self.tracker.flush(timeout=0)  # hand over, never wait: the server may be down
            self.plot(run_id)

    def plot(self, run_id: str | None) -> None:
        """Learning curves of the whole job and (MoCE) expert usage per language, from the tracking
        journal, as PNGs (+ JSON of the numbers) in ``out_dir/plots`` and artifacts; a plotting failure
        is a warning, never a failed training."""
        if not self.enabled:
            return
        title = self.tracker.run_name or f"{self.cfg.name} ({run_id or 'no run'})"
        for what, fn in (("learning curves", plot_learning_curves), ("expert usage", plot_expert_usage)):
            try:
                png = fn(self.out_dir, title=title)
            except Exception as e:  # noqa: BLE001
                log.warning("could not plot the %s: %s", what, e)
                continue
            for f in (png, png.with_suffix(".json")) if png is not None else ():
                if f.is_file():
                    self.tracker.log_artifact(f, "plots")

    def stop_system_metrics(self, timeout: float | None = None) -> None:
        """Last sample; waits at most ``timeout`` s (default min(10, end_timeout)) for the server (the samples
        are journaled for ``tracking sync`` either way)."""
        if self.system_metrics is not None:
            self.system_metrics.stop(timeout=min(10.0, self.cfg.tracking.end_timeout) if timeout is None else timeout)
            self.system_metrics = None

    def close(self, status: str, reason: str = "") -> None:
        """End the record: stop the system-metrics sampler, end the run with ``status`` (FINISHED, FAILED or
        KILLED), waiting at most ``tracking.end_timeout`` for the server. ``reason`` (a failed job's one line)
        becomes the run's ``failure`` tag."""
        self.stop_system_metrics()
        if reason and self.engine.is_main and self.enabled and self.tracker.run_id is not None:
            self.tracker.set_tags({"failure": " ".join(reason.split())})
        self.tracker.end(status)


def run_tags(cfg: Config, engine, manifest) -> dict[str, str]:
    """The run's tags: what a comparison filters on (variant, engine, scale, corpus, code versions), and
    MLflow's own source, git and user tags (:func:`scaletrain.tracking.provenance.source_tags`)."""
    import importlib.metadata as md

    import torch

    import scaletrain
    from scaletrain.fileio import sha256_bytes

    m, e = cfg.model, cfg.engine
    world = engine.world_size
    tags: dict[str, object] = {
        "recipe": cfg.name, "arch": m.arch, "embedding": getattr(m, "embedding", ""),
        "engine": e.backend if e.backend != "accelerate" else f"accelerate/{e.accelerate}",
        "zero_stage": engine.zero_stage, "precision": e.precision, "world_size": world,
        "nodes": node_layout(engine.rank, world)[1], "tokenizer": cfg.data.tokenizer,
    }
    if cfg.moe.enabled():
        tags.update({"moe.experts": cfg.moe.num_experts, "moe.top_k": cfg.moe.top_k,
                     "moe.ep_size": engine.parallel.ep_size, "moe.every": cfg.moe.every, "moe.capacity_factor": cfg.moe.capacity_factor})
    if m.arch == "moce":
        tags["moce.delta"] = len(m.conv.kernels) - 1  # experts = kernels {0, 1, 3, ..., 2Δ-1}, E = Δ + 1
        tags["moce.lid"] = m.moce.lid
        tags["moce.top_k"] = m.moce.top_k
    shards = Path(cfg.data.shards)
    src = manifest.source if isinstance(manifest.source, dict) else {}
    tags["corpus"] = src.get("name") or src.get("package") or shards.resolve().name
    if (shards / "manifest.json").is_file():
        tags["corpus.manifest_sha256"] = sha256_bytes((shards / "manifest.json").read_bytes())
    commit = git_info().get("commit")
    if commit:
        tags["git_commit"] = commit
    tags.update(source_tags("scaletrain train"))
    tags["version.scaletrain"] = scaletrain.__version__
    tags["version.torch"] = torch.__version__
    for pkg in ("deepspeed", "accelerate", "mlflow"):
        try:
            tags[f"version.{pkg}"] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return {k: str(v) for k, v in tags.items()}


def _manifest_bytes(cfg: Config) -> bytes:
    """The shard manifest's bytes (its digest names the corpus dataset): the file of a local shard directory,
    else (a URL, a command) the manifest as loaded, in canonical JSON."""
    import json

    from scaletrain.data.shards import load_manifest

    path = Path(cfg.data.shards) / "manifest.json"
    if "://" not in str(cfg.data.shards) and path.is_file():
        return path.read_bytes()
    return json.dumps(load_manifest(cfg.data.shards).to_dict(), sort_keys=True).encode()


def checkpoint_models(cfg: Config, out_dir: Path, dataset: dict, param_counts: Mapping[str, int]) -> CheckpointModels:
    """How the job's checkpoints become logged models: named after the recipe, the validation metrics
    linked to them measured on ``dataset``, the best one by ``train.best_metric`` (else the lowest
    ``valid/nll``), ``checkpoints/best`` holding a copy of it when that metric is set."""
    tc = cfg.train
    params = {"recipe": cfg.name, "arch": cfg.model.arch, "tokenizer": cfg.data.tokenizer,
              "precision": cfg.engine.precision, **{f"params.{k}": str(v) for k, v in param_counts.items()}}
    best = dict(best_metric=safe_key(tc.best_metric), best_mode=tc.best_mode, min_delta=float(tc.best_min_delta),
                best_dir=Path(out_dir) / "checkpoints" / "best") if tc.best_metric else {}
    return CheckpointModels(prefix=cfg.name, params=params,
                            dataset={"name": dataset["name"], "digest": dataset["digest"]}, **best)


def _devices(engine) -> str:
    """``cpu``, or the accelerator's name (``cuda: NVIDIA H100 80GB HBM3``), as rank 0 sees it."""
    device = engine.device
    kind = device.type
    if kind == "cuda":
        import torch

        try:
            return f"cuda: {torch.cuda.get_device_name(device)}"
        except Exception:  # noqa: BLE001 - a name is a nicety
            return "cuda"
    return kind


def run_note(cfg: Config, engine, dataset: Mapping, param_counts: Mapping[str, int]) -> str:
    """The run's description (MLflow's ``mlflow.note.content``, shown on the run's page): the recipe and the
    model, the corpus, what ran where (engine, ranks, nodes, devices, precision) and from which code."""
    import json
    import socket

    import scaletrain

    m, e, world = cfg.model, cfg.engine, engine.world_size
    prof = json.loads(dataset.get("profile") or "{}")
    splits = ", ".join(f"{k} {v:,}" for k, v in (prof.get("splits") or {}).items())
    langs = ", ".join(prof.get("languages") or [])
    where = e.backend if e.backend != "accelerate" else f"Accelerate ({e.accelerate})"
    if e.backend == "deepspeed" or engine.zero_stage:
        where += f" ZeRO stage {engine.zero_stage}"
    nodes = node_layout(engine.rank, world)[1]
    commit = git_info().get("commit")
    code = f"scaletrain {scaletrain.__version__}" + (f" at commit {commit[:12]}" if commit else "")
    return (f"Training of the `{cfg.name}` recipe ({m.arch}, {cfg.data.tokenizer} tokenizer, "
            f"{param_counts.get('total', 0):,} parameters) on the corpus {dataset['name']} (sentence pairs: {splits}; "
            f"languages {langs}; digest {dataset['digest']}) from {cfg.data.shards}. Ran with {where} on {world} "
            f"rank{'s' if world != 1 else ''} on {nodes} node{'s' if nodes != 1 else ''} ({_devices(engine)}; rank 0 "
            f"on host {socket.gethostname()}), precision {e.precision}, up to {cfg.train.max_steps:,} steps, "
            f"output in {cfg.out_dir}; started by `scaletrain train`, {code}.")
