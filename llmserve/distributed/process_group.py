"""Joining the ranks: gloo on CPU, NCCL on CUDA, from torchrun's environment or our own spawn.

torchrun (or any launcher) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
and MASTER_PORT; without them the engine spawns its workers and picks a free loopback port.
Step plans travel over a gloo group (``control_group``) even when the tensors use NCCL.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

INIT_TIMEOUT = timedelta(minutes=10)  # rank 0 may still be reading a large checkpoint


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the group and how to reach rank 0."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def torchrun_rank_info() -> RankInfo | None:
    """The launcher's rank variables, or None when this process was started by hand."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    env = os.environ
    return RankInfo(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device_type: str, info: RankInfo) -> torch.device:
    """CUDA: the GPU of the local rank; CPU: the CPU."""
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
        return torch.device("cuda", info.local_rank)
    return torch.device("cpu")


def init_process_group(info: RankInfo, device_type: str):
    """Join the group; returns the gloo group that carries the step plans."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=INIT_TIMEOUT,
    )
    return dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD


def split_cpu_threads(info: RankInfo) -> None:
    """CPU ranks on one machine share its cores instead of each taking all of them."""
    from llmserve.distributed.plan import usable_cpus

    torch.set_num_threads(max(1, usable_cpus() // info.local_world_size))
