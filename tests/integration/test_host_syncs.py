"""No host synchronisation in a training step outside log, validation and save steps (docs/gpu_step.md).

The real trainer trains a tiny model in this process under ``torch.profiler``; every host read of a device
value (``aten::_local_scalar_dense``: ``.item()``, ``float(t)``, ``bool(t)``) is attributed to the update
whose loop iteration ran it (``scaletrain/train/sync_count.py``), leaving out torch's own optimizer step.
On CPU ``.tolist()`` and ``.cpu()`` of a tensor run no such operator, so they are counted too, by wrapping the
two methods (``sync_count.StepWatch``; host tensors are read with ``.numpy()``, which a device tensor refuses).
Outside log steps an update may do at most one (DeepSpeed's ZeRO-2 computes its global norm with one); the
plain paths (ZeRO-0 in fp32 and in bf16 by autocast, Accelerate DDP, the Accelerate DeepSpeed plugin) do
none. The last test plants DeepSpeed's unfused bf16 optimizer (one inf/nan read per parameter tensor) back
and shows the count sees it.
"""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from scaletrain.config import load_config

pytestmark = [pytest.mark.usefixtures("in_process_training", "isolated_env", "fresh_accelerate"), pytest.mark.slow]

STEPS, LOG_EVERY = 5, 4  # log steps 4 and 5; updates 1-3 must not read
TINY = [*tiny_model(), "data.max_bytes=40", "data.max_tokens=600", f"train.max_steps={STEPS}",
        f"train.log_every={LOG_EVERY}", "train.valid_every=0", "train.valid_max_batches=1", "train.save_every=0",
        "train.resume=false", "tracking.enabled=false", "engine.threads=1", "engine.grad_accum=2"]
ENGINES = {
    "deepspeed": ["engine.backend=deepspeed", "engine.ds_config=zero0.json"],
    "deepspeed-zero2": ["engine.backend=deepspeed", "engine.ds_config=zero2.json"],
    "accelerate": ["engine.backend=accelerate", "engine.accelerate=ddp"],
    "accelerate-deepspeed": ["engine.backend=accelerate", "engine.accelerate=deepspeed", "engine.ds_config=zero0.json"],
}


def reads_per_update(shards, out, engine: str, precision: str) -> tuple[dict[int, int], object]:
    import scaletrain.train.trainer as trainer_mod
    from scaletrain.train import Trainer
    from scaletrain.train.sync_count import StepWatch, host_reads_per_step, profiled, steps_seen

    tr = Trainer(load_config("small", [*TINY, *ENGINES[engine], f"engine.precision={precision}",
                                       f"data.shards={shards}", f"train.out_dir={out}"]))
    real_tolist = torch.Tensor.tolist
    with StepWatch(trainer_mod) as watch, profiled() as prof:
        res = tr.fit()
    tr.close()
    events = prof.events()
    reads = host_reads_per_step(events)
    assert steps_seen(events) == list(range(1, STEPS + 1)) and res.steps == STEPS
    assert watch.copies[LOG_EVERY] > 0  # the log step reads the values: the wrappers see it
    assert torch.Tensor.tolist is real_tolist  # the wrappers are gone again
    return {s: reads[s] + watch.copies[s] for s in range(1, STEPS + 1)}, tr


@pytest.mark.parametrize("engine,precision,allowed", [
    ("deepspeed", "fp32", 0), ("deepspeed", "bf16", 0), ("accelerate", "fp32", 0), ("accelerate", "bf16", 0),
    ("accelerate-deepspeed", "bf16", 0),
    ("deepspeed-zero2", "bf16", 1),  # DeepSpeed's ZeRO-1/2 norm masks inf/NaN with a 0-d tensor: one read
])
def test_no_host_reads_between_log_steps(django_shards, tmp_path, engine, precision, allowed):
    reads, tr = reads_per_update(django_shards, tmp_path, engine, precision)
    between = {s: n for s, n in reads.items() if s % LOG_EVERY and s != STEPS}
    assert between and all(n <= allowed for n in between.values()), reads
    assert tr.state.nonfinite_steps == 0 and tr.logger.loss_history  # the log steps did read the values


def test_the_count_sees_a_per_parameter_check(django_shards, tmp_path, monkeypatch):
    """DeepSpeed's own bf16 at ZeRO-0 (its unfused optimizer, as before the torch autocast translation):
    a host read per parameter tensor in every update."""
    import scaletrain.engine.deepspeed_backend as dse

    monkeypatch.setattr(dse, "runtime_ds_config", lambda ds: ds)
    reads, tr = reads_per_update(django_shards, tmp_path, "deepspeed", "bf16")
    assert type(tr.engine.backend.e.optimizer).__name__ == "FP16_UnfusedOptimizer"
    n_tensors = len(list(tr.engine.module.parameters()))
    assert all(reads[s] >= n_tensors for s in (1, 2, 3)), (reads, n_tensors)
