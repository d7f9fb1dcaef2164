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


def visible_gpus(visible: str | None) -> list[str] | None:
    """A launcher's CUDA_VISIBLE_DEVICES as its entries in order (indices, GPU-/MIG- UUIDs), None
    when it is unset: this process's cuda:N is entry N, which is how a child's list names it."""
    if visible is None:
        return None
    return [entry.strip() for entry in visible.split(",") if entry.strip()]


def rank_gpus(per_rank: int, rank_on_node: int | None, visible: str | None, cuda_count: int | None) -> list[int]:
    """The one rule for which GPUs a process uses, as this process numbers them (cuda:N): a
    torchrun rank takes its own `per_rank` GPUs (1 for training and the transformers build, the
    engine's tensor_parallel_size for `build --engine vllm`), LOCAL_RANK x per_rank onwards of
    what it sees; outside torchrun the first `per_rank`. A launcher that gave each rank only its own
    GPUs (CUDA_VISIBLE_DEVICES per rank, exactly `per_rank` of them) makes them GPUs 0.. of every
    rank, whatever its LOCAL_RANK. `cuda_count` None: not known here (no CUDA in this process), then
    the launcher's list is the count, and without one nothing is checked."""
    names = visible_gpus(visible)
    count = cuda_count if cuda_count is not None else (len(names) if names is not None else None)
    if count is not None and names is not None:
        count = min(count, len(names))
    rank = rank_on_node or 0
    start = rank * per_rank
    if count is None or start + per_rank <= count:
        return list(range(start, start + per_rank))
    if names is not None and count == per_rank:  # the launcher gave this rank its own GPUs
        return list(range(per_rank))
    share = f"GPU {start}" if per_rank == 1 else f"GPUs {start}..{start + per_rank - 1} ({per_rank} a rank)"
    seen = f"CUDA_VISIBLE_DEVICES={visible}" if names is not None else "this machine"
    raise ConfigError(f"LOCAL_RANK {rank} needs {share} but {seen} has {count} GPU(s); start at most {count // per_rank} "
                      "process(es) per node, or have the launcher give each process its own GPUs")


def child_visible_devices(per_rank: int, rank_on_node: int | None, visible: str | None,
                          cuda_count: int | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for an engine a torchrun rank starts (vLLM): the rank's GPUs
    (rank_gpus) named as the launcher names them (its list's entries, ids or UUIDs, or the
    machine's indices when it set none). None outside torchrun: the engine sees what this process sees."""
    if rank_on_node is None:
        return None
    if visible_gpus(visible) == []:  # the launcher hid every GPU: so does the engine (vLLM's CPU build)
        return ""
    mine = rank_gpus(per_rank, rank_on_node, visible, cuda_count)
    names = visible_gpus(visible)
    return ",".join(names[i] if names is not None else str(i) for i in mine)


def child_devices_of(device: torch.device, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES that gives a child process this process's GPU `device` (cuda:N) as its
    only one: entry N of the launcher's list, or N when it set none."""
    names = visible_gpus(visible)
    index = device.index or 0
    return names[index] if names is not None and index < len(names) else str(index)


def select_device(device: str, cuda_count: int, rank_on_node: int | None, visible: str | None = None,
                  per_rank: int = 1) -> torch.device:
    """The device for a --device value, given the GPUs this process sees, its local rank under
    torchrun and the launcher's CUDA_VISIBLE_DEVICES. 'auto' and an index-less 'cuda' take the
    first of the rank's GPUs (rank_gpus: GPU LOCAL_RANK x per_rank, GPU 0 outside torchrun or when
    the launcher gave each rank its own), so the processes of a node never share GPU 0; 'cuda:N'
    is taken as given."""
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
    if resolved.index is None:
        return torch.device("cuda", rank_gpus(per_rank, rank_on_node, visible, cuda_count)[0])
    if resolved.index >= cuda_count:
        raise ConfigError(f"--device {device} but this process sees {cuda_count} GPU(s); use cuda:0..cuda:{cuda_count - 1}")
    return resolved


def resolve_device(device: str, per_rank: int = 1) -> torch.device:
    """'auto', 'cpu', 'cuda' or 'cuda:N' as a device of this machine, for this process (of a rank
    that uses `per_rank` GPUs: rank_gpus)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return select_device(device, count, local_rank(), os.environ.get("CUDA_VISIBLE_DEVICES"), per_rank)


def bind_device(device: torch.device) -> None:
    """Make `device` the current CUDA device, so pinned copies, NCCL and memory statistics that
    use the current device land on this process's GPU and not on GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
