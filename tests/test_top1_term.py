"""The top1 term (issue 54): cross-entropy on the teacher's top-1 token, speculators' ce, which
differs from ce (the cached sequence's next token) wherever the cache holds text the teacher would
not have written greedily; trained from the command line on a real cache."""

from __future__ import annotations

import json
import math

import torch
from typer.testing import CliRunner

from cli.train import app
from dflash_train.settings.loss_config import LossConfig
from dflash_train.training.objectives import chunk_terms


def _terms(targets: torch.Tensor, gen: torch.Generator):
    n, hidden, vocab, k = 6, 8, 13, 4
    states = torch.randn(n, hidden, generator=gen)
    head = torch.randn(vocab, hidden, generator=gen)
    teacher = (torch.randn(n, vocab, generator=gen) * 2).log_softmax(-1)
    logprobs, ids = teacher.topk(k, dim=-1)
    per_term, *_ = chunk_terms(states, head, None, None, targets(ids), ids, logprobs, ("ce", "top1"), 3.0, True)
    logits = states @ head.T
    return per_term, logits, ids


def test_top1_is_the_cross_entropy_on_the_teachers_greedy_token():
    gen = torch.Generator().manual_seed(0)
    per_term, logits, ids = _terms(lambda ids: ids[:, 0], gen)
    expected = torch.logsumexp(logits, -1) - logits.gather(1, ids[:, :1]).squeeze(1)
    torch.testing.assert_close(per_term[1], expected)
    torch.testing.assert_close(per_term[0], per_term[1])  # the cache holds the teacher's greedy answer: ce = top1


def test_top1_differs_from_ce_where_the_sequence_is_not_the_teachers_choice():
    gen = torch.Generator().manual_seed(1)
    per_term, logits, ids = _terms(lambda ids: ids[:, 2], gen)  # the text took the teacher's third choice
    ce = torch.logsumexp(logits, -1) - logits.gather(1, ids[:, 2:3]).squeeze(1)
    torch.testing.assert_close(per_term[0], ce)
    assert not torch.allclose(per_term[0], per_term[1])


def test_top1_is_a_loss_kind_and_a_term():
    assert LossConfig(kind="top1").term_weights() == {"top1": 1.0}
    assert LossConfig(terms={"kl": 1.0, "top1": 0.5}).term_weights() == {"kl": 1.0, "top1": 0.5}


def test_run_trains_top1_beside_kl_and_logs_each_term(tmp_path, cache_url):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "run", "--cache", cache_url, "--steps", "6", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "400",
        "--heldout-fraction", "0.05", "--log-every", "1", "--eval-sequences", "0", "--quiet", "--out", str(out),
        "--loss-terms", '{"kl": 1, "top1": 1}'])
    assert result.exit_code == 0, result.output
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert len(train) == 6 and all(math.isfinite(r["loss_top1"]) and r["loss_top1"] > 0 for r in train)
    assert train[-1]["loss_top1"] < train[0]["loss_top1"]  # it trains toward the teacher's choice
    assert json.loads((out / "config.json").read_text())["loss"]["terms"] == {"kl": 1, "top1": 1}
