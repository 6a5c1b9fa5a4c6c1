"""Accelerate implementation of the Engine: plain DDP or the DeepSpeed plugin (engine.accelerate).

Runs under ``accelerate launch`` (our YAMLs in ds_configs/), under the ``deepspeed`` launcher, or as
a single plain process. On CPU the process group is gloo and the world size Accelerate reports is
checked against the launcher's WORLD_SIZE: Accelerate otherwise silently runs every process alone.

Gradient accumulation uses ``Accelerator.accumulate`` (DDP ``no_sync`` on the micro-batches before
the boundary, loss divided by the accumulation steps); the LR scheduler advances once per update.
With the DeepSpeed plugin, Accelerate builds the DeepSpeed engine from our resolved ds_config and
the micro-steps are driven by the same :class:`DeepSpeedDriver` as :class:`DeepSpeedEngine`, so both
paths share checkpoints.

Expert parallelism (moe.ep_size > 1), DDP: the expert parameters are given to DDP as parameters to
ignore (``_ddp_params_and_buffers_to_ignore``: no all-reduce, no start-up broadcast of rank 0's
experts); at the update their gradients are summed over the expert-data-parallel group / W and the
clip norm counts each expert once (``scaletrain.parallel.grads``). The DeepSpeed plugin: as the
DeepSpeed engine (ZeRO-0/1/2, fp32; ``deepspeed_driver``).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path

import torch

from scaletrain.engine.base import Engine, StepInfo, min_loss_scale_error
from scaletrain.engine.deepspeed_driver import DeepSpeedDriver, expert_setup
from scaletrain.engine.device_skip import can_skip_on_device, clip_, grad_norm, nonfinite_flag, rewind_schedule, withheld_if
from scaletrain.engine.ds_config import runtime_ds_config
from scaletrain.engine.env import collective_timeout, configure_threads, ensure_dist_env, init_deepspeed_distributed
from scaletrain.engine.model_prep import cudagraph_step_begin, prepare_model, uses_cudagraphs
from scaletrain.engine.optim import build_optimizer, build_scheduler, own_grad_norm
from scaletrain.engine.preflight import preflight
from scaletrain.errors import ScaletrainError
from scaletrain.parallel.grads import ExpertParallelGrads
from scaletrain.parallel.state import expert_checkpoint_load, owned_params, save_expert_shard
from scaletrain.safeload import safe_torch_load, weights_only_loads

MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


class AccelerateEngine(Engine):
    _force_skip = False  # abandon_step: the next update is withheld
    _cudagraphs = False  # engine.compile_mode=reduce-overhead on CUDA
    def __init__(self, cfg):
        self.cfg = cfg
        self.mode = cfg.engine.accelerate
        cuda = torch.cuda.is_available()
        launcher_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if launcher_ds and self.mode != "deepspeed":
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
        self.model = None
        self._ds: DeepSpeedDriver | None = None
        self._micro = 0
        self._ctx = None

    # ------------------------------------------------------------------------------
    def setup(self, model):
        model = prepare_model(model, self.cfg)
        self._cudagraphs = uses_cudagraphs(self.cfg)
        self.ep = ExpertParallelGrads(model, self.parallel)
        experts = self.ep.snapshot() if self.ep.active else None
        if self.ep.active and self.mode == "ddp":  # DDP neither reduces nor broadcasts the experts
            model._ddp_params_and_buffers_to_ignore = list(self.ep.expert_names)
        stage = int(((self.ds_config or {}).get("zero_optimization") or {}).get("stage", 0))
        with expert_setup(model, self.ep, stage if self.mode == "deepspeed" else 0):
            optimizer = build_optimizer(model, self.cfg)
            scheduler = build_scheduler(optimizer, self.cfg)
            self.model, self.optimizer, self.scheduler = self.acc.prepare(model, optimizer, scheduler)
        if self.mode == "deepspeed":
            if experts is not None:  # DeepSpeed broadcast rank 0's parameters, experts included
                self.ep.restore(experts)
            # Accelerate hands DeepSpeed only its own scheduler types: ours is stepped by the driver
            self._ds = DeepSpeedDriver(self.acc.deepspeed_engine_wrapped.engine, self.parallel, scheduler=self.scheduler,
                                       clip_norm=float(self.cfg.optim.clip_norm), cudagraphs=self._cudagraphs)
            self.device = self._ds.device

    @property
    def module(self):
        return self.acc.unwrap_model(self.model) if self._ds is None else self._ds.module

    @property
    def zero_stage(self) -> int:
        return self._ds.zero_stage if self._ds is not None else 0

    def train(self, mode: bool = True):
        if self._ds is not None:
            self._ds.train(mode)
        else:
            self.model.train(mode)

    def forward(self, src, tgt_in):
        if self._ds is None and self.model.training and torch.is_grad_enabled():
            # DDP reads no_sync at forward time: enter the accumulation context here, leave after backward.
            if self._ctx is not None:
                raise RuntimeError("AccelerateEngine.forward called twice without backward")
            self._ctx = contextlib.ExitStack()
            self._ctx.enter_context(self.acc.accumulate(self.model))
        if self._ds is None:
            cudagraph_step_begin(self._cudagraphs and self.model.training)
        return self.model(src, tgt_in)

    def backward(self, loss):
        if self._ds is not None:
            self._ds.backward(loss)
            return
        try:
            self.acc.backward(loss)  # divides by gradient_accumulation_steps
        finally:
            ctx, self._ctx = self._ctx, None
            if ctx is not None:
                ctx.close()

    def abandon_step(self, failed: int) -> None:
        """Micro-batch ``failed`` raised (``Engine.abandon_step``): the accumulation context its forward entered
        is left, the missing micro-steps are counted, and the update at the boundary is withheld."""
        if self._ds is not None:
            self._ds.abandon_step(failed)
            return
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()
        for _ in range(self.cfg.engine.grad_accum - 1 - failed):
            with self.acc.accumulate(self.model):
                pass
        self._force_skip = True

    def step(self) -> StepInfo:
        clip = float(self.cfg.optim.clip_norm)
        if self._ds is not None:
            return self._ds.step()
        if not self.acc.sync_gradients:
            raise RuntimeError(
                f"step() before the accumulation boundary: call forward/backward engine.grad_accum="
                f"{self.cfg.engine.grad_accum} times per step"
            )
        forced, self._force_skip = self._force_skip, False
        if forced:
            self.optimizer.zero_grad(set_to_none=True)
            return StepInfo(grad_norm=float("nan"), lr=self.lr, skipped=True, nonfinite=False)
        if self.acc.scaler is None and not self.ep.active and can_skip_on_device(self.optimizer.optimizer):
            return self._device_step(clip)
        if self.ep.active:
            self.acc.unscale_gradients()  # fp16: the reduction and the norm see true gradients
            self.ep.reduce(dense=False)  # DDP averaged the dense gradients
            norm = self.ep.clip(clip)
        elif clip > 0:
            norm = self.acc.clip_grad_norm_(self.model.parameters(), clip)  # a device tensor: read on log steps
        else:
            self.acc.unscale_gradients()
            norm = own_grad_norm(self.model.parameters())
        scaler = self.acc.scaler  # fp16: the GradScaler skips overflowing updates and lowers its scale
        if scaler is None and not math.isfinite(float(norm)):  # the reduced gradient: the same on every rank
            self.optimizer.zero_grad(set_to_none=True)
            return StepInfo(grad_norm=norm, lr=self.lr, skipped=True, nonfinite=True)
        self.optimizer.step()
        skipped = bool(self.optimizer.step_was_skipped)
        if not skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if scaler is not None and skipped and scaler.get_scale() < self.cfg.engine.fp16_min_loss_scale:
            raise min_loss_scale_error(scaler.get_scale())  # GradScaler itself has no minimum
        return StepInfo(grad_norm=norm, lr=self.lr, skipped=skipped)

    def _device_step(self, clip: float) -> StepInfo:
        """fp32 and bf16 (autocast) DDP: the gradient (reduced by DDP, the same on every rank) is measured,
        clipped and, where non-finite, withheld by the fused AdamW on the device (``device_skip``); the LR
        schedule steps and is put back when the flag is read."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = grad_norm(params)
        clip_(params, clip, norm)
        flag = nonfinite_flag(norm)
        with withheld_if(self.optimizer.optimizer, flag):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepInfo(grad_norm=norm, lr=self.lr, flag=flag, on_skip=lambda: rewind_schedule(self.scheduler))

    @property
    def lr(self) -> float:
        if self._ds is not None:
            return self._ds.lr
        return float(self.optimizer.param_groups[0]["lr"])

    def loss_scale(self) -> float | None:
        """fp16: DeepSpeed's scale, or the GradScaler's (``get_scale()``, one host sync); else None."""
        if self._ds is not None:
            return self._ds.loss_scale()
        scaler = getattr(self.acc, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None

    def partitioned(self) -> bool:
        if self._ds is not None:
            return self._ds.partitioned()
        return self.ep.active  # expert parallelism: this rank holds only its experts

    def full_state_dict(self):
        if self._ds is not None:
            return self._ds.full_state_dict()
        if self.ep.active:  # every expert of every layer, gathered over the EP group
            from scaletrain.parallel.state import consolidate_state_dict

            return {k: v.float().cpu().clone() for k, v in consolidate_state_dict(self.module, self.ep.ctx).items()}
        return super().full_state_dict()

    # ------------------------------------------------------------------------------
    def save(self, ckpt_dir: Path, tag: str) -> None:
        if self._ds is not None:
            self._ds.save(ckpt_dir, tag)
            if self.is_main:  # the LR schedule is ours, not DeepSpeed's (see step())
                torch.save(self.scheduler.state_dict(), Path(ckpt_dir) / tag / "scheduler.pt")
            return
        # model.safetensors (rank 0), optimizer.bin, scheduler.bin, per-rank RNG; experts: one shard per EP rank
        self.acc.save_state(str(Path(ckpt_dir) / tag), safe_serialization=True)
        save_expert_shard(Path(ckpt_dir) / tag, self.module, self.optimizer.optimizer, self.ep.ctx)

    def load(self, ckpt_dir: Path, tag: str) -> None:
        if self._ds is not None:
            sched = Path(ckpt_dir) / tag / "scheduler.pt"
            if not sched.is_file():
                raise ScaletrainError(f"{sched} missing: this checkpoint was not written by the Accelerate DeepSpeed engine")
            sched_state = safe_torch_load(sched)
            self._ds.load(ckpt_dir, tag)
            self.scheduler.load_state_dict(sched_state)
            return
        d = Path(ckpt_dir) / tag
        if not (d / "optimizer.bin").is_file():
            raise ScaletrainError(
                f"{d}: not an Accelerate DDP checkpoint (no optimizer.bin); it was written by another engine "
                "(DeepSpeed); resume it with the engine that wrote it"
            )
        # Accelerate's load_state reads optimizer.bin / scheduler.bin / random_states_*.pkl with torch.load;
        # inside weights_only_loads those loads are weights-only. It swallows any error of the RNG file
        # (our RNG states come from rank*.pt anyway), so that file is checked here first.
        for rng_file in sorted(d.glob("random_states_*.pkl")):
            safe_torch_load(rng_file)
        # experts: this rank's from its shard file, resharded when the checkpoint's ep_size differs
        strict = self._check_owned_keys(d)
        with expert_checkpoint_load(d, self.module, self.optimizer.optimizer, self.ep.ctx), weights_only_loads():
            self.acc.load_state(str(d), strict=strict)

    def _check_owned_keys(self, d: Path) -> bool:
        """safetensors leaves out of model.safetensors the experts that were empty on rank 0 (owned MoCE
        experts of other ranks: zero-size tensors look "shared" to it); those, and only those, may be
        missing there, so the load is not strict then. Their values come from the expert shard files."""
        owned = owned_params(self.module)
        if not owned:
            return True
        from safetensors import safe_open

        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            have = set(f.keys())
        missing = set(self.module.state_dict()) - have - set(owned)
        if missing:
            raise ScaletrainError(f"{d / 'model.safetensors'} lacks {sorted(missing)[:5]}; use an earlier checkpoint")
        return False
