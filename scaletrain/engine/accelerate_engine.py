"""Accelerate implementation of the Engine: plain DDP or the DeepSpeed plugin (engine.accelerate).

Runs under ``accelerate launch`` (our YAMLs in ds_configs/), under the ``deepspeed`` launcher, or as
a single plain process. On CPU the process group is gloo and the world size Accelerate reports is
checked against the launcher's WORLD_SIZE: Accelerate otherwise silently runs every process alone.

This module starts the distributed run (Accelerate's ``Accelerator``), wraps the model
(``Accelerator.prepare``, inside ``experts.expert_setup``) and chooses a driver: plain DDP is driven
by :class:`DDPDriver` (``ddp_driver.py``: accumulation, update, checkpoints, expert parallelism);
with the DeepSpeed plugin, Accelerate builds the DeepSpeed engine from our resolved ds_config and the
micro-steps are driven by the same :class:`DeepSpeedDriver` as :class:`DeepSpeedEngine`, so both
paths share checkpoints (plus ``scheduler.pt``: the LR schedule is ours there).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from scaletrain.engine.ddp_driver import DDPDriver
from scaletrain.engine.deepspeed_driver import DeepSpeedDriver
from scaletrain.engine.driver import DrivenEngine
from scaletrain.engine.ds_config import runtime_ds_config
from scaletrain.engine.env import collective_timeout, configure_threads, ensure_dist_env, init_deepspeed_distributed
from scaletrain.engine.experts import expert_setup
from scaletrain.engine.model_prep import prepare_model, uses_cudagraphs
from scaletrain.engine.optim import build_optimizer, build_scheduler
from scaletrain.engine.preflight import preflight
from scaletrain.errors import ScaletrainError
from scaletrain.parallel.grads import ExpertParallelGrads

MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def check_accelerate_launch(cfg) -> None:
    """One line where ``accelerate launch`` was given a DeepSpeed config that is not this run's."""
    launcher_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if launcher_ds and cfg.engine.accelerate != "deepspeed":
        raise ScaletrainError(
            "accelerate launch was given a DeepSpeed config (distributed_type: DEEPSPEED) but "
            "engine.accelerate is 'ddp'; set engine.accelerate=deepspeed or launch with ds_configs/accelerate_ddp.yaml"
        )
    launcher_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if launcher_ds and launcher_file:
        from scaletrain.engine.ds_config import resolve_ds_config_path

        ours = resolve_ds_config_path(cfg.engine.ds_config).resolve()
        theirs = Path(launcher_file)
        if not theirs.is_file() or theirs.resolve() != ours:
            raise ScaletrainError(
                f"the accelerate launch config names deepspeed_config_file {launcher_file} but engine.ds_config "
                f"is {cfg.engine.ds_config} ({ours}); make them the same file "
                "(launch.sh passes --deepspeed_config_file from engine.ds_config)"
            )


class AccelerateEngine(DrivenEngine):
    def __init__(self, cfg):
        self.cfg = cfg
        self.mode = cfg.engine.accelerate
        cuda = torch.cuda.is_available()
        check_accelerate_launch(cfg)
        expected = int(os.environ.get("WORLD_SIZE", "1"))
        configure_threads(cfg)  # first: the precision probe runs on the rank's threads
        self.ds_config = preflight(cfg, expected)
        if self.ds_config is not None:  # bf16 at ZeRO-0 as torch autocast (ds_config.runtime_ds_config)
            self.ds_config = runtime_ds_config(self.ds_config)
        for noisy in ("DeepSpeed", "accelerate", "accelerate.checkpointing", "accelerate.accelerator"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

        backend = "nccl" if cuda else "gloo"
        launched = "LOCAL_RANK" in os.environ or expected > 1
        plugin = None
        if self.mode == "deepspeed":
            ensure_dist_env()
            # Accelerate would pick DeepSpeed's default backend (ccl on CPU); initialise gloo first.
            init_deepspeed_distributed(backend, collective_timeout(cfg))
            os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
            plugin = DeepSpeedPlugin(hf_ds_config=self.ds_config)
        self.acc = Accelerator(
            cpu=not cuda and self.mode == "ddp",
            deepspeed_plugin=plugin,
            mixed_precision=MIXED[cfg.engine.precision],
            gradient_accumulation_steps=cfg.engine.grad_accum,
            step_scheduler_with_optimizer=False,  # else it steps the schedule once per process
            # a plain single process must not name a backend: Accelerate would then expect a process group
            kwargs_handlers=[InitProcessGroupKwargs(backend=backend, timeout=collective_timeout(cfg))] if launched else [],
        )
        if self.acc.num_processes != expected:
            raise ScaletrainError(
                f"Accelerate runs {self.acc.num_processes} process(es) but the launcher started {expected} "
                f"(WORLD_SIZE); on CPU the process group must be gloo and the launch config use_cpu: true"
            )
        self.rank = self.acc.process_index
        self.world_size = self.acc.num_processes
        self.local_rank = self.acc.local_process_index
        self.build_parallel(cfg)
        self.device = self.acc.device
        self.model = self.optimizer = self.scheduler = None  # Accelerate's wrappers, made in setup

    # ------------------------------------------------------------------------------
    def setup(self, model):
        model = prepare_model(model, self.cfg)
        cudagraphs = uses_cudagraphs(self.cfg)
        ep = ExpertParallelGrads(model, self.parallel)
        stage = int(((self.ds_config or {}).get("zero_optimization") or {}).get("stage", 0))
        with expert_setup(model, ep, stage, ddp=self.mode == "ddp"):
            optimizer = build_optimizer(model, self.cfg)
            scheduler = build_scheduler(optimizer, self.cfg)
            self.model, self.optimizer, self.scheduler = self.acc.prepare(model, optimizer, scheduler)
        clip = float(self.cfg.optim.clip_norm)
        if self.mode == "deepspeed":
            # Accelerate hands DeepSpeed only its own scheduler types: ours is stepped (and saved) by the driver
            self.driver = DeepSpeedDriver(self.acc.deepspeed_engine_wrapped.engine, self.parallel,
                                          scheduler=self.scheduler, clip_norm=clip, cudagraphs=cudagraphs)
            self.device = self.driver.device
        else:
            self.driver = DDPDriver(self.acc, self.model, self.optimizer, self.scheduler, ep, clip_norm=clip,
                                    grad_accum=self.cfg.engine.grad_accum,
                                    fp16_min_loss_scale=self.cfg.engine.fp16_min_loss_scale, cudagraphs=cudagraphs)
