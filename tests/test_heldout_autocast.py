"""The trainer's held-out evaluation runs its forwards under the training steps' autocast (issue 57):
in fp32 beside bf16 training it handed compiled flex_attention a second dtype, so more graphs
towards dynamo's recompile limit (past it flex falls back to eager silently). On the CPU the
trainer's autocast is off, so the test hands held_out a bf16 one and sees the dtypes the
attention gets; the LM head's logits stay fp32 either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from dflash_cache import open_cache
from dflash_common.progress import Progress
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.model_config import ModelConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.distributed import DistInfo
from dflash_train.training.session import setup
from dflash_train.training.trainer import held_out, train_autocast


class AttentionDtypes(TorchFunctionMode):
    """The (q, k, v) dtypes of every attention call, and the LM head's logits' dtype in the loss."""

    def __init__(self):
        super().__init__()
        self.attention, self.log_softmax = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.attention.append(tuple(t.dtype for t in args[:3]))
        if func in (torch.log_softmax, torch.logsumexp, torch.Tensor.logsumexp):
            self.log_softmax.append(args[0].dtype)
        return func(*args, **kwargs)


def test_held_out_evaluation_runs_under_the_autocast_it_is_given(cache_url, tmp_path: Path):
    cfg = TrainConfig(cache=cache_url, out=str(tmp_path / "run"), eval_sequences=16, steps=2,
                      model=ModelConfig(num_layers=2, block_size=4, sliding_window=6, sliding_layers=(0,)),
                      data=DataConfig(batch_tokens=500, heldout_fraction=0.2))
    cpu = torch.device("cpu")
    s = setup(cfg, open_cache(cache_url), DistInfo(), cpu, False, None, Progress(), 0)
    results, seen = {}, {}
    for name, autocast in (("trainer", train_autocast(cpu)), ("bf16", torch.autocast("cpu", dtype=torch.bfloat16))):
        with AttentionDtypes() as dtypes:
            results[name] = held_out(s, "before", autocast)
        seen[name] = dtypes
    assert seen["trainer"].attention and set(seen["trainer"].attention) == {(torch.float32,) * 3}
    assert seen["bf16"].attention and set(seen["bf16"].attention) == {(torch.bfloat16,) * 3}
    assert seen["bf16"].log_softmax and set(seen["bf16"].log_softmax) == {torch.float32}
    fp32, bf16 = results["trainer"], results["bf16"]
    assert fp32["positions"] == bf16["positions"] > 0
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2) and bf16["tau"] == pytest.approx(fp32["tau"], abs=5e-2)
    assert s.model.training  # evaluation leaves the drafter training
    logged = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"kind": "eval"' in line for line in logged) == 2
