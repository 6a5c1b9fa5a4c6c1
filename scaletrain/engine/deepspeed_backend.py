"""The DeepSpeed backend (``engine.backend=deepspeed``, ZeRO 0-3, and ``engine.accelerate=deepspeed``): what
only DeepSpeed does for the :class:`~scaletrain.engine.engine.Engine`.

Start: DeepSpeed's launcher (or a plain process) and ``deepspeed.init_distributed``, or Accelerate's
``Accelerator`` with its DeepSpeed plugin (``accelerate=True``); both hand DeepSpeed our resolved
``ds_config`` (bf16 at ZeRO-0 as torch autocast, ``ds_config.runtime_ds_config``). Wrap:
``deepspeed.initialize`` (or Accelerate's ``prepare``) inside the expert set-up (``experts.py``), with our
AdamW and no LR scheduler: the schedule is the engine's. Then DeepSpeed's micro-step protocol (``backward``,
``step`` before the boundary counts a micro-step), its update, its global norm where its optimizers measure
it (fp16/bf16 optimizers, ZeRO), ZeRO-3's gathers and its checkpoint files (``save_checkpoint`` /
``load_checkpoint``; what else a checkpoint holds and how DeepSpeed's files are read without an engine is
``scaletrain.checkpoint``). Whatever reaches past DeepSpeed's public API is ``deepspeed_internals.py``.

Expert parallelism (``ds_config`` says which precisions): at ZeRO-0 DeepSpeed would average every gradient
over the whole world, expert gradients included, so its backward all-reduce is switched off and the engine
reduces (``reduces_dense`` False); at ZeRO-1/2 DeepSpeed's own MoE path reduces and partitions the experts.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

import scaletrain.engine.deepspeed_internals as dsi
from scaletrain.engine.ds_config import runtime_ds_config, zero_stage
from scaletrain.engine.engine import MOMENTS, Backend, WholeState, init_adam_state, min_loss_scale_error
from scaletrain.engine.netif import choose_socket_ifname
from scaletrain.engine.rendezvous import bounded_start
from scaletrain.engine.env import (check_accelerate_launch, collective_timeout, configure_threads, ensure_dist_env,
                                  start_accelerator)
from scaletrain.engine.experts import expert_setup
from scaletrain.engine.optim import build_optimizer
from scaletrain.engine.preflight import preflight
from scaletrain.errors import ScaletrainError


def is_partitioned(module: torch.nn.Module) -> bool:
    """True if DeepSpeed ZeRO-3 partitions this module's parameters (a rank holds only a slice)."""
    return dsi.zero3_partitioned(module)


def _not_here(p: torch.Tensor) -> bool:
    """An owned expert of another EP rank (empty here); ZeRO-3's partitioned parameters are empty too but hold
    a slice (``ds_numel``)."""
    return getattr(p, "ep_owner", None) is not None and p.numel() == 0


class DeepSpeedBackend(Backend):
    """One ``deepspeed.DeepSpeedEngine`` (``e``), built by DeepSpeed or, ``accelerate=True``, by Accelerate."""

    native_checkpoint = True

    def __init__(self, accelerate: bool = False):
        self.accelerate = accelerate
        self.name = "accelerate/deepspeed" if accelerate else "deepspeed"
        self.acc = None
        self.e = None
        self._hook: dsi.ZeroNormHook | None = None

    def start(self, cfg) -> None:
        if self.accelerate:
            check_accelerate_launch(cfg)
        configure_threads(cfg)
        dsi.import_deepspeed()  # first, without MLflow (its autotuner's import; scaletrain's tracker imports its own)
        ensure_dist_env()
        world = int(os.environ["WORLD_SIZE"])
        self.ds_config = runtime_ds_config(preflight(cfg, world))  # bf16 at ZeRO-0 as torch autocast
        self.zero_stage = int(zero_stage(self.ds_config))
        for noisy in ("DeepSpeed", "accelerate", "accelerate.checkpointing", "accelerate.accelerator"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        with bounded_start(cfg):  # every peer connected within engine.rendezvous_timeout_s, or one line
            choose_socket_ifname()  # before the process group: the interface that reaches the rendezvous
            # Accelerate would pick DeepSpeed's default backend (ccl on CPU): gloo (or nccl) is started here first
            dsi.init_distributed("nccl" if torch.cuda.is_available() else "gloo", collective_timeout(cfg))
        if self.accelerate:
            from accelerate.utils import DeepSpeedPlugin

            os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
            self.acc = start_accelerator(cfg, world, plugin=DeepSpeedPlugin(hf_ds_config=self.ds_config))
            self.rank, self.world_size = self.acc.process_index, self.acc.num_processes
            self.local_rank, self.device = self.acc.local_process_index, self.acc.device
            return
        from deepspeed.accelerator import get_accelerator

        self.rank, self.world_size = int(os.environ["RANK"]), world
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if get_accelerator().device_name() == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)

    def wrap(self, model, ep, cfg):
        import deepspeed

        with expert_setup(model, ep, self.zero_stage):  # expert parallelism: owned experts, DeepSpeed's MoE path
            optimizer = build_optimizer(model, cfg)
            if self.acc is not None:
                self.acc.prepare(model, optimizer)
                e = self.acc.deepspeed_engine_wrapped.engine
            else:
                e, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config,
                                                  dist_init_required=False)
        self.e = self.model = e
        self.module = e.module
        self.device = e.device if isinstance(e.device, torch.device) else torch.device(e.device)
        self.loss_scaled = e.fp16_enabled()
        # DeepSpeed's fp16/bf16/ZeRO optimizers measure the norm; on the plain path (fp32, bf16 by torch
        # autocast: ZeRO-0) the engine does (runtime_ds_config switches DeepSpeed's own clipping off there)
        self.norm_is_ours = not (e.fp16_enabled() or e.bfloat16_enabled() or e.zero_optimization())
        self._check_expert_parallel(ep)
        if ep.active and self.zero_stage == 0:  # the engine reduces: dense over the world, experts over EDP
            dsi.backward_allreduce_off(e)
            self.reduces_dense = False
        elif self.world_size == 1 and self.zero_stage == 0:
            # an average over a world of one is the gradient itself; DeepSpeed would still flatten every
            # gradient, scale it by 1 and copy it back (3-7% of a CPU step)
            dsi.backward_allreduce_off(e)
        if e.zero_optimization() and not e.fp16_enabled():
            self._hook = dsi.ZeroNormHook.install(e)
            self.withholds_on_device = self._hook is not None
        return optimizer

    def _check_expert_parallel(self, ep) -> None:
        e = self.e
        if not ep.active:
            return
        if self.zero_stage not in (0, 1, 2) or e.fp16_enabled() or (self.zero_stage == 0 and e.bfloat16_enabled()):
            # ZeRO-0 with DeepSpeed's own bf16/fp16 optimizer (FP16_UnfusedOptimizer) would copy rank 0's
            # experts into its fp32 master weights (ds_config._expert_parallel_refusal); bf16 at ZeRO-0
            # reaches DeepSpeed as torch autocast (ds_config.runtime_ds_config) and passes here
            raise ScaletrainError("moe.ep_size > 1 under DeepSpeed needs ZeRO-0/1/2 in fp32 or bf16, with bf16 at "
                                  "ZeRO-0 as torch autocast (docs/EXPERT_PARALLEL.md); use "
                                  "engine.ds_config=zero0.json engine.precision=bf16 or fp32")
        if self.zero_stage in (1, 2) and not dsi.takes_moe_path(e):
            raise ScaletrainError("DeepSpeed did not take the expert parameters (build the engine inside "
                                  "scaletrain.engine.experts.expert_setup)")

    def backward(self, loss) -> None:
        self.e.backward(loss)
        if not self.e.is_gradient_accumulation_boundary():
            self.e.step()  # DeepSpeed counts micro-steps; it only updates at the boundary

    def at_boundary(self) -> bool:
        return self.e.is_gradient_accumulation_boundary()

    def skip_microsteps(self, n: int) -> None:
        for _ in range(n):
            self.e.step()  # before the boundary: counters only

    def update(self):
        before = dsi.skipped_steps(self.e)
        if self._hook is not None:
            self._hook.flag = None
        try:
            self.e.step()
        except Exception as err:  # DeepSpeed's own stop at fp16's minimum loss scale (a bare Exception)
            if "loss scale already at minimum" in str(err):
                raise min_loss_scale_error(dsi.loss_scale(self.e) or 0.0) from None
            raise
        skipped = dsi.skipped_steps(self.e) > before
        return skipped, (self._hook.flag if self._hook is not None and not skipped else None)

    def skip_update(self) -> None:
        dsi.step_without_update(self.e)

    def reported_norm(self):
        norm = self.e.get_global_grad_norm()
        return float("nan") if norm is None else norm

    def loss_scale(self) -> float | None:
        return dsi.loss_scale(self.e)

    def partitioned(self) -> bool:
        return is_partitioned(self.module)

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """ZeRO-3: every partition gathered, fp32 on CPU (collective)."""
        import deepspeed

        mod = self.module
        with deepspeed.zero.GatheredParameters(list(mod.parameters()), modifier_rank=None):
            keys = set(mod.state_dict(keep_vars=True))
            named = dict(mod.named_parameters()) | dict(mod.named_buffers())
            return {k: v.detach().float().cpu().clone() for k, v in named.items() if k in keys}

    # ---- whole state at any layout (scaletrain.checkpoint.reshard): DeepSpeed's public tensor-fragment API ----
    def whole_state(self, optimizer, named):
        """ZeRO-1/2/3: each parameter's fp32 master weight and moments gathered whole
        (``deepspeed.utils.safe_get_full_*``; collective under ZeRO-3); ZeRO-0 holds them whole already."""
        if not self.e.zero_optimization():
            return super().whole_state(optimizer, named)
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        dsi.link_optimizer_state(self.e)  # links made at the first update miss a group stepped only later
        masters, moments = {}, {}
        for name, p in named.items():
            if _not_here(p):  # an owned expert of another rank (expert parallelism): nothing here
                masters[name] = torch.empty(0)
                moments[name] = {k: torch.empty(0) for k in MOMENTS}
                continue
            masters[name] = safe_get_full_fp32_param(p).detach().float().cpu().clone()
            moments[name] = {k: safe_get_full_optimizer_state(p, k).detach().float().cpu().clone() for k in MOMENTS}
        steps = {int(optimizer.state[p]["step"]) for p in dsi.optimizer_partitions(self.e)
                 if "step" in optimizer.state.get(p, {})}
        return WholeState(masters, moments, max(steps) if steps else None)

    def load_module(self, module, weights) -> None:
        if not self.partitioned():
            return super().load_module(module, weights)
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):  # rank 0's copy kept
            with torch.no_grad():
                module.load_state_dict(weights, strict=True)

    def load_whole(self, optimizer, named, whole) -> None:
        """ZeRO-1/2/3: each rank keeps its slice of every whole tensor (``safe_set_full_*``: the fp32 master
        weight, the moments); AdamW's step count into every partition's state."""
        if not self.e.zero_optimization():
            return super().load_whole(optimizer, named, whole)
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        # on the flat partitions the optimizer steps; before the first update there is none
        init_adam_state(optimizer, whole.step, dsi.optimizer_partitions(self.e))
        dsi.link_optimizer_state(self.e)
        for name, p in named.items():
            if _not_here(p):  # an owned expert of another rank
                continue
            safe_set_full_fp32_param(p, whole.masters[name].float())
            for k, v in (whole.moments.get(name) or {}).items():
                safe_set_full_optimizer_state(p, v.float(), k)

    def save_native(self, path: Path) -> None:
        """DeepSpeed's files (module from rank 0, each rank's ZeRO optimizer partition) under ``path``."""
        with dsi.plain_moe_checkpoint(self.e):
            self.e.save_checkpoint(str(path.parent), tag=path.name, save_latest=False)

    def load_native(self, path: Path) -> None:
        with dsi.plain_moe_checkpoint(self.e):
            loaded, _ = self.e.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                               load_lr_scheduler_states=False)
        if loaded is None:
            raise ScaletrainError(f"DeepSpeed could not load checkpoint {path}")
