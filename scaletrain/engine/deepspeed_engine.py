"""DeepSpeed implementation of the Engine (native `deepspeed` launcher, ZeRO 0-3): start the distributed
run, wrap the model with ``deepspeed.initialize``, drive it with :class:`DeepSpeedDriver`."""
from __future__ import annotations

import logging
import os

import torch

from scaletrain.engine.deepspeed_driver import DeepSpeedDriver
from scaletrain.engine.driver import DrivenEngine
from scaletrain.engine.ds_config import runtime_ds_config
from scaletrain.engine.env import collective_timeout, configure_threads, ensure_dist_env, init_deepspeed_distributed
from scaletrain.engine.experts import expert_setup
from scaletrain.engine.model_prep import prepare_model, uses_cudagraphs
from scaletrain.engine.optim import build_optimizer, build_scheduler
from scaletrain.engine.preflight import preflight
from scaletrain.parallel.grads import ExpertParallelGrads


class DeepSpeedEngine(DrivenEngine):
    def __init__(self, cfg):
        self.cfg = cfg
        ensure_dist_env()
        configure_threads(cfg)  # first: the precision probe runs on the rank's threads
        # before any process group; bf16 at ZeRO-0 as torch autocast (ds_config.runtime_ds_config)
        self.ds_config = runtime_ds_config(preflight(cfg, int(os.environ["WORLD_SIZE"])))
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        from deepspeed.accelerator import get_accelerator

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

    def setup(self, model):
        import deepspeed

        model = prepare_model(model, self.cfg)
        ep = ExpertParallelGrads(model, self.parallel)
        stage = int((self.ds_config.get("zero_optimization") or {}).get("stage", 0))
        with expert_setup(model, ep, stage):  # expert parallelism: owned experts, DeepSpeed's MoE path
            optimizer = build_optimizer(model, self.cfg)
            scheduler = build_scheduler(optimizer, self.cfg)
            engine, _, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
                dist_init_required=False,
            )
        self.driver = DeepSpeedDriver(engine, self.parallel, clip_norm=float(self.cfg.optim.clip_norm),
                                      cudagraphs=uses_cudagraphs(self.cfg))
        self.device = self.driver.device
