"""Which device a process computes on: one rule for the build, training, evaluation and decoding."""

from __future__ import annotations

import os

import torch

from dflash_common.environment import int_from_env
from dflash_common.errors import ConfigError


def local_rank() -> int | None:
    """This process's index on its node under torchrun (LOCAL_RANK), None outside torchrun."""
    if os.environ.get("LOCAL_RANK", "") == "":
        return None
    return int_from_env("LOCAL_RANK", 0, meaning="this process's index on its node, set by torchrun")


def select_device(device: str, cuda_count: int, rank_on_node: int | None) -> torch.device:
    """The device for a --device value, given the GPUs this machine has and the process's local
    rank under torchrun. 'auto' and an index-less 'cuda' take GPU LOCAL_RANK (GPU 0 outside
    torchrun), so the processes of a node never share GPU 0; 'cuda:N' is taken as given."""
    if device == "auto":
        if cuda_count == 0:
            return torch.device("cpu")
        device = "cuda"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r} is not supported; use auto, cpu, cuda or cuda:N")
    if resolved.type == "cpu":
        return resolved
    if cuda_count == 0:
        raise ConfigError(f"--device {device} but this machine has no CUDA GPU; use --device cpu (or auto)")
    index = resolved.index if resolved.index is not None else (rank_on_node or 0)
    if index >= cuda_count:
        where = "" if resolved.index is not None else f" (LOCAL_RANK {rank_on_node})"
        raise ConfigError(f"--device {device}{where} but this machine has {cuda_count} GPU(s); use cuda:0..cuda:{cuda_count - 1}"
                          " or start at most that many processes per node")
    return torch.device("cuda", index)


def resolve_device(device: str) -> torch.device:
    """'auto', 'cpu', 'cuda' or 'cuda:N' as a device of this machine, for this process."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return select_device(device, count, local_rank())


def bind_device(device: torch.device) -> None:
    """Make `device` the current CUDA device, so pinned copies, NCCL and memory statistics that
    use the current device land on this process's GPU and not on GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
