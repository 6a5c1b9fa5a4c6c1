"""Driver of the expert-parallel training tests (run under the ``deepspeed`` launcher or
``accelerate launch``): ``ep_driver.py OUT SHARDS JOBS_JSON``.

A job ``{"name", "overrides", "grads": true}`` builds the trainer (engine set up, nothing trained),
runs one forward/backward of a fixed batch per rank through the engine, reduces the gradients the
way the engine does at an update (``ExpertParallelGrads``, or DDP's own all-reduce for the dense part),
gathers the expert gradients of every layer over the expert-parallel group (owned MoCE experts: from
their owner) and writes
OUT/NAME/grads_rank{r}.pt (a gradient of zeros where a parameter got none) plus OUT/NAME/info_rank{r}.json
(this rank's expert parameter count, the model's parameter count the trainer logs, ``no_grad``: the
names of the non-empty parameters that got no gradient).
Any other job is a training job of test_engine_replay.py's ``run_job`` (same global batch per update
for any layout; OUT/NAME/params_rank{r}.pt holds the consolidated parameters). NAME may hold a ``/``
(a subdirectory per group of jobs). Accelerate's process-wide settings (precision, gradient accumulation) are
cleared before each job, so one launch runs Accelerate DDP jobs of any precision and accumulation; the process
group stays.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "tests", ROOT / "tests" / "integration"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from test_engine_replay import TINY, Replay, fixed_batches, run_job  # noqa: E402


def _gathered_expert_grads(module, ctx) -> dict[str, torch.Tensor]:
    from scaletrain.parallel.state import gather_expert

    out = {}
    for name, p in module.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        out[name] = gather_expert(p, g, ctx) if getattr(p, "expert", False) and ctx.ep_size > 1 else g
    return out


def grads_job(out: Path, shards: str, job: dict) -> None:
    from scaletrain.cli import _setup_logging
    from scaletrain.config import load_config
    from scaletrain.engine import build_engine
    from scaletrain.parallel.grads import ExpertParallelGrads
    from scaletrain.train import Trainer

    _setup_logging(False)
    d = out / job["name"]
    d.mkdir(parents=True, exist_ok=True)
    cfg = load_config("small", [f"data.shards={shards}", f"train.out_dir={d}", *TINY, *job["overrides"]])
    eng = build_engine(cfg)
    dp = eng.parallel  # the data split: the parallel context's data-parallel rank and size
    batches = fixed_batches(shards, dp.world_size)
    trainer = Trainer(cfg, engine=eng, stream=Replay(batches, dp.rank, dp.world_size, 1))
    batch = batches[dp.rank].to(eng.device)
    eng.train(True)
    loss_sum, _, ntok = trainer.unit.loss(batch)
    total = eng.parallel.all_reduce_sum([float(ntok)])[0]
    eng.backward(loss_sum * eng.world_size / total)  # the engines average over the world
    ep = ExpertParallelGrads(eng.module, eng.parallel)
    if ep.active:
        ep.reduce(dense=cfg.engine.backend == "deepspeed")  # DDP already averaged the dense gradients
    grads = _gathered_expert_grads(eng.module, ep.ctx)
    torch.save(grads, d / f"grads_rank{eng.rank}.pt")
    # parameters this rank holds that got no gradient (an owned MoCE expert is empty off its owner)
    no_grad = [n for n, p in eng.module.named_parameters() if p.grad is None and p.numel()]
    write_info(d, eng, trainer.param_counts["total"], no_grad=no_grad)
    trainer.close()
    eng.parallel.barrier()


def write_info(d: Path, eng, total: int, **extra) -> None:
    experts = sum(p.numel() for p in eng.module.parameters() if getattr(p, "expert", False))
    info = {"expert_params": experts, "total_params": total, **extra}
    (d / f"info_rank{eng.rank}.json").write_text(json.dumps(info))


def main(argv: list[str]) -> None:
    from scaletrain.cli import _strip_launcher_args

    argv = _strip_launcher_args(argv)
    out, shards, jobs = Path(argv[0]), argv[1], json.loads(argv[2])
    for job in jobs:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
        if job.get("grads"):
            grads_job(out, shards, job)
        else:
            run_job(out, shards, job)


if __name__ == "__main__":
    from scaletrain.engine.shutdown import finishing_distributed

    with finishing_distributed():  # as `scaletrain train` ends: groups and threads finished first
        main(sys.argv[1:])
