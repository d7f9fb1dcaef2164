"""FSDP2 with bf16 gradient reduction and gradient accumulation, in two real gloo processes: the
gradients accumulate unsharded in fp32 over the micro-batches and are rounded to bf16 once, when
the step's last backward reduces them (torch's own bf16 reduce_dtype would keep the accumulated
gradient in bf16 between micro-batches: a rounding per micro-batch)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.training.distributed import gradient_sync, shard_drafter
from dflash_train.training.model import DFlashDrafter


def _model() -> DFlashDrafter:
    cfg = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=64, vocab_size=96, mask_token_id=95, target_layer_ids=(1, 3),
                        num_target_layers=5, num_hidden_layers=1, block_size=4, max_position_embeddings=256)
    gen = torch.Generator().manual_seed(0)
    embed, head = torch.randn(96, 32, generator=gen), torch.randn(96, 32, generator=gen) * 0.1
    torch.manual_seed(0)
    return DFlashDrafter.build(cfg, embed, head, "cpu", "sdpa")


def _loss(model, seed: int) -> torch.Tensor:
    """A micro-batch's loss; the same on both ranks, so their mean gradient is each one's."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 12, 2, 32, generator=gen)
    ids = torch.randint(0, 95, (2, 12), generator=gen)
    anchors = torch.tensor([[2, 6], [3, 7]])
    return (model(hidden, ids, anchors) * torch.randn(2, 2, 4, 32, generator=gen)).sum()


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    reference = _model()
    sharded = copy.deepcopy(reference)
    shard_drafter(sharded, init_device_mesh("cpu", (2,)), torch.bfloat16)
    for micro, seed in enumerate((1, 2)):
        with gradient_sync(sharded, sharded, sync=micro == 1):
            _loss(sharded, seed).backward()
    grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
    # the fp32 gradients of each micro-batch, unsharded
    steps = []
    for seed in (1, 2):
        reference.zero_grad()
        _loss(reference, seed).backward()
        steps.append({name: p.grad.clone() for name, p in reference.named_parameters()})
    if rank == 0:
        torch.save({"sharded": grads, "first": steps[0], "second": steps[1]}, out)
    dist.destroy_process_group()


def test_fsdp_bf16_reduction_rounds_the_accumulated_gradient_once(tmp_path: Path):
    out = tmp_path / "grads.pt"
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    saved = torch.load(out)
    twice = 0
    for name, got in saved["sharded"].items():
        first, second = saved["first"][name], saved["second"][name]
        once = (first + second).to(torch.bfloat16).float()  # one rounding of the fp32 sum
        torch.testing.assert_close(got, once, rtol=0, atol=0, msg=name)
        # torch's bf16 accumulation: the first gradient rounded, the second added in bf16
        twice += int(((first.to(torch.bfloat16) + second).to(torch.bfloat16).float() != once).sum())
    assert twice > 0  # the two roundings differ somewhere: the check above can tell them apart
