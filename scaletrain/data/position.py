"""Where the training stream is: its small JSON-able state, and how a position moves to another batch layout.

The global sequence of a run's batches depends on ``(seed, epoch, slots)`` and the data settings only, where
``slots`` = data-parallel size x gradient accumulation: every update reads one batch from each of ``slots``
*batch slots*, and slot ``s`` of an update is micro-batch ``s % grad_accum`` of data-parallel rank
``s // grad_accum`` (``scaletrain.data.stream`` plans the slots). So 2 ranks x 1 micro-batch and 1 rank x 2
micro-batches read the same examples in the same updates, and a state saved under one layout resumes under
any other layout with the same slot count: the same updates follow.

An epoch's blocks (permuted by ``(seed, epoch)``) are cut into a *grid* of windows of about ``buffer_size``
blocks per slot, starting at block ``origin`` of the permuted order (0, unless the slot count changed
during the epoch): ``windows_from`` windows, window ``w`` spanning ``window_span``.

State (``version`` 2; every rank saves one, identical on all ranks but for the corrupt-block counts)::

    {"version": 2, "epoch": e, "origin": o, "window": w, "batch": j, "micro": i, "carry": None | {...},
     "config": {"split", "slots", "seed", "max_tokens", "max_bytes", "buffer_size", "drop_last", "shuffle",
                "temperature", "n_blocks", ["tokenizer"], ["pad_to_multiple", "max_rows"]},
     "skipped_blocks": n, "skipped_total": n}

The next batch is micro-batch ``i`` of update ``j`` of window ``w`` of the grid at ``origin``; ``carry``
(see below) is a segment played before that grid's window 0 (then ``window`` is 0).

**A change of the slot count** (``change_slots``; a resume that changes the global batch) keeps every
example of the epoch exactly once: the updates already read stay read; the unread batches of the current
window (as planned for the old count: ``starts`` batches of each old slot were read) are taken in update
order and regrouped ``slots`` to an update (the largest batches split in two until their number is a
multiple of the new count; with ``drop_last`` the surplus is dropped instead); then the rest of the epoch
is a grid for the new count starting at the block after that window. That tail is the state's ``carry``::

    {"slots": G_old, "origin": o_old, "window": w_old, "starts": b | [b_0, ..., b_{G_old-1}],
     "regroups": [[G_1, u_1], ...]}

(``starts[s] = None``: old slot ``s`` read the whole window; ``regroups``: earlier changes inside the same
carry, each a count and the updates read with it.) A change at an update boundary that is also a window
boundary needs no carry: the new grid starts at the window's first block. A state from before this layout
(``version`` 1: ``world_size`` slots, or a loader's per-worker positions) is read by ``upgrade``: a
one-slot-per-rank state (``num_workers`` 0 or 1, ``grad_accum`` 1) continues exactly; a state of worker
slots or of several micro-batches from one slot continues as a change of the slot count would (nothing lost
or repeated, a new batch sequence from there).

Pure functions of the states (no shard access), so ``states_for_layout`` can turn the saved states of all
old ranks into the new ranks' states before any shard is opened.
"""
from __future__ import annotations

import logging

from scaletrain.errors import ScaletrainError

STATE_VERSION = 2
log = logging.getLogger(__name__)
_SKIPS = ("skipped_blocks", "skipped_total")


def windows_from(n_blocks: int, origin: int, buffer_size: int, slots: int) -> int:
    """Windows of an epoch's grid that starts at block ``origin`` (``buffer_size`` blocks per slot, at most)."""
    return -(-(n_blocks - origin) // (buffer_size * slots)) if origin < n_blocks else 0


def window_span(n_blocks: int, origin: int, window: int, n_windows: int) -> tuple[int, int]:
    """Blocks ``[a, b)`` of the epoch's permuted order in ``window`` of the grid at ``origin`` (nearly equal
    windows: no small tail window)."""
    m = n_blocks - origin
    return origin + window * m // n_windows, origin + (window + 1) * m // n_windows


def initial_state(config: dict) -> dict:
    """The state of a stream that has read nothing."""
    return {"version": STATE_VERSION, "epoch": 0, "origin": 0, "window": 0, "batch": 0, "micro": 0, "carry": None,
            "config": dict(config), "skipped_blocks": 0, "skipped_total": 0}


def unstarted(state) -> bool:
    """A version-1 loader state none of whose workers had yielded a batch (it names no settings)."""
    return isinstance(state, dict) and state.get("version") == 1 and isinstance(state.get("positions"), list) and all(
        p is None for p in state["positions"])


def upgrade(state, config: dict | None = None) -> dict:
    """``state`` as a version-2 stream state: a version-1 stream state (``world_size`` slots) or a version-1
    loader state (``positions`` of its worker slots) converted, a version-2 one checked. An ``unstarted`` state
    is the start of a stream with ``config`` (the reader's own settings). One line on bad input."""
    if not isinstance(state, dict):
        raise ScaletrainError(f"invalid data-stream state (a {type(state).__name__}, not a dict)")
    if unstarted(state) and config is not None:
        return initial_state(config)
    try:
        version = state["version"]
        if version == 1 and "positions" in state:
            return _from_worker_positions(state)
        if version == 1:
            cfg = {("slots" if k == "world_size" else k): v for k, v in state["config"].items()}
            return _checked({**state, "version": STATE_VERSION, "origin": 0, "micro": 0, "carry": None, "config": cfg})
        if version != STATE_VERSION:
            raise ScaletrainError(f"data-stream state version {version}; this scaletrain reads {STATE_VERSION} and 1")
        return _checked(dict(state))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ScaletrainError(f"invalid data-stream state ({type(e).__name__}: {e})") from None


def _checked(state: dict) -> dict:
    for k in ("epoch", "origin", "window", "batch", "micro"):
        state[k] = int(state[k])
    cfg = dict(state["config"])
    cfg["slots"] = int(cfg["slots"])
    cfg["n_blocks"], cfg["buffer_size"] = int(cfg["n_blocks"]), int(cfg["buffer_size"])
    state["config"] = cfg
    carry = state.get("carry")
    if carry is not None:
        starts = carry["starts"]
        starts = int(starts) if not isinstance(starts, list) else [None if s is None else int(s) for s in starts]
        if isinstance(starts, list) and len(starts) != int(carry["slots"]):
            raise ValueError(f"carry starts has {len(starts)} entries for {carry['slots']} slots")
        state["carry"] = {"slots": int(carry["slots"]), "origin": int(carry["origin"]), "window": int(carry["window"]),
                          "starts": starts, "regroups": [[int(g), int(u)] for g, u in carry["regroups"]]}
    state.setdefault("skipped_blocks", 0)
    state.setdefault("skipped_total", state["skipped_blocks"])
    return state


def _from_worker_positions(state: dict) -> dict:
    """A version-1 loader state: worker ``v`` of rank ``r`` was slot ``r * nw + v`` of ``world_size * nw``, and
    every rank's worker ``v`` was at the same place, so one rank's positions give every old slot's."""
    nw, positions = int(state["num_workers"]), list(state["positions"])
    if nw < 1 or len(positions) != nw:
        raise ValueError(f"{len(positions)} positions for {nw} worker slot(s)")
    known = [upgrade(p) for p in positions if p is not None]
    if not known:
        raise ValueError("no worker position")
    start = {**known[0], "epoch": 0, "window": 0, "batch": 0, "skipped_blocks": 0, "skipped_total": 0}
    pos = [start if p is None else upgrade(p) for p in positions]
    skips = {k: sum(int(p[k]) for p in pos) for k in _SKIPS}
    first = min(pos, key=lambda p: (p["epoch"], p["window"]))
    if all((p["epoch"], p["window"], p["batch"]) == (first["epoch"], first["window"], first["batch"]) for p in pos):
        return {**first, **skips}
    cfg = first["config"]
    n, buf, slots = int(cfg["n_blocks"]), int(cfg["buffer_size"]), cfg["slots"]
    e, w = first["epoch"], first["window"]
    nxt = (e, w + 1) if w + 1 < windows_from(n, 0, buf, slots) else (e + 1, 0)
    starts = []
    for p in pos:
        if (p["epoch"], p["window"]) == (e, w):
            starts.append(p["batch"])
        elif (p["epoch"], p["window"], p["batch"]) == (*nxt, 0):
            starts.append(None)  # this worker slot read the whole window
        else:
            raise ValueError(f"worker positions {[(p['epoch'], p['window'], p['batch']) for p in pos]} are not "
                             "one window apart")
    per_slot = [starts[s % nw] for s in range(slots)]
    _, end = window_span(n, 0, w, windows_from(n, 0, buf, slots))
    carry = {"slots": slots, "origin": 0, "window": w, "starts": per_slot, "regroups": []}
    return {**first, "origin": end, "window": 0, "batch": 0, "micro": 0, "carry": carry, **skips}


def change_slots(state: dict, slots: int, why: str = "") -> dict:
    """``state`` (version 2) for ``slots`` batch slots per update: the same state when the count is unchanged,
    else the position that continues the epoch with nothing lost or repeated (module doc). ``why``: what the
    log line names as the cause."""
    cfg, old = state["config"], state["config"]["slots"]
    if old == slots:
        return state
    if state["micro"]:
        raise ScaletrainError(f"the data-stream position is inside an update (micro-batch {state['micro']}); a resume "
                              f"with another global batch ({old} -> {slots} batch slots) needs a checkpoint written "
                              "between updates, as training writes them")
    n, buf = int(cfg["n_blocks"]), int(cfg["buffer_size"])
    new = {**state, "config": {**cfg, "slots": slots}, "batch": 0, "micro": 0}
    o, w, j = state["origin"], state["window"], state["batch"]
    if state["carry"] is not None:
        carry = dict(state["carry"])
        if j:
            carry["regroups"] = [*carry["regroups"], [old, j]]
        new["carry"] = carry
        what = f"the regrouped rest of a window, after {j} update(s)"
    else:
        a, b = window_span(n, o, w, windows_from(n, o, buf, old))
        if j == 0:
            new.update(origin=a, window=0)
            what = "a window boundary: later windows are planned for the new count"
        else:
            new.update(origin=b, window=0, carry={"slots": old, "origin": o, "window": w, "starts": j, "regroups": []})
            what = (f"update {j} of window {w}: that window's unread batches are regrouped {slots} to an update, "
                    "later windows planned for the new count")
    log.info("data stream: %s%d -> %d batch slots per update (data-parallel size x grad_accum) at epoch %d, %s; "
             "no example of the epoch is lost or repeated", f"{why}: " if why else "", old, slots, state["epoch"], what)
    return new


def states_for_layout(states: list, dp_size: int, grad_accum: int) -> list[dict]:
    """The data-stream states of the ``dp_size`` ranks of a new layout from the saved states of every rank of
    the old one (``rank_state["stream"]`` of each old rank, in rank order; any version).

    Every old rank must be at the same position (training keeps them in lock-step). With the same slot count
    (``dp_size * grad_accum``) as saved, the new ranks continue the very same sequence of updates; with
    another, the position is moved by ``change_slots`` (module doc: the unread rest of the current window is
    regrouped for the new count, nothing of the epoch is lost or repeated). With as many ranks as before the
    per-rank corrupt-block counts are kept; otherwise new rank 0 takes their sums. Each new rank passes its
    state to ``ShardLoader.load_state_dict`` (built with that rank's data-parallel rank, ``dp_size`` and
    ``grad_accum``). One line naming the rank when the states disagree."""
    if dp_size < 1 or grad_accum < 1 or not states:
        raise ScaletrainError(f"states_for_layout: {len(states)} saved state(s), dp_size {dp_size}, "
                              f"grad_accum {grad_accum}: need at least one state and sizes >= 1")
    if all(unstarted(s) for s in states):  # nothing read yet: every new rank starts the stream
        return [dict(states[0]) for _ in range(dp_size)]
    ups = [upgrade(s) for s in states]
    strip = [{k: v for k, v in s.items() if k not in _SKIPS} for s in ups]
    for r, s in enumerate(strip[1:], 1):
        if s != strip[0]:
            diff = sorted(k for k in s if s[k] != strip[0].get(k))
            raise ScaletrainError(f"the saved data-stream state of rank {r} differs from rank 0's in {diff}; "
                                  "the checkpoint's ranks were not at the same data position")
    slots = dp_size * grad_accum
    if len(ups) == dp_size and ups[0]["config"]["slots"] == slots:
        return ups
    totals = dict.fromkeys(_SKIPS, sum(int(s["skipped_blocks"]) for s in ups))  # the current window is read again
    base = change_slots(ups[0], slots, why=f"{len(ups)} -> {dp_size} data-parallel ranks")
    return [{**base, **(totals if r == 0 else dict.fromkeys(_SKIPS, 0))} for r in range(dp_size)]
