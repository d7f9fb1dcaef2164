"""torch.distributed for training under torchrun: gloo on CPU, NCCL on CUDA; DDP or FSDP2."""

from __future__ import annotations

import gc
import os
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

try:  # FSDP2's custom reduce-scatter (torch 2.13 has it; not exported by name)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # an older torch: bf16 reduction through the policy's reduce_dtype
    ReduceScatter = None
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from dflash_common.devices import local_rank
from dflash_common.environment import rank_and_world
from dflash_common.errors import ConfigError
from dflash_train.settings.train_config import REDUCE_DTYPES as REDUCE_DTYPE_NAMES


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the run (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    single_rank_group: bool = False
    """One process that still joins a process group and wraps its model (wrap_single_rank)."""
    wait_group: Any = field(default=None, compare=False, repr=False)
    """The CPU (gloo) group the other ranks wait for rank 0's solo work in (wait_for_rank0)."""
    save_timeout: float = 0.0
    """wait_group's timeout in seconds (TrainConfig.save_timeout)."""
    host_group: Any = field(default=None, compare=False, repr=False)
    """A CPU (gloo) group under the collectives' timeout, for the counts the host decides from
    (global_min): an NCCL all-reduce read back would make the host wait for the queued step."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1 or self.single_rank_group


def dist_info_from_env(wrap_single_rank: bool = False) -> DistInfo:
    """Where torchrun's RANK, WORLD_SIZE and LOCAL_RANK put this process (unset: rank 0 of 1),
    checked before anything reads them (dflash_common.environment: one line for a bad value).
    `wrap_single_rank`: one torchrun process is a group of one (TrainConfig.wrap_single_rank)."""
    rank, world = rank_and_world()
    here = local_rank()
    if wrap_single_rank and (here is None or not os.environ.get("MASTER_ADDR")):
        raise ConfigError("--wrap-single-rank needs torchrun's process group (LOCAL_RANK and MASTER_ADDR are unset); "
                          "run under torchrun --nproc-per-node 1, or drop the option")
    return DistInfo(rank=rank, world_size=world, local_rank=here or 0, single_rank_group=wrap_single_rank and world == 1)


def init_distributed(device: torch.device, wrap_single_rank: bool = False, collective_timeout: float = 600.0,
                     save_timeout: float = 7200.0) -> DistInfo:
    """Join the process group torchrun describes in the environment (no-op for one process
    unless `wrap_single_rank`), with this process bound to `device` (its LOCAL_RANK GPU, from
    resolve_device), its collectives under `collective_timeout` seconds; and a CPU group in which
    the other ranks wait up to `save_timeout` seconds for rank 0's checkpoint saves, evaluation and
    export."""
    info = dist_info_from_env(wrap_single_rank)
    if not info.active:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(**process_group_options(device, collective_timeout))
    # every rank creates them, in the same order (new_group is collective)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=save_timeout))
    host = dist.new_group(backend="gloo", timeout=timedelta(seconds=collective_timeout))
    return DistInfo(info.rank, info.world_size, info.local_rank, single_rank_group=info.single_rank_group,
                    wait_group=group, save_timeout=save_timeout, host_group=host)


def process_group_options(device: torch.device, collective_timeout: float | None = None) -> dict:
    """init_process_group arguments: NCCL bound to this rank's GPU (device_id also makes NCCL
    create its communicator eagerly there, instead of guessing GPU 0 at the first barrier), gloo
    on CPU; the collectives' timeout when given (torch's default, 10 minutes, otherwise)."""
    timeout = {} if collective_timeout is None else {"timeout": timedelta(seconds=collective_timeout)}
    if device.type == "cuda":
        return {"backend": "nccl", "device_id": device, **timeout}
    return {"backend": "gloo", **timeout}


REDUCE_DTYPES = dict(zip(REDUCE_DTYPE_NAMES, (torch.float32, torch.bfloat16), strict=True))
"""TrainConfig.grad_reduce_dtype's choices as torch dtypes."""


def data_parallel(model: nn.Module, info: DistInfo, strategy: str, device: torch.device,
                  reduce_dtype: str = "fp32") -> nn.Module:
    """The module the training forward runs through: the model itself for one process, a DDP
    wrapper around it, or (fsdp) the model itself, sharded in place. Gradients cross ranks in
    `reduce_dtype` (bf16: half the bytes, rounded to 8 bits of mantissa before the sum, then
    back to fp32). Build the optimizer after this call: under FSDP it must hold the sharded
    parameters."""
    if not info.active:
        return model
    if strategy == "ddp":
        # gradient_as_bucket_view: the gradients are views into DDP's reduction buckets instead
        # of a second copy (7.3 GB of fp32 gradients at production size)
        wrapped = DDP(model, broadcast_buffers=False, gradient_as_bucket_view=True)
        if REDUCE_DTYPES[reduce_dtype] == torch.bfloat16:
            wrapped.register_comm_hook(None, bf16_allreduce)
        return wrapped
    shard_drafter(model, init_device_mesh(device.type, (info.world_size,)), REDUCE_DTYPES[reduce_dtype])
    return model


def bf16_allreduce(group, bucket):
    """A DDP communication hook: the bucket's mean over ranks, crossing them in bf16 (torch's own
    bf16 hook refuses anything but NCCL and XCCL; this one runs on gloo too). DDP checks the
    hook's annotations as objects, which this module's postponed (string) annotations are not:
    they are set below."""
    group = group if group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    half = buffer.to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(half, group=group, async_op=True).get_future()

    def back_to_fp32(done: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(back_to_fp32)


bf16_allreduce.__annotations__ = {"group": dist.ProcessGroup, "bucket": dist.GradBucket,
                                  "return": torch.futures.Future[torch.Tensor]}


def gradient_sync(forward: nn.Module, model: nn.Module, sync: bool) -> AbstractContextManager:
    """The context of one micro-batch's forward and backward under gradient accumulation: with
    `sync` False (every micro-batch but an optimizer step's last) the gradients only accumulate
    on each rank, and the last one's backward reduces their sum across ranks once (a reduction
    per micro-batch moved grad_accum times the bytes). DDP: no_sync(). FSDP2: no reduce-scatter,
    and the gathered parameters kept until the last backward instead of gathered again per
    micro-batch (at the cost of holding unsharded gradients meanwhile)."""
    if isinstance(forward, DDP):
        return nullcontext() if sync else forward.no_sync()
    if is_sharded(model):
        model.set_requires_gradient_sync(sync, recurse=True)
        model.set_reshard_after_backward(sync, recurse=True)
    return nullcontext()


def shard_drafter(model: nn.Module, mesh, reduce_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 units: per decoder layer its q/o projections and MLP, then the root.

    A unit's parameters are gathered only inside its own forward, and its gradients are
    reduce-scattered as soon as the gradient of its forward's inputs exists. The k/v projections
    (and k_norm) also run on the context features before any layer's forward (the drafter's
    context_kv), so a whole-layer unit would see them sharded there and reduce-scatter their
    gradients before the context part arrives. They stay in the root unit with fc and the norms,
    gathered for the whole step and reduced once after the backward. The teacher's frozen
    embedding and LM head are buffers, not parameters: FSDP leaves them replicated and untrained.
    """
    # The drafter returns its block states as a view; no caller changes them in place, which is
    # what FSDP warns about on every run.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPDFlashDrafter\) returned a view tensor")
    # parameters and gradients stay fp32 (autocast does the bf16 compute). A bf16 reduction is
    # the reduce-scatter's own (Bf16ReduceScatter), not the policy's reduce_dtype: with that, torch
    # keeps the gradients it accumulates between micro-batches (gradient_sync) in bf16, rounding
    # them once per micro-batch (FSDPParam.to_accumulated_grad_if_needed), where this way they
    # accumulate in fp32 and are rounded once, at the step's reduction
    units = [unit for layer in model.layers for unit in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp)]
    own_comm = reduce_dtype == torch.bfloat16 and ReduceScatter is not None
    policy = MixedPrecisionPolicy(reduce_dtype=None if own_comm else reduce_dtype)
    for unit in [*units, model]:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
        if own_comm:
            unit.set_custom_reduce_scatter(Bf16ReduceScatter())


class Bf16ReduceScatter(ReduceScatter or object):
    """FSDP2's reduce-scatter with the gradients crossing the ranks in bf16 (half the bytes) and
    summed there, from and back to fp32 buffers."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        half = torch.empty_like(output_tensor, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(half, input_tensor.to(torch.bfloat16), op=op, group=group)
        output_tensor.copy_(half)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def release_gathered(model: nn.Module) -> None:
    """Free parameters a no-grad forward left gathered (FSDP keeps the root's after forward, for
    the backward that an evaluation never runs), so the next forward gathers fresh values."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor | None:
    """Clip to a global gradient norm (0 disables); returns the norm before clipping. Under FSDP
    the gradients are DTensor shards and clip_grad_norm_ reduces their norm over all ranks."""
    if max_norm <= 0:
        return None
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def global_sum(value: float, info: DistInfo, device: torch.device) -> float:
    return float(global_sum_tensor(torch.tensor([float(value)], dtype=torch.float64), info, device)[0])


def global_sum_on_device(value: float, info: DistInfo, device: torch.device) -> torch.Tensor:
    """Every rank's ``value`` summed, as a float64 tensor left on ``device`` (no host sync)."""
    # filled on the device: torch.tensor(..., device=...) would be a blocking copy from the host
    t = torch.full((1,), float(value), dtype=torch.float64, device=device)
    if info.active:
        dist.all_reduce(t)
    return t[0]


def global_min(value: int, info: DistInfo, device: torch.device) -> int:
    """The smallest of every rank's ``value`` (every rank calls this at the same point), over the
    host group where there is one, so the host does not wait for the device's queued work."""
    if not info.active:
        return value
    if info.host_group is not None:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=info.host_group)
        return int(t[0])
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.cpu()[0])


def global_sum_tensor(t: torch.Tensor, info: DistInfo, device: torch.device) -> torch.Tensor:
    """``t`` summed over all ranks (every rank calls this at the same point), on the CPU."""
    if not info.active:
        return t
    t = t.to(device)
    dist.all_reduce(t)
    return t.cpu()


def from_rank0(value: Any, info: DistInfo) -> Any:
    """Rank 0's `value` on every rank (a picklable object, sent over the CPU group): what rank 0
    alone decides, such as the checkpoint a resume continues."""
    if not info.active:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=info.wait_group)
    return box[0]


def every_rank(value: Any, info: DistInfo) -> list:
    """Every rank's `value` (picklable), in rank order, on every rank."""
    if not info.active:
        return [value]
    out = [None] * info.world_size
    dist.all_gather_object(out, value, group=info.wait_group)
    return out


def barrier(info: DistInfo) -> None:
    if info.active:
        dist.barrier()


def wait_for_rank0(info: DistInfo, work: str) -> None:
    """Every rank meets here after rank 0's solo `work` (a checkpoint save, the held-out
    evaluation, the export): the others wait in the CPU group of init_distributed, under
    save_timeout instead of the collectives' timeout (NCCL's watchdog would stop a rank that
    waits 10 minutes for a 22 GB checkpoint's fsync). One line when the wait runs out."""
    if not info.active:
        return
    group = info.wait_group
    try:
        dist.barrier(group=group) if group is not None else dist.barrier()
    except RuntimeError as err:  # DistBackendError (a timeout) is one
        from dflash_common.errors import TrainingError

        raise TrainingError(f"rank {info.rank} waited more than {info.save_timeout:g} s (--save-timeout) for rank 0 to "
                            f"finish {work}, or rank 0 failed meanwhile ({str(err).splitlines()[0][:160]}); raise "
                            "--save-timeout when rank 0's storage is that slow, else see rank 0's error") from None


def shutdown(info: DistInfo) -> None:
    """Leave the process group; call it once no DDP wrapper is left. A DDP Reducer freed after the
    group is destroyed drops the group's last reference with the GIL held, while a gloo thread may
    still need the GIL to free a finished collective's tensors: neither moves (torch issue 56297;
    a hang at exit in about 1 run of 6 on 2 cores)."""
    if info.active and dist.is_initialized():
        gc.collect()  # a wrapper caught in a reference cycle goes now, while the group stands
        dist.destroy_process_group()
