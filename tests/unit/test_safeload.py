"""Weights-only loading, fast and in-process: RNG states survive a weights-only load,
a pickle payload is refused naming the file, DeepSpeed-style ``torch.load(weights_only=False)`` calls are
forced weights-only inside ``weights_only_loads``, a truncated file is named."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from scaletrain.checkpoint import rng_state, set_rng_state
from scaletrain.errors import ScaletrainError
from scaletrain.safeload import safe_torch_load, weights_only_loads


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _draws():
    return random.random(), float(np.random.rand()), float(np.random.randn()), float(torch.rand(1))


def test_rng_states_round_trip_through_a_weights_only_load(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    torch.save({"stream": {"epoch": 1}, "rng": rng_state()}, tmp_path / "rank00000.pt")
    expected = _draws()
    _draws()
    st = safe_torch_load(tmp_path / "rank00000.pt")
    set_rng_state(st["rng"])
    assert _draws() == expected


def test_payload_is_refused_naming_the_file_and_nothing_runs(tmp_path):
    f = tmp_path / "rank00000.pt"
    torch.save({"stream": {}, "x": Payload(tmp_path / "marker")}, f)
    with pytest.raises(ScaletrainError) as e:
        safe_torch_load(f)
    msg = str(e.value)
    assert str(f) in msg and "refused to load" in msg and "posix.mkdir" in msg and "\n" not in msg
    assert not (tmp_path / "marker").exists()


def test_third_party_weights_only_false_loads_are_forced_safe(tmp_path):
    f = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "x": Payload(tmp_path / "marker")}, f)
    with weights_only_loads():
        with pytest.raises(ScaletrainError, match="refused to load"):
            torch.load(f, map_location="cpu", weights_only=False)  # what DeepSpeed's loaders call
    assert not (tmp_path / "marker").exists()
    assert torch.load is not None and torch.load.__module__.startswith("torch")  # restored after the context
    good = tmp_path / "good.pt"
    torch.save({"module": {"w": torch.ones(2)}}, good)
    with weights_only_loads():
        assert torch.equal(torch.load(good, weights_only=False)["module"]["w"], torch.ones(2))


def test_deepspeed_plain_data_types_are_allowed(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    import scaletrain.checkpoint.deepspeed_files  # noqa: F401  (registers DeepSpeed's checkpoint types)

    f = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients}, f)
    st = safe_torch_load(f)
    assert st["zero_stage"] == ZeroStageEnum.gradients and isinstance(st["loss_scaler"], LossScaler)


def test_truncated_file_is_named(tmp_path):
    f = tmp_path / "optimizer.bin"
    torch.save({"w": torch.ones(1000)}, f)
    f.write_bytes(f.read_bytes()[:500])
    with pytest.raises(ScaletrainError, match="truncated or corrupt") as e:
        safe_torch_load(f)
    assert str(f) in str(e.value)


def test_rank_file_of_an_older_scaletrain_is_a_clear_error(tmp_path):
    from helpers import engine_holding
    from scaletrain.checkpoint import CheckpointContents, CheckpointManager

    mgr = CheckpointManager(tmp_path, engine_holding(torch.nn.Linear(2, 2)), keep_last=2)
    mgr.save(1, CheckpointContents({"step": 1, "tokens_seen": 0, "examples_seen": 0, "world_size": 1}, {"stream": {}},
                                   "", ["de"]))
    rank_file = mgr.root / "step-0000001" / "rank00000.pt"
    # the old format: python's state tuple and numpy's tuple holding an ndarray
    old = {"stream": {}, "rng": {"python": list(random.getstate()), "numpy": [], "torch": torch.get_rng_state()}}
    torch.save(old, rank_file)
    index = mgr.root / "step-0000001" / "index.json"
    index.unlink(missing_ok=True)  # a checkpoint from before integrity records
    with pytest.raises(ScaletrainError, match="checkpoints written before safe loading") as e:
        mgr.load("step-0000001")
    assert str(rank_file) in str(e.value)
