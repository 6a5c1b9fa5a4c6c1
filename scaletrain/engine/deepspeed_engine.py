"""DeepSpeed implementation of the Engine (native `deepspeed` launcher, ZeRO 0-3)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from scaletrain.engine.base import (
    Engine, StepInfo, build_optimizer, build_scheduler, configure_threads, ensure_dist_env,
    init_deepspeed_distributed, own_grad_norm, prepare_model,
)
from scaletrain.engine.preflight import preflight


class DeepSpeedEngine(Engine):
    def __init__(self, cfg):
        self.cfg = cfg
        ensure_dist_env()
        self.ds_config = preflight(cfg, int(os.environ["WORLD_SIZE"]))  # before any process group
        configure_threads(cfg)
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        self._ds = deepspeed
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        init_deepspeed_distributed(backend)
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        acc = get_accelerator()
        if acc.device_name() == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self._engine = None

    def setup(self, model):
        model = prepare_model(model, self.cfg)
        optimizer = build_optimizer(model, self.cfg)
        scheduler = build_scheduler(optimizer, self.cfg)
        engine, _, _, _ = self._ds.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
            dist_init_required=False,
        )
        self._engine = engine
        # DeepSpeed reports the global grad norm from its fp16/bf16/ZeRO optimizers only; on the
        # plain fp32 path it clips but discards the norm, so we measure it ourselves there.
        self._own_norm = not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization())
        self.device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)

    @property
    def module(self):
        return self._engine.module

    @property
    def zero_stage(self) -> int:
        return self._engine.zero_optimization_stage()

    def train(self, mode: bool = True):
        self._engine.train(mode)

    def forward(self, src, tgt_in):
        return self._engine(src, tgt_in)

    def backward(self, loss):
        self._engine.backward(loss)
        if not self._engine.is_gradient_accumulation_boundary():
            self._engine.step()  # DeepSpeed counts micro-steps; it only updates at the boundary

    def step(self) -> StepInfo:
        overflow_before = self._skipped()
        own = None
        if self._own_norm:
            own = own_grad_norm(self._engine.module.parameters())
        self._engine.step()
        norm = own if own is not None else self._engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return StepInfo(grad_norm=norm, lr=self.lr, skipped=self._skipped() > overflow_before)

    def _skipped(self) -> int:
        return int(getattr(self._engine, "skipped_steps", 0) or 0)

    @property
    def lr(self) -> float:
        return float(self._engine.get_lr()[0])

    @property
    def precision_dtype(self) -> torch.dtype:
        p = self.cfg.engine.precision
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(p, torch.float32)

    def save(self, ckpt_dir: Path, tag: str) -> None:
        self._engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)

    def load(self, ckpt_dir: Path, tag: str) -> None:
        path, _ = self._engine.load_checkpoint(
            str(ckpt_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt_dir}/{tag}")
