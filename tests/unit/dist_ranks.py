"""Run a function on N gloo ranks in forked processes (fork: the children reuse the imported torch)."""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int = 2, *args) -> None:
    """``fn(rank, world, *args)`` on ``world`` ranks; an assertion failing on any rank fails the call."""
    mp.start_processes(_entry, args=(world, _free_port(), fn, args), nprocs=world, start_method="fork")
