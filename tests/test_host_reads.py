"""A training step never reads the device back (issue 57): each read makes the host wait for every
kernel queued before it, so the host cannot run ahead and queue the next work while the GPU runs.

The step runs with the drafter and the moved batch on the meta device (no data at all, so a read
of one raises) under HostReads, a TorchFunctionMode that refuses, naming the call, every read of
a non-CPU tensor, every op whose output size depends on device data and every blocking copy from
the host to a device (torch.tensor(..., device=...) among them: the meta device allows those).
Log steps may read (global_train_metrics, stop_if_diverged); they are not part of step_gradients.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from dflash_common.progress import Progress
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.dspark_config import DSparkConfig
from dflash_train.settings.lilicorr_config import LiLiCorrConfig
from dflash_train.settings.loss_config import LossConfig
from dflash_train.settings.noise_config import NoiseConfig
from dflash_train.settings.optim_config import OptimConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.batch import Batch, collate
from dflash_train.training.checkpoint import CheckpointManager
from dflash_train.training.data import LoaderState
from dflash_train.training.distributed import DistInfo
from dflash_train.training.heldout import AcceptanceMeter
from dflash_train.training.model import DFlashDrafter
from dflash_train.training.session import Session
from dflash_train.training.train_step import step_gradients

VOCAB, HIDDEN, K = 61, 32, 5
META = torch.device("meta")

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__bool__,
         torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
DATA_SIZED = {torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.masked_select, torch.Tensor.masked_select,
              torch.unique, torch.Tensor.unique, torch.bincount, torch.Tensor.bincount, torch.unique_consecutive}
FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}
COPIES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_}


def _on_device(values) -> bool:
    return any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in values)


class HostReads(TorchFunctionMode):
    """Refuses what makes the host wait for the device: reading a device tensor (item, tolist,
    bool, int, ...), ops sized by device data (nonzero, bincount, a boolean-mask index,
    repeat_interleave without output_size), blocking host-to-device copies."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS and _on_device(args[:1]):
            raise AssertionError(f"{func.__name__} reads a {args[0].device.type} tensor back on the host")
        if func in DATA_SIZED and _on_device(args):
            raise AssertionError(f"{func.__name__} sizes its output by device data")
        if func is torch.Tensor.repeat_interleave and _on_device(args[1:2]) and "output_size" not in kwargs:
            raise AssertionError("repeat_interleave by device repeats without output_size")
        if func is torch.Tensor.__getitem__ and _on_device(args[:1]) and _bool_index(args[1]):
            raise AssertionError("a boolean-mask index sizes its output by device data")
        if func in FACTORIES and str(kwargs.get("device", "cpu")).split(":")[0] != "cpu":
            raise AssertionError(f"{func.__name__}(..., device={kwargs['device']}) copies from the host and waits")
        out = func(*args, **kwargs)
        if func in COPIES and _blocking_upload(func, args, kwargs, out):
            raise AssertionError(f"a blocking {func.__name__} from the host to the device")
        return out


def _bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _blocking_upload(func, args, kwargs, out) -> bool:
    non_blocking = kwargs.get("non_blocking", False) or any(a is True for a in args[1:])
    source = args[1] if func is torch.Tensor.copy_ else args[0]
    target = args[0] if func is torch.Tensor.copy_ else out
    return (not non_blocking and isinstance(source, torch.Tensor) and source.device.type == "cpu"
            and isinstance(target, torch.Tensor) and target.device.type != "cpu" and source.numel() > 0)


@pytest.mark.parametrize("call", [
    lambda t: t.sum().item(), lambda t: t.tolist(), lambda t: bool(t.any()), lambda t: int(t.max()),
    lambda t: t.cpu(), lambda t: t.nonzero(), lambda t: torch.bincount(t.long()), lambda t: t[t > 0],
    lambda t: torch.tensor(3, device=t.device), lambda t: torch.ones(2).to(t.device),
    lambda t: torch.arange(2).repeat_interleave(t[:2].long()),
])
def test_host_reads_refuses_each_kind_of_wait(call):
    with pytest.raises(AssertionError, match="host|device"), HostReads():
        call(torch.ones(4, device=META))


def test_host_reads_lets_host_tensors_and_device_work_through():
    with HostReads():
        assert torch.tensor([1, 2]).tolist() == [1, 2] and int(torch.tensor(3)) == 3
        t = torch.full((3,), 2.0, device=META) * torch.ones(3).to(META, non_blocking=True)
        assert t.device == META and torch.arange(4)[torch.tensor([True, False, True, False])].tolist() == [0, 2]


class Record(SimpleNamespace):
    def __len__(self) -> int:
        return len(self.input_ids)


def records(lengths=(23, 9, 31, 14), seed=0) -> list[Record]:
    rng = np.random.default_rng(seed)
    out = []
    for i, t in enumerate(lengths):
        logprobs = np.ascontiguousarray(-np.sort(rng.exponential(1.0, (t, K)), axis=1).astype(np.float32) - 1.0)
        out.append(Record(id=f"s{seed}-{i}", input_ids=rng.integers(0, VOCAB - 1, t), loss_mask=rng.random(t) < 0.8,
                          topk_ids=rng.integers(0, VOCAB, (t, K)), topk_logprobs=logprobs,
                          hidden=rng.standard_normal((t, 2, HIDDEN)).astype(np.float32)))
    return out


def host_batch(layout: str, seed: int) -> Batch:
    recs = records(seed=seed)
    rng = np.random.default_rng(seed + 10)
    anchors = [np.sort(rng.choice(np.arange(1, len(r) - 1), size=min(6, len(r) - 2), replace=False)) for r in recs]
    batch = collate(recs, anchors, [r.hidden for r in recs], layout)
    batch.state_after = LoaderState(partitions=2).to_dict()
    return batch


KINDS = {
    "dflash": dict(layer_types=("sliding_attention", "full_attention"), sliding_window=6),
    "causal": dict(causal=True),
    "dspark": dict(dspark=DSparkConfig(markov_rank=4, markov_head_type="rnn")),
    "dflash2": dict(dflash2=DFlash2Config(conv_group_size=8, selector_rank=4, selector_top_k=4)),
    "lilicorr": dict(lilicorr=LiLiCorrConfig(candidate_topk=4, hidden_size=32, num_heads=2, factor_dim=16)),
}
LOSSES = {"dflash": LossConfig(), "causal": LossConfig(kind="onpolicy_kl", weighting="dpace"),
          "dspark": LossConfig(terms={"kl": 1.0, "chain": 0.5}, weighting="first_error"),
          "dflash2": LossConfig(kind="mix", temperature=2.0), "lilicorr": LossConfig(kind="lk_hybrid", weighting="decay")}


def meta_session(kind: str, layout: str, tmp_path) -> Session:
    drafter_cfg = DrafterConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                intermediate_size=48, vocab_size=VOCAB, mask_token_id=VOCAB - 1, target_layer_ids=(0, 2),
                                num_target_layers=3, num_hidden_layers=2, block_size=5, max_position_embeddings=128,
                                **KINDS[kind])
    model = DFlashDrafter.build(drafter_cfg, torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN), META).train()
    # block_tokens 10: each micro-batch's blocks in several forwards (Batch.parts)
    cfg = TrainConfig(cache="", out=str(tmp_path), loss=LOSSES[kind], optim=OptimConfig(grad_accum=2),
                      data=DataConfig(layout=layout, block_tokens=10, batch_tokens=64),
                      noise=NoiseConfig(schedule="constant", distribution="gaussian"))
    optimizer = torch.optim.AdamW(model.parameters())
    return Session(cfg=cfg, cache=None, info=DistInfo(), device=META, model=model, forward=model, optimizer=optimizer,
                   scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                   manager=CheckpointManager(tmp_path / "checkpoints"), metrics=None, progress=Progress(), steps=10,
                   step=3, loader_state=LoaderState(partitions=2))


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_training_step_never_reads_the_device_back(kind, layout, tmp_path):
    """Two global batches of two micro-batches each (one of them an idle rank's empty batch), each
    in several forwards, noise on, through step_gradients: every kind and a loss of each family."""
    s = meta_session(kind, layout, tmp_path)
    batches = iter([host_batch(layout, 0), Batch.empty(), host_batch(layout, 1), host_batch(layout, 2)])
    batches = (b if b.ids else Batch(**{**b.__dict__, "state_after": LoaderState(partitions=2).to_dict()}) for b in batches)
    meter = AcceptanceMeter()
    with HostReads():
        tokens, largest, first_bad = step_gradients(s, batches, torch.autocast("cpu", enabled=False), meter,
                                                    torch.zeros((), dtype=torch.long, device=META))
    assert tokens == 3 * sum((23, 9, 31, 14)) and largest == sum((23, 9, 31, 14))
    assert first_bad.device == META and meter.sums["count"].device == META
    assert all(p.grad is not None and p.grad.device == META for p in s.model.parameters())


def test_the_ranks_valid_positions_are_summed_without_a_blocking_upload():
    """loss_scales' all-reduce input (global_sum_on_device, what a step of several ranks calls) is
    filled on the device; the group of one here shows the tensor it makes, not the collective."""
    from dflash_train.training.distributed import global_sum_on_device

    with HostReads():
        total = global_sum_on_device(12.0, DistInfo(), META)
    assert total.device == META and total.dtype == torch.float64
