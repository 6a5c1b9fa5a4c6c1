"""scaletrain.engine.shutdown.release_process_groups: after it, not one thread of the process groups this
process made is left (a gloo group's worker threads end only when the group is destructed; one still
running at interpreter exit can abort a finished job, tests/integration/test_clean_exit.py). Planted here:
a side group with a collective done on it, and a function of a loaded module defined after the group was
up, holding it as a default argument (as ``torch.distributed.nn`` does when DDP imports it then; DDP itself
runs in the accelerate job of tests/integration/test_clean_exit.py)."""
from __future__ import annotations

import os
import sys
import types

import pytest


def _gloo_threads() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sum("gloo" in n for n in names)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names from /proc (Linux)")
def test_release_joins_every_group_thread(tmp_path, isolated_env, monkeypatch):
    import torch
    import torch.distributed as dist

    from scaletrain.engine.shutdown import release_process_groups

    assert not dist.is_initialized()
    before = _gloo_threads()  # groups another test leaked would count here, not below
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    side = dist.new_group(backend="gloo")  # like the engine's host group
    dist.all_reduce(torch.ones(3), group=side)
    planted = types.ModuleType("planted_after_init")
    exec("import torch.distributed as dist\ndef send(x, group=dist.group.WORLD):\n    return group\n", vars(planted))
    monkeypatch.setitem(sys.modules, planted.__name__, planted)
    assert planted.send.__defaults__[0] is not None and _gloo_threads() > before
    del side
    release_process_groups()
    assert not dist.is_initialized() and planted.send.__defaults__ == (None,)
    assert _gloo_threads() == before
