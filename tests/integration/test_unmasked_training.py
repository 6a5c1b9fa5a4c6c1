"""A training batch without source padding attends without a mask, through every engine (in this process, world
of one): ``TranslationUnit.loss`` hands ``Batch.src_padded`` (host-side counts) to ``Engine.forward``, so
encoder self-attention and cross-attention get no key-padding mask (FlashAttention on CUDA) in training and in
the validation loss. One update on such a batch gives the loss and the weights that the masked path gives
(the same batch with ``src_padded`` forced true), under DeepSpeed ZeRO-0, Accelerate DDP and the Accelerate
DeepSpeed plugin. Compiled (``aot_eager``), the flag is one more graph: a padded and an unpadded batch of one
shape compile twice, and a third batch reuses a graph."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from helpers import IN_PROCESS_ENGINES, reset_accelerate, tiny_model
from scaletrain.config import load_config
from scaletrain.data.batch import Batch, Example, collate
from scaletrain.models.kernels import SdpaKernels

pytestmark = [pytest.mark.usefixtures("in_process_training", "isolated_env", "fresh_accelerate"), pytest.mark.slow]

BASE = [*tiny_model(), "model.kernels=torch", "data.max_bytes=40", "data.max_tokens=600", "optim.lr=3e-3",
        "optim.warmup_steps=1", "train.valid_every=0", "train.save_every=0", "train.resume=false",
        "tracking.enabled=false", "engine.threads=1", "engine.precision=fp32", "engine.compile=false"]
ENGINES = IN_PROCESS_ENGINES


def _trainer(shards, out, engine: str, *over: str):
    from scaletrain.train import Trainer

    return Trainer(load_config("small", [*BASE, *ENGINES[engine], f"data.shards={shards}", f"train.out_dir={out}",
                                         *over]))


def _batch(padded: bool) -> Batch:
    """Three sentence pairs; equal source lengths (no PAD in src) unless ``padded`` (one source shorter: the
    batch keeps the shape, its last source row ends in PAD)."""
    src = [b"the cat sat", b"a dog ran!!", b"birds sing."]
    if padded:
        src[1] = b"a dog ran"
    ex = [Example(0, 1, s, t) for s, t in zip(src, [b"die Katze", b"ein Hund", b"Voegel"])]
    b = collate(ex)
    assert b.src_padded == padded and b.src.shape == (3, 13)
    return b


def _masked(calls) -> list[bool]:
    return [m for _, m in calls]


def _one_update(tr, batch: Batch, spy: bool = True):
    """(loss sum, attention calls, parameters after the update) of one update on ``batch``. ``spy=False``:
    no ``SdpaKernels`` (dynamo does not compile under a dispatch mode; no calls are recorded)."""
    from scaletrain.train.unit import train_step

    eng = tr.engine
    eng.train(True)
    before = [p.detach().clone() for p in eng.module.parameters()]
    with SdpaKernels() if spy else contextlib.nullcontext(SimpleNamespace(calls=[])) as k:
        out = train_step(eng, tr.unit, [batch], stop_vote=False)
    params = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    assert not out.info.skipped and any(not torch.equal(a, b) for a, b in zip(before, params.values()))
    return out.loss_sum, k.calls, params


@pytest.mark.parametrize("engine", list(ENGINES))
def test_unpadded_batch_trains_without_a_mask_and_like_the_masked_path(django_shards, tmp_path, engine, monkeypatch):
    from scaletrain.train.unit import validation_loss

    batch = _batch(padded=False)
    tr = _trainer(django_shards, tmp_path / "unmasked", engine)
    loss, calls, params = _one_update(tr, batch)
    # 1 encoder self-attention, 1 decoder self-attention (causal), 1 cross-attention: none masked
    assert len(calls) == 3 and _masked(calls) == [False] * 3, calls
    with SdpaKernels() as k:
        nll = validation_loss(tr.engine, tr.unit, [batch], 1)
    assert len(k.calls) == 3 and not any(_masked(k.calls)), k.calls
    tr.close()
    reset_accelerate()

    monkeypatch.setattr(Batch, "src_padded", property(lambda self: True))  # the masked path, same batch
    tr = _trainer(django_shards, tmp_path / "masked", engine)
    loss_m, calls_m, params_m = _one_update(tr, batch)
    assert _masked(calls_m) == [True, False, True], calls_m  # encoder self-attention, decoder, cross
    nll_m = validation_loss(tr.engine, tr.unit, [batch], 1)
    tr.close()
    reset_accelerate()
    assert loss == pytest.approx(loss_m, rel=1e-6) and nll == pytest.approx(nll_m, rel=1e-6)
    for n, p in params_m.items():
        torch.testing.assert_close(params[n], p, rtol=1e-5, atol=1e-7, msg=n)


def test_compiled_model_takes_the_flag_as_one_more_graph(django_shards, tmp_path):
    """DeepSpeed ZeRO-0, ``engine.compile=true`` (aot_eager): unpadded, padded, unpadded batches of one shape
    give the eager run's losses; the second batch compiles once more (the flag is a guard), the third
    reuses the first graph."""
    import torch._dynamo

    from scaletrain.train.compile_stats import compile_metrics

    batches = [_batch(False), _batch(True), _batch(False)]
    tr = _trainer(django_shards, tmp_path / "eager", "deepspeed")
    eager = [_one_update(tr, b, spy=False)[0] for b in batches]
    tr.close()
    torch._dynamo.reset()
    tr = _trainer(django_shards, tmp_path / "compiled", "deepspeed", "engine.compile=true",
                  "engine.compile_backend=aot_eager")
    assert getattr(tr.engine.module, "_compiled_call_impl", None) is not None
    compiled, frames = [], []
    for b in batches:
        loss, _, _ = _one_update(tr, b, spy=False)
        compiled.append(loss)
        frames.append(compile_metrics()["compile/frames"])
    tr.close()
    torch._dynamo.reset()
    assert compiled == pytest.approx(eager, rel=1e-5), (compiled, eager)
    assert frames[0] >= 1 and frames[1] > frames[0] and frames[2] == frames[1], frames
