"""What ``torch.compile`` did so far in this process (``engine.compile``): the step log's compile/* metrics.

* ``compile/frames``: frames dynamo compiled, the first compiles and every recompile (a new batch shape
  before dynamo marks the dimension dynamic, a guard that failed); it should stop growing after the first
  few steps. A growing count means the batches keep new shapes: bucket their lengths (``data.*``).
* ``compile/graphs``: distinct graphs; ``compile/graph_breaks``: where dynamo fell back to Python.
* ``compile/cudagraphs``: CUDA graphs recorded (``engine.compile_mode=reduce-overhead``: one per batch shape
  and graph; each costs memory); ``compile/cudagraph_skips``: graphs that could not be captured.

Read from ``torch._dynamo.utils.counters`` and inductor's CUDA-graph tree (whose recording counter has no
public accessor: read from its repr, best effort). Pure host reads, no device synchronisation.
"""
from __future__ import annotations

import re

import torch


def _cudagraphs_recorded() -> int | None:
    if not torch.cuda.is_available():
        return None
    try:
        from torch._inductor.cudagraph_trees import get_container

        tm = get_container(torch.cuda.current_device()).tree_manager
        if tm is None:
            return 0
        m = re.search(r"count\((\d+)", repr(tm.graph_counter))
        return int(m.group(1)) if m else None
    except Exception:  # noqa: BLE001 - a private structure that may change between torch versions
        return None


def compile_metrics() -> dict[str, float]:
    """The counters above (zeros before anything was compiled)."""
    from torch._dynamo.utils import counters

    out = {
        "compile/frames": float(counters["frames"]["total"]),
        "compile/graphs": float(counters["stats"]["unique_graphs"]),
        "compile/graph_breaks": float(sum(counters["graph_break"].values())),
    }
    skips = counters["inductor"].get("cudagraph_skips", 0)
    recorded = _cudagraphs_recorded()
    if recorded is not None:
        out["compile/cudagraphs"] = float(recorded)
        out["compile/cudagraph_skips"] = float(skips)
    return out
