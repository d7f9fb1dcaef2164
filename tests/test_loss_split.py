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

from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.loss_config import WEIGHTINGS, LossConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.batch import Batch
from dflash_train.training.distributed import DistInfo, data_parallel, gradient_sync, init_distributed, shutdown
from dflash_train.training.model import DFlashDrafter
from dflash_train.training.train_step import micro_step

# real torchrun processes: `make test-slow`
pytestmark = pytest.mark.slow

VOCAB, HIDDEN, K = 61, 32, 5
LOSSES = [LossConfig(weighting=w) for w in WEIGHTINGS] + [
    LossConfig(kind="onpolicy_kl", weighting="dpace"), LossConfig(terms={"ce": 0.1, "tv": 0.9}, weighting="streak"),
    LossConfig(kind="lk_hybrid", weighting="decay"), LossConfig(terms={"kl": 1.0, "chain": 0.5}, weighting="first_error"),
    LossConfig(kind="mix", temperature=2.0, weighting="streak")]


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
    # each's DDP wrapper is gone before the group (see shutdown)
    results = accumulated_steps(info) if "ACCUM_RESULT" in os.environ else split_steps(info)
    if info.is_main:
        Path(os.environ.get("ACCUM_RESULT") or os.environ["SPLIT_RESULT"]).write_text(json.dumps(results))
    shutdown(info)


ACCUM = 4
ACCUM_LENGTHS = (23, 9, 31, 14, 27, 12, 19, 25)  # micro-batch i: sequences 2i (rank 0) and 2i + 1 (rank 1)


def written_bytes() -> int:
    """Bytes this process has passed to write and send calls (gloo's gradient traffic, on CPU)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise OSError("no wchar in /proc/self/io")


def accumulate(model, forward, micro_batches: list[Batch], info: DistInfo, strategy_sync: bool = True) -> dict:
    """The trainer's accumulation (gradient_sync around each micro_step), the gradients it leaves."""
    cfg = TrainConfig(cache="", out="", optim=dataclasses.replace(TrainConfig(cache="", out="").optim,
                                                                  grad_accum=len(micro_batches)))
    model.zero_grad(set_to_none=True)
    for index, batch in enumerate(micro_batches):
        with gradient_sync(forward, model, sync=not strategy_sync or index == len(micro_batches) - 1):
            micro_step(model, forward, batch, cfg, info, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def accumulated_steps(info: DistInfo) -> dict:
    """Per gradient dtype, accumulation 1 and 4 and reduction per micro-batch (the trainer before
    issue 34): the bytes this rank wrote during the micro-steps, and the gradients of accumulation 4."""
    parts = sequences(ACCUM_LENGTHS)
    mine = [parts[2 * i + info.rank] for i in range(ACCUM)]
    out = {}
    for dtype in ("fp32", "bf16"):
        for label, batches, once in (("accum1", mine[:1], True), ("accum4", mine, True), ("accum4-every", mine, False)):
            model = drafter()
            forward = data_parallel(model, info, "ddp", torch.device("cpu"), dtype)
            accumulate(model, forward, batches, info, once)  # DDP builds its buckets in the first backward
            torch.distributed.barrier()
            before = written_bytes()
            grads = accumulate(model, forward, batches, info, once)
            out[f"{dtype}/{label}"] = {"bytes": written_bytes() - before,
                                       "grads": {k: v.tolist() for k, v in grads.items()} if label == "accum4" else None}
            del forward
    return out


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


def test_accumulation_reduces_once_per_optimizer_step(tmp_path):
    """Under DDP a step of 4 accumulated micro-batches moves the bytes of one reduction (it moved
    4x with a reduction per micro-batch), its gradient still equals one process's accumulated
    over the same global batches (fp32), and bf16 reduction moves about half the bytes."""
    result = tmp_path / "accum.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__],
                          env={**env, "ACCUM_RESULT": str(result), "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(result.read_text())
    size = {dtype: got[f"{dtype}/accum1"]["bytes"] for dtype in ("fp32", "bf16")}
    params = sum(p.numel() for p in drafter().parameters())
    assert size["fp32"] >= 4 * params  # one reduction writes at least the gradient's bytes
    for dtype in ("fp32", "bf16"):
        assert got[f"{dtype}/accum4"]["bytes"] < 1.25 * size[dtype], (dtype, got[f"{dtype}/accum4"]["bytes"], size)
        assert got[f"{dtype}/accum4-every"]["bytes"] > 3.5 * size[dtype]  # what the trainer moved before
    assert size["bf16"] < 0.7 * size["fp32"], size

    model, parts = drafter(), sequences(ACCUM_LENGTHS)
    whole = accumulate(model, model, [join(parts[2 * i:2 * i + 2]) for i in range(ACCUM)], DistInfo())
    for name, grad in whole.items():
        torch.testing.assert_close(torch.tensor(got["fp32/accum4"]["grads"][name]), grad, rtol=1e-4, atol=1e-6)
        # bf16 rounds each rank's sum to 8 bits of mantissa before the reduction
        torch.testing.assert_close(torch.tensor(got["bf16/accum4"]["grads"][name]), grad, rtol=2e-2, atol=1e-4)


if __name__ == "__main__":
    main()
