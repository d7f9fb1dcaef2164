"""torch.distributed for training under torchrun: gloo on CPU, NCCL on CUDA."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the run (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group torchrun describes in the environment (no-op for one process)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return DistInfo()
    info = DistInfo(rank=int(os.environ["RANK"]), world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return info


def rank_device(device: torch.device, info: DistInfo) -> torch.device:
    """Each process of a node takes its own GPU."""
    if device.type == "cuda" and info.active and device.index is None:
        return torch.device("cuda", info.local_rank)
    return device


def global_sum(value: float, info: DistInfo, device: torch.device) -> float:
    if not info.active:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def barrier(info: DistInfo) -> None:
    if info.active:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.active and dist.is_initialized():
        dist.destroy_process_group()
