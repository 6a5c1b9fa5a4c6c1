"""The step API of Accelerate's DDP wrapper (``engine.accelerate: ddp``): a ``Driver`` (``driver.py``).

Gradient accumulation uses ``Accelerator.accumulate`` (DDP ``no_sync`` on the micro-batches before
the boundary, loss divided by the accumulation steps); the LR scheduler advances once per update.
fp16 runs with Accelerate's GradScaler (which skips an overflowing update and lowers its scale; the
minimum is ours, ``engine.fp16_min_loss_scale``). Checkpoints are Accelerate's ``save_state``
(``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``, per-rank RNG) plus one expert shard per
EP rank.

Expert parallelism (moe.ep_size > 1): the expert parameters are parameters DDP ignores
(``scaletrain.engine.experts.expert_setup``); at the update their gradients are summed over the
expert-data-parallel group / W and the clip norm counts each expert once (``scaletrain.parallel.grads``).
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from scaletrain.engine.base import StepInfo, min_loss_scale_error
from scaletrain.engine.device_skip import can_skip_on_device, clip_, grad_norm, nonfinite_flag, rewind_schedule, withheld_if
from scaletrain.engine.model_prep import cudagraph_step_begin
from scaletrain.engine.optim import own_grad_norm
from scaletrain.errors import ScaletrainError
from scaletrain.parallel.grads import ExpertParallelGrads
from scaletrain.parallel.state import expert_checkpoint_load, owned_params, save_expert_shard
from scaletrain.safeload import safe_torch_load, weights_only_loads


class DDPDriver:
    """Drives a model, optimizer and scheduler prepared by an ``accelerate.Accelerator`` without
    DeepSpeed. ``ep``: the model's experts and the engine's ``ParallelContext``; ``grad_accum``:
    micro-batches per update; ``cudagraphs``: engine.compile_mode=reduce-overhead on CUDA."""

    def __init__(self, acc, model, optimizer, scheduler, ep: ExpertParallelGrads, *, clip_norm: float,
                 grad_accum: int, fp16_min_loss_scale: float, cudagraphs: bool = False):
        self.acc, self.model, self.optimizer, self.scheduler, self.ep = acc, model, optimizer, scheduler, ep
        self.clip_norm, self.grad_accum, self.fp16_min_loss_scale = clip_norm, grad_accum, fp16_min_loss_scale
        self.cudagraphs = cudagraphs
        self._ctx: contextlib.ExitStack | None = None  # the accumulation context of the running micro-batch
        self._force_skip = False  # abandon_step: the next update is withheld

    @property
    def module(self) -> torch.nn.Module:
        return self.acc.unwrap_model(self.model)

    @property
    def zero_stage(self) -> int:
        return 0

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    def forward(self, src, tgt_in, src_padded: bool = True):
        if self.model.training and torch.is_grad_enabled():
            # DDP reads no_sync at forward time: enter the accumulation context here, leave after backward.
            if self._ctx is not None:
                raise RuntimeError("AccelerateEngine.forward called twice without backward")
            self._ctx = contextlib.ExitStack()
            self._ctx.enter_context(self.acc.accumulate(self.model))
        cudagraph_step_begin(self.cudagraphs and self.model.training)
        return self.model(src, tgt_in, src_padded=src_padded)

    def backward(self, loss) -> None:
        try:
            self.acc.backward(loss)  # divides by gradient_accumulation_steps
        finally:
            ctx, self._ctx = self._ctx, None
            if ctx is not None:
                ctx.close()

    def abandon_step(self, failed: int) -> None:
        """Micro-batch ``failed`` raised (``Engine.abandon_step``): the accumulation context its forward entered
        is left, the missing micro-steps are counted, and the update at the boundary is withheld."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()
        for _ in range(self.grad_accum - 1 - failed):
            with self.acc.accumulate(self.model):
                pass
        self._force_skip = True

    def step(self) -> StepInfo:
        clip = self.clip_norm
        if not self.acc.sync_gradients:
            raise RuntimeError(
                f"step() before the accumulation boundary: call forward/backward engine.grad_accum="
                f"{self.grad_accum} times per step"
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
        if scaler is not None and skipped and scaler.get_scale() < self.fp16_min_loss_scale:
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
        return float(self.optimizer.param_groups[0]["lr"])

    def loss_scale(self) -> float | None:
        """fp16: the GradScaler's scale (``get_scale()``, one host sync); else None."""
        scaler = getattr(self.acc, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None

    def partitioned(self) -> bool:
        return self.ep.active  # expert parallelism: this rank holds only its experts

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.ep.active:  # every expert of every layer, gathered over the EP group
            from scaletrain.parallel.state import consolidate_state_dict

            return {k: v.float().cpu().clone() for k, v in consolidate_state_dict(self.module, self.ep.ctx).items()}
        return {k: v.detach().float().cpu().clone() for k, v in self.module.state_dict().items()}

    def save(self, ckpt_dir: Path, tag: str) -> None:
        # model.safetensors (rank 0), optimizer.bin, scheduler.bin, per-rank RNG; experts: one shard per EP rank
        self.acc.save_state(str(Path(ckpt_dir) / tag), safe_serialization=True)
        save_expert_shard(Path(ckpt_dir) / tag, self.module, self.optimizer.optimizer, self.ep.ctx)

    def load(self, ckpt_dir: Path, tag: str) -> None:
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
