"""DeepSpeed implementation of the Engine (native `deepspeed` launcher, ZeRO 0-3)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from scaletrain.engine.base import Engine, StepInfo
from scaletrain.engine.deepspeed_driver import DeepSpeedDriver, expert_setup
from scaletrain.engine.ds_config import runtime_ds_config
from scaletrain.engine.env import collective_timeout, configure_threads, ensure_dist_env, init_deepspeed_distributed
from scaletrain.engine.model_prep import prepare_model, uses_cudagraphs
from scaletrain.engine.optim import build_optimizer, build_scheduler
from scaletrain.engine.preflight import preflight
from scaletrain.parallel.grads import ExpertParallelGrads


class DeepSpeedEngine(Engine):
    def __init__(self, cfg):
        self.cfg = cfg
        ensure_dist_env()
        configure_threads(cfg)  # first: the precision probe runs on the rank's threads
        # before any process group; bf16 at ZeRO-0 as torch autocast (ds_config.runtime_ds_config)
        self.ds_config = runtime_ds_config(preflight(cfg, int(os.environ["WORLD_SIZE"])))
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        self._ds = deepspeed
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        init_deepspeed_distributed(backend, collective_timeout(cfg))
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if get_accelerator().device_name() == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.build_parallel(cfg)
        self.driver: DeepSpeedDriver | None = None

    def setup(self, model):
        model = prepare_model(model, self.cfg)
        ep = ExpertParallelGrads(model, self.parallel)
        experts = ep.snapshot() if ep.active else None
        stage = int((self.ds_config.get("zero_optimization") or {}).get("stage", 0))
        with expert_setup(model, ep, stage):  # expert parallelism: owned experts, DeepSpeed's MoE path
            optimizer = build_optimizer(model, self.cfg)
            scheduler = build_scheduler(optimizer, self.cfg)
            engine, _, _, _ = self._ds.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
                dist_init_required=False,
            )
        if experts is not None:  # DeepSpeed broadcast rank 0's parameters, experts included
            ep.restore(experts)
        self.driver = DeepSpeedDriver(engine, self.parallel, clip_norm=float(self.cfg.optim.clip_norm),
                                      cudagraphs=uses_cudagraphs(self.cfg))
        self.device = self.driver.device

    @property
    def module(self):
        return self.driver.module

    @property
    def zero_stage(self) -> int:
        return self.driver.zero_stage

    def train(self, mode: bool = True):
        self.driver.train(mode)

    def forward(self, src, tgt_in):
        return self.driver.forward(src, tgt_in)

    def backward(self, loss):
        self.driver.backward(loss)

    def step(self) -> StepInfo:
        return self.driver.step()

    def abandon_step(self, failed: int) -> None:
        self.driver.abandon_step(failed)

    @property
    def lr(self) -> float:
        return self.driver.lr

    def loss_scale(self) -> float | None:
        return self.driver.loss_scale()

    def partitioned(self) -> bool:
        return self.driver.partitioned()

    def full_state_dict(self):
        return self.driver.full_state_dict()

    def save(self, ckpt_dir: Path, tag: str) -> None:
        self.driver.save(ckpt_dir, tag)

    def load(self, ckpt_dir: Path, tag: str) -> None:
        self.driver.load(ckpt_dir, tag)
