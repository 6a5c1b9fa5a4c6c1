"""The global batch a run keeps across world sizes: ``engine.global_batch_slots`` and ``engine.grad_accum``.

An update reads one batch from each of ``slots`` = data-parallel size x ``grad_accum`` batch slots
(``scaletrain.data.position``). A job that resumes at another world size (an elastic restart after a lost
host, or a plain re-run on fewer or more ranks) keeps the slot count of the run: the first launch records
it in every checkpoint (``trainer_state.json``: ``global_batch_slots``, and the ``engine.grad_accum`` the user
asked for, ``grad_accum_asked``), and ``grad_accum`` is re-derived here, before the engine starts, as
``slots / world size``. The rules (:func:`plan_global_batch`; each decision that changes what the user
asked is one log line on rank 0):

- the slot count kept is ``engine.global_batch_slots`` when set (> 0), else the checkpoint's, else (a first
  launch) world size x ``engine.grad_accum``;
- without ``engine.global_batch_slots``, an ``engine.grad_accum`` other than the one the checkpoint's run was
  launched with is a deliberate change of the global batch: the new count is world size x that
  ``grad_accum`` (one line names the old and new count; the data stream regroups). The same command re-run
  (the same ``grad_accum`` as recorded) keeps the recorded count;
- with ``engine.global_batch_slots`` set, it wins: an ``engine.grad_accum`` (other than the default 1 and
  the recorded one) that gives another count at this world size is replaced, in one line;
- where the world size does not divide the count, ``grad_accum`` is the nearest whole number (ties: the
  larger): one line says the update's slot count from here on; the data stream regroups its current
  window (``change_slots``), and the recorded count stays, so a later resume at a world size that divides
  it returns to it.

Checkpoints written before these fields existed record the count as their world size x their config's
``engine.grad_accum``. Read from the checkpoint that ``latest`` names (the one a resume loads unless it is
corrupt: an earlier intact one was written by the same job, with the same count); a record that does not
read is passed over for the newest earlier one that does.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import yaml

log = logging.getLogger("scaletrain")


@dataclass
class BatchPlan:
    grad_accum: int
    """Micro-batches per update on this run (what the engine and the data stream use)."""
    slots: int
    """The global batch the job keeps, in batch slots (recorded in each checkpoint)."""
    asked: int
    """The ``engine.grad_accum`` the job was launched with (recorded: tells a re-run from a change)."""
    world: int
    """Data-parallel ranks of this run."""
    notes: list[str] = field(default_factory=list)
    """Log lines: each decision that changes what was asked or recorded."""

    @property
    def actual_slots(self) -> int:
        """Batch slots per update on this run (``slots`` unless the world size does not divide it)."""
        return self.grad_accum * self.world


def recorded_batch(ckpt_dir: Path) -> dict | None:
    """``{"slots", "asked", "world_size"}`` of a checkpoint directory (None without ``trainer_state.json``)."""
    ts_file = ckpt_dir / "trainer_state.json"
    if not ts_file.is_file():
        return None
    ts = json.loads(ts_file.read_text())
    world = int(ts.get("world_size") or 1)
    if "global_batch_slots" in ts:
        return {"slots": int(ts["global_batch_slots"]), "asked": int(ts["grad_accum_asked"]), "world_size": world}
    ga = 1
    cfg_file = ckpt_dir / "config.yaml"
    if cfg_file.is_file():
        ga = int(((yaml.safe_load(cfg_file.read_text()) or {}).get("engine") or {}).get("grad_accum", 1))
    return {"slots": world * ga, "asked": ga, "world_size": world}


def _divide(slots: int, world: int) -> int:
    """``grad_accum`` for ``slots`` over ``world`` ranks: exact where it divides, else the nearest (ties up)."""
    q, r = divmod(slots, world)
    if r == 0:
        return q
    return max(1, q + (1 if 2 * r >= world else 0))


def plan_global_batch(world: int, grad_accum: int, configured: int = 0, recorded: dict | None = None) -> BatchPlan:
    """The plan for a run on ``world`` data-parallel ranks with ``engine.grad_accum`` = ``grad_accum`` and
    ``engine.global_batch_slots`` = ``configured`` (0: unset), resuming a checkpoint that ``recorded``
    (:func:`recorded_batch`; None: a first launch). Pure; the module doc gives the rules."""
    notes: list[str] = []
    asked = grad_accum
    if configured > 0:
        slots = configured
        if recorded is not None and recorded["slots"] != configured:
            notes.append(f"engine.global_batch_slots={configured} replaces the checkpoint's {recorded['slots']} batch "
                         "slots per update: the global batch changes here (the data stream regroups)")
        derived = _divide(slots, world)
        contradicts = grad_accum != 1 and grad_accum != derived and (recorded is None or grad_accum != recorded["asked"])
        if contradicts:
            notes.append(f"engine.grad_accum={grad_accum} would make {world} x {grad_accum} = {world * grad_accum} "
                         f"batch slots per update, but engine.global_batch_slots={configured} fixes the global batch: "
                         f"grad_accum {derived} is used (set only one of the two keys)")
    elif recorded is None:
        slots = world * grad_accum
    elif grad_accum != recorded["asked"]:
        slots = world * grad_accum
        if slots != recorded["slots"]:
            notes.append(f"engine.grad_accum={grad_accum} differs from the {recorded['asked']} the checkpoint's run was "
                         f"launched with: the global batch changes from {recorded['slots']} to {world} x {grad_accum} = "
                         f"{slots} batch slots per update (set engine.global_batch_slots={recorded['slots']} to keep it)")
    else:
        slots = recorded["slots"]
    ga = _divide(slots, world)
    if ga * world != slots:
        notes.append(f"the global batch of {slots} batch slots is not a multiple of the {world} data-parallel ranks: "
                     f"grad_accum {ga}, so {world} x {ga} = {ga * world} batch slots per update from here on (the data "
                     f"stream regroups); {slots} stays recorded and returns at a world size that divides it")
    elif recorded is not None and recorded["world_size"] != world and not notes:
        notes.append(f"global batch kept at {slots} batch slots per update: {world} data-parallel rank(s) x grad_accum "
                     f"{ga} (the checkpoint's run: {recorded['world_size']} rank(s))")
    return BatchPlan(grad_accum=ga, slots=slots, asked=asked, world=world, notes=notes)


def plan_for_run(cfg, world: int, is_main: bool) -> BatchPlan:
    """Plan the global batch of ``cfg``'s run on ``world`` ranks (the checkpoint a resume would load read
    from ``train.out_dir``), set ``cfg.engine.grad_accum`` to it, log the notes on rank 0."""
    from scaletrain.checkpoint.manager import TAG_RE, latest_tag

    recorded = None
    root = cfg.out_dir / "checkpoints"
    tag = latest_tag(root) if cfg.train.resume else None
    if tag is not None:  # a damaged record: the newest earlier one that reads (as the resume falls back)
        for t in sorted((p.name for p in root.iterdir() if TAG_RE.match(p.name) and p.name <= tag), reverse=True):
            try:
                recorded = recorded_batch(root / t)
            except (OSError, ValueError, TypeError, KeyError, AttributeError, yaml.YAMLError):
                continue
            if recorded is not None:
                break
    plan = plan_global_batch(world, int(cfg.engine.grad_accum), int(cfg.engine.global_batch_slots), recorded)
    cfg.engine.grad_accum = plan.grad_accum
    if is_main:
        for note in plan.notes:
            log.info("%s", note)
    return plan
