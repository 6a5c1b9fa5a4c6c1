"""Process environment for the engines: launcher variables, process-group start, CPU threads."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


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
