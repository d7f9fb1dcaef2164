"""The loss of one global batch does not depend on how it is split across ranks: for every
weighting and loss, its value and gradient on one process equal those of two real torchrun
processes that each hold part of its sequences (DDP, gloo). Weights with a per-batch
denominator (as D-PACE's were in two other trainers) would fail here.

Run by pytest (which launches torchrun on this same file) or directly under torchrun."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.config import TrainConfig
from dflash_train.training.data import Batch
from dflash_train.training.distributed import DistInfo, data_parallel, init_distributed, shutdown
from dflash_train.training.loss import WEIGHTINGS, LossConfig
from dflash_train.training.model import DFlashDrafter, DrafterConfig
from dflash_train.training.trainer import micro_step

# real torchrun processes: `make test-slow`
pytestmark = pytest.mark.slow

VOCAB, HIDDEN, K = 61, 32, 5
LOSSES = [LossConfig(weighting=w) for w in WEIGHTINGS] + [
    LossConfig(kind="onpolicy_kl", weighting="dpace"), LossConfig(terms={"ce": 0.1, "tv": 0.9}, weighting="streak"),
    LossConfig(kind="lk_hybrid", weighting="decay")]


def drafter() -> DFlashDrafter:
    cfg = DrafterConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=48, vocab_size=VOCAB, mask_token_id=VOCAB - 1, target_layer_ids=(0, 2),
                        num_target_layers=3, num_hidden_layers=1, block_size=4, max_position_embeddings=128)
    gen = torch.Generator().manual_seed(0)
    embed, head = torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3
    torch.manual_seed(0)
    return DFlashDrafter.build(cfg, embed, head, "cpu")


def sequences(lengths=(23, 9, 31, 14, 27)) -> list[Batch]:
    """One batch per sequence, of uneven lengths, loss masks and anchors: so the valid positions
    of any split differ between its parts."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for i, t in enumerate(lengths):
        logprobs, ids = (torch.randn(1, t, VOCAB, generator=gen) * 2).log_softmax(-1).topk(K, dim=-1)
        mask = torch.rand(1, t, generator=gen) < 0.8
        anchors = torch.randint(0, t - 2, (1, 3), generator=gen)
        anchors[0, -1] = -1 if i % 2 else anchors[0, -1]
        out.append(Batch(ids=[f"s{i}"], hidden=torch.randn(1, t, 2, HIDDEN, generator=gen),
                         input_ids=torch.randint(0, VOCAB - 1, (1, t), generator=gen), loss_mask=mask,
                         lengths=torch.tensor([t]), topk_ids=ids, topk_logprobs=logprobs, anchors=anchors))
    return out


def join(parts: list[Batch]) -> Batch:
    """Sequences right-padded into one batch, as the loader's collate lays them out."""
    if not parts:
        return Batch.empty()
    width, anchors = max(int(p.lengths[0]) for p in parts), max(p.anchors.shape[1] for p in parts)

    def pad(t, fill=0):
        shape = (t.shape[0], width - t.shape[1], *t.shape[2:])
        return torch.cat([t, torch.full(shape, fill, dtype=t.dtype)], dim=1)

    return Batch(ids=[i for p in parts for i in p.ids], hidden=torch.cat([pad(p.hidden) for p in parts]),
                 input_ids=torch.cat([pad(p.input_ids) for p in parts]), loss_mask=torch.cat([pad(p.loss_mask) for p in parts]),
                 lengths=torch.cat([p.lengths for p in parts]), topk_ids=torch.cat([pad(p.topk_ids) for p in parts]),
                 topk_logprobs=torch.cat([pad(p.topk_logprobs) for p in parts]),
                 anchors=torch.cat([torch.nn.functional.pad(p.anchors, (0, anchors - p.anchors.shape[1]), value=-1)
                                    for p in parts]))


def step(model, forward, batch: Batch, loss: LossConfig, info: DistInfo) -> tuple[float, dict]:
    """One micro-step's loss and the (all-reduced) gradients it leaves."""
    cfg = TrainConfig(cache="", out="", loss=loss)
    model.zero_grad(set_to_none=True)
    out = micro_step(model, forward, batch, cfg, info, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    loss_sum = float(out.loss.detach() * out.count.sum()) if out is not None else 0.0
    return loss_sum, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    info = init_distributed(torch.device("cpu"))
    results = split_steps(info)  # its DDP wrapper is gone before the group (see shutdown)
    if info.is_main:
        Path(os.environ["SPLIT_RESULT"]).write_text(json.dumps(results))
    shutdown(info)


def split_steps(info: DistInfo) -> list[dict]:
    model = drafter()
    forward = data_parallel(model, info, "ddp", torch.device("cpu"))
    parts = sequences()
    # rank 0 takes two sequences, rank 1 three: unequal shares of the valid positions
    mine = join(parts[:2] if info.rank == 0 else parts[2:])
    results = []
    for loss in LOSSES:
        local_sum, grads = step(model, forward, mine, loss, info)
        total = torch.tensor([local_sum], dtype=torch.float64)
        torch.distributed.all_reduce(total)
        results.append({"loss": dataclasses.asdict(loss), "loss_sum": float(total),
                         "grads": {k: v.tolist() for k, v in grads.items()}})
    return results


def test_split_across_two_processes_equals_one(tmp_path):
    result = tmp_path / "split.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__],
                          env={**env, "SPLIT_RESULT": str(result), "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    split = json.loads(result.read_text())
    model, whole = drafter(), join(sequences())
    assert len(split) == len(LOSSES)
    for loss, got in zip(LOSSES, split):
        assert got["loss"] == dataclasses.asdict(loss)
        loss_sum, grads = step(model, model, whole, loss, DistInfo())
        label = f"{loss.kind}/{loss.weighting}/{loss.terms}"
        # the weighted loss summed over the global batch's valid positions, however split
        assert got["loss_sum"] == pytest.approx(loss_sum, rel=1e-5), label
        assert set(got["grads"]) == set(grads), label
        for name, grad in grads.items():
            torch.testing.assert_close(torch.tensor(got["grads"][name]), grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label} {name}: {m}")


if __name__ == "__main__":
    main()
