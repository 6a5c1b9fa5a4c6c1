"""The Engine interface the training loop is written against."""
from __future__ import annotations

import math
import os
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class StepInfo:
    grad_norm: float
    lr: float
    skipped: bool = False  # fp16 overflow: the update was skipped


def inverse_sqrt_factor(lr: float, warmup: int, warmup_init_lr: float):
    """LambdaLR factor so that update number k (1-based) runs at fairseq's lr(k).

    lr(k) = init + (lr - init) * k / warmup for k < warmup, lr * sqrt(warmup / k) after.
    """

    def f(i: int) -> float:  # i = number of scheduler.step() calls so far = updates done
        k = i + 1
        if warmup > 0 and k < warmup:
            return (warmup_init_lr + (lr - warmup_init_lr) * k / warmup) / lr
        return math.sqrt(max(warmup, 1) / k)

    return f


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    fusable = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    if getattr(o, "fused", True) and fusable:
        return torch.optim.AdamW(params, fused=True, **kw)
    return torch.optim.AdamW(params, **kw)


def build_scheduler(optimizer, cfg):
    o = cfg.optim
    return torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_factor(o.lr, o.warmup_steps, o.warmup_init_lr))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_dist_env() -> None:
    """A plain `python -m scaletrain train` is a world of one: give it the env a launcher would."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        )


def init_deepspeed_distributed(backend: str) -> None:
    """``deepspeed.init_distributed``, then remove DeepSpeed's shared-memory allreduce file.

    With every rank on one host, DeepSpeed's CPU backend maps a 66 MB segment per rank named
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` and never
    unlinks it: each run leaves its segments in RAM (/dev/shm) until reboot (we found 243 of them,
    16 GB, after a few days of test runs). Every rank maps every peer's segment inside
    ``init_distributed``, so after a barrier the names can go; the mappings live on until exit.
    """
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    if torch.cuda.is_available() or not dist.is_initialized():
        return
    dist.barrier()
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), dist.get_rank()
    )
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:  # not all ranks local, or another DeepSpeed build
        pass


def configure_threads(cfg) -> None:
    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "0")) or 0)
        if local <= 0:
            local = max(1, int(os.environ.get("WORLD_SIZE", "1")))  # single-node launch
        n = cfg.engine.threads or max(1, (os.cpu_count() or 1) // local)
        torch.set_num_threads(n)
        # Denormals wreck fp32 CPU throughput (measured 32 vs 748 tokens/s on nn.Transformer).
        torch.set_flush_denormal(True)


def _checkpointed(layer: torch.nn.Module):
    from torch.utils.checkpoint import checkpoint

    inner = layer.forward

    def forward(*args, **kwargs):
        if layer.training and torch.is_grad_enabled():
            # non-reentrant: works with keyword arguments and ZeRO-3; dropout RNG is replayed
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    return forward


def prepare_model(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """Scale knobs applied before an engine wraps the model (same parameter names either way).

    engine.activation_checkpointing: each encoder and decoder layer keeps only its input and
    recomputes its activations in backward. engine.compile: ``Module.compile()`` in place, so
    state-dict keys (and checkpoints) are unchanged.
    """
    if cfg.engine.activation_checkpointing:
        n = 0
        for name in ("encoder_layers", "decoder_layers"):
            for layer in getattr(model, name, []) or []:
                layer.forward = _checkpointed(layer)
                n += 1
        if n == 0:
            from scaletrain.errors import ScaletrainError

            raise ScaletrainError(
                f"engine.activation_checkpointing: model {type(model).__name__} has no encoder_layers/decoder_layers"
            )
    if cfg.engine.compile:
        model.compile()
    return model


def own_grad_norm(params) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


class Engine(ABC):
    """What the loop needs: distributed info, forward/backward/step, collectives, checkpoints."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @abstractmethod
    def setup(self, model: torch.nn.Module) -> None:
        """Wrap the model and build optimizer + LR scheduler."""

    @property
    @abstractmethod
    def module(self) -> torch.nn.Module:
        """The unwrapped model."""

    @abstractmethod
    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; the loss is already scaled for the global normalisation."""

    @abstractmethod
    def step(self) -> StepInfo:
        """Clip, update, advance the LR schedule (after grad_accum micro-batches)."""

    @property
    @abstractmethod
    def lr(self) -> float: ...

    @abstractmethod
    def save(self, ckpt_dir: Path, tag: str) -> None:
        """Write model/optimizer/scheduler state under ckpt_dir/tag (collective)."""

    @abstractmethod
    def load(self, ckpt_dir: Path, tag: str) -> None: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters on every rank (ZeRO-3 partitions gathered), fp32 on CPU. Collective."""
        mod = self.module
        params = list(mod.parameters())
        ctx = None
        if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 partitioned
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        if ctx is None:
            return {k: v.detach().float().cpu().clone() for k, v in mod.state_dict().items()}
        with ctx:
            keys = set(mod.state_dict(keep_vars=True))
            named = dict(mod.named_parameters()) | dict(mod.named_buffers())
            return {k: v.detach().float().cpu().clone() for k, v in named.items() if k in keys}

    # ---- collectives (gloo on CPU, nccl on GPU) -----------------------------------
    def all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            t = t.to(self.comm_device)
            dist.all_reduce(t)
        return [float(x) for x in t.cpu()]

    def broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @property
    def comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def autocast(self):
        return torch.autocast(device_type=self.device.type, enabled=False)
