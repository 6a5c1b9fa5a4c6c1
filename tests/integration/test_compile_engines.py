"""``engine.compile`` through both engines (in this process, world of one): a few updates of a compiled model
through DeepSpeed (ZeRO-0, bf16 by autocast), Accelerate DDP and the Accelerate DeepSpeed plugin
follow the eager run's losses; the step log carries the compile counters. On CPU the test compiles with
``aot_eager`` (dynamo's graph capture and AOT autograd: what meets the engines' hooks, autocast and wrappers)
instead of inductor, whose C++ code generation takes minutes on two shared cores; ``benchmarks/gpu_step.sh``
runs inductor and CUDA graphs on a GPU."""
from __future__ import annotations

import pytest

from helpers import IN_PROCESS_ENGINES, reset_accelerate, tiny_model
from scaletrain.config import load_config
from scaletrain.engine.model_prep import compile_on

pytestmark = [pytest.mark.usefixtures("in_process_training", "isolated_env", "fresh_accelerate"), pytest.mark.slow]

BASE = [*tiny_model(), "data.max_bytes=40", "data.max_tokens=600", "optim.lr=3e-3", "optim.warmup_steps=4",
        "train.max_steps=4", "train.log_every=1", "train.valid_every=0", "train.valid_max_batches=1",
        "train.save_every=0", "train.resume=false", "tracking.enabled=false", "engine.threads=1"]
ENGINES = IN_PROCESS_ENGINES


@pytest.fixture(autouse=True)
def fresh_dynamo():
    yield
    import torch._dynamo

    torch._dynamo.reset()


def _losses(shards, out, engine, precision, *compile_over):
    from scaletrain.train import Trainer

    tr = Trainer(load_config("small", [*BASE, *ENGINES[engine], f"engine.precision={precision}",
                                       f"data.shards={shards}", f"train.out_dir={out}", *compile_over]))
    res = tr.fit()
    tr.close()
    reset_accelerate()
    return [v for _, v in res.train_loss], tr


@pytest.mark.parametrize("engine,precision", [("deepspeed", "bf16"), ("accelerate", "fp32"),
                                              ("accelerate-deepspeed", "fp32")])
def test_compiled_training_follows_eager(django_shards, tmp_path, engine, precision):
    from scaletrain.train.compile_stats import compile_metrics

    eager, tr = _losses(django_shards, tmp_path / "eager", engine, precision, "engine.compile=false")
    assert not compile_on(tr.cfg) and "compile/frames" not in tr.logger.last_metrics
    compiled, tr = _losses(django_shards, tmp_path / "compiled", engine, precision, "engine.compile=true",
                           "engine.compile_backend=aot_eager")
    assert getattr(tr.engine.module, "_compiled_call_impl", None) is not None  # compiled in place
    assert len(compiled) == len(eager) == 4
    tol = 2e-2 if precision == "bf16" else 1e-4  # bf16: rounding inside the fused graph differs
    assert compiled == pytest.approx(eager, rel=tol), (compiled, eager)
    assert compiled[-1] < compiled[0]
    m = tr.logger.last_metrics
    assert m["compile/frames"] >= 1 and m["compile/graphs"] >= 1 and compile_metrics()["compile/frames"] >= 1


def test_auto_compiles_on_cuda_only():
    cfg = load_config("small", [])
    assert cfg.engine.compile == "auto" and compile_on(cfg, cuda=True) and not compile_on(cfg, cuda=False)
    assert not compile_on(load_config("small", ["engine.compile=false"]), cuda=True)
    assert compile_on(load_config("small", ["engine.compile=true"]), cuda=False)
