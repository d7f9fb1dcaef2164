"""Issue 46's objectives: the chain loss (minus the expected accepted length, its gradient checked
against finite differences), the first-error weights, the temperature-scaled KL with its tempered
tail, and each of them trained, resumed and exported through the command line."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from cli.train import app
from dflash_common.errors import ConfigError
from dflash_train.settings.loss_config import LossConfig
from dflash_train.training.loss import block_loss
from dflash_train.training.objectives import (
    bucket_alpha,
    bucket_log_probs,
    chain_term,
    teacher_bucket_log_probs,
    tempered_kl,
    tempered_teacher_buckets,
)
from dflash_train.training.weighting import first_error_weights, position_weights

ALPHAS = torch.tensor([[0.9, 0.5, 0.2]])


def test_chain_is_one_minus_the_product_so_a_block_sums_to_its_length_minus_expected_accepted():
    every = torch.ones(1, 3, dtype=torch.bool)
    chain = chain_term(ALPHAS, every)
    torch.testing.assert_close(chain, torch.tensor([[0.1, 0.55, 0.91]]))
    assert chain.sum().item() == pytest.approx(3 - (0.9 + 0.45 + 0.09))
    # an invalid position ends the chain: nothing after it is reachable
    gap = torch.tensor([[True, False, True]])
    torch.testing.assert_close(chain_term(ALPHAS, gap), torch.tensor([[0.1, 1.0, 1.0]]))


def test_chain_gradient_equals_finite_differences():
    """torch.autograd.gradcheck in float64: the chain of alphas, and the chain from the drafter's
    logits through its buckets (the path block_loss differentiates), against finite differences."""
    gen = torch.Generator().manual_seed(0)
    alpha = (torch.rand(3, 5, generator=gen, dtype=torch.float64) * 0.8 + 0.1).requires_grad_()
    valid = torch.tensor([[True] * 5, [True, True, False, True, True], [True, True, True, False, False]])
    assert torch.autograd.gradcheck(lambda a: chain_term(a, valid), (alpha,))

    vocab, k = 11, 3
    teacher = (torch.randn(2 * 4, vocab, generator=gen, dtype=torch.float64) * 2).log_softmax(-1)
    logprobs, ids = teacher.topk(k, dim=-1)
    p = teacher_bucket_log_probs(logprobs, has_tail=True).exp()
    logits = torch.randn(2 * 4, vocab, generator=gen, dtype=torch.float64).requires_grad_()

    def chain_of(x):
        alphas = bucket_alpha(p, bucket_log_probs(x, ids, True)[1].exp()).view(2, 4)
        return chain_term(alphas, torch.ones(2, 4, dtype=torch.bool)).sum()

    assert torch.autograd.gradcheck(chain_of, (logits,))


def test_chain_alone_in_block_loss_is_minus_expected_accepted_length_over_valid_positions():
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(2, 3, 8, generator=gen, requires_grad=True)
    head = torch.randn(13, 8, generator=gen)
    logprobs, ids = (torch.randn(2, 3, 13, generator=gen) * 2).log_softmax(-1).topk(4, dim=-1)
    valid = torch.tensor([[True, True, True], [True, True, False]])
    out = block_loss(states, head, torch.zeros(2, 3, dtype=torch.long), ids, logprobs, valid,
                     LossConfig(kind="chain", weighting="streak"), block_size=4)
    _, log_q = bucket_log_probs(states.detach().reshape(6, 8) @ head.T, ids.reshape(6, 4), True)
    alpha = bucket_alpha(teacher_bucket_log_probs(logprobs.reshape(6, 4), True).exp(), log_q.exp()).view(2, 3)
    expected_accepted = sum(torch.cumprod(alpha[0], 0)).item() + sum(torch.cumprod(alpha[1, :2], 0)).item()
    # not re-weighted by the streak weights, divided by the 5 valid positions
    assert out.loss.item() == pytest.approx((5 - expected_accepted) / 5, rel=1e-5)
    out.loss.backward()
    assert torch.isfinite(states.grad).all() and states.grad.abs().sum() > 0


def test_first_error_weights_on_hand_case():
    every = torch.ones(1, 3, dtype=torch.bool)
    torch.testing.assert_close(first_error_weights(ALPHAS, every), torch.tensor([[0.1, 0.45, 0.36]]))
    # an invalid position passes the streak on and gets no weight of its own
    torch.testing.assert_close(first_error_weights(ALPHAS, torch.tensor([[True, False, True]])),
                               torch.tensor([[0.1, 0.0, 0.72]]))
    floored = position_weights(ALPHAS, every, LossConfig(weighting="first_error", min_weight=0.2), block_size=4)
    torch.testing.assert_close(floored, torch.tensor([[0.2, 0.45, 0.36]]))
    assert not first_error_weights(ALPHAS.clone().requires_grad_(), every).requires_grad


def test_tempered_teacher_buckets_sum_to_one_and_equal_the_tempered_softmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, generator=gen, dtype=torch.float64) * 3
    for temperature in (0.5, 2.0, 3.7):
        full = (logits / temperature).log_softmax(-1)
        # k = V: no tail, the buckets are the whole tempered softmax
        logprobs, ids = logits.log_softmax(-1).topk(9, dim=-1)
        tempered = tempered_teacher_buckets(logprobs, False, 9, temperature)
        torch.testing.assert_close(tempered, full.gather(1, ids))
        # a tail spread evenly over the V - k other tokens is tempered exactly
        flat = torch.zeros_like(logits)
        flat[:, :3] = logits[:, :3].abs() + 1.0  # the top-3, above the 6 equal others
        logprobs, ids = flat.log_softmax(-1).topk(3, dim=-1)
        buckets = tempered_teacher_buckets(teacher_bucket_log_probs(logprobs, True), True, 9, temperature).exp()
        reference = (flat / temperature).softmax(-1)
        torch.testing.assert_close(buckets[:, :3], reference.gather(1, ids))
        torch.testing.assert_close(buckets.sum(-1), torch.ones(4, dtype=torch.float64))


def test_temperature_one_is_the_existing_kl_and_two_is_the_scaled_full_vocabulary_kl():
    gen = torch.Generator().manual_seed(2)
    states = torch.randn(1, 3, 6, generator=gen)
    head = torch.randn(7, 6, generator=gen)
    teacher = (torch.randn(1, 3, 7, generator=gen) * 2).log_softmax(-1)
    case = dict(lm_head_weight=head, targets=torch.zeros(1, 3, dtype=torch.long), valid=torch.ones(1, 3, dtype=torch.bool),
                block_size=4)
    logprobs, ids = teacher.topk(4, dim=-1)
    plain = block_loss(states, topk_ids=ids, topk_logprobs=logprobs, cfg=LossConfig(weighting="none"), **case)
    one = block_loss(states, topk_ids=ids, topk_logprobs=logprobs, cfg=LossConfig(weighting="none", temperature=1.0), **case)
    assert torch.equal(plain.loss, one.loss)
    logits = states[0] @ head.T
    teacher_logp = teacher_bucket_log_probs(logprobs[0], True)
    torch.testing.assert_close(tempered_kl(logits, ids[0], teacher_logp, True, 1.0),
                               torch.stack([plain.loss_sum[i] for i in range(3)]), rtol=1e-5, atol=1e-6)
    # k = V: T^2 KL(softmax(t / 2) || softmax(l / 2)) over the whole vocabulary
    logprobs, ids = teacher.topk(7, dim=-1)
    two = block_loss(states, topk_ids=ids, topk_logprobs=logprobs, cfg=LossConfig(weighting="none", temperature=2.0), **case)
    p, log_q = (teacher[0] / 2).softmax(-1), (logits / 2).log_softmax(-1)
    reference = 4 * (p * (p.log() - log_q)).sum(-1).mean()
    assert two.loss.item() == pytest.approx(reference.item(), rel=1e-5)


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"temperature": -2.0}, {"temperature": float("inf")},
                                    {"temperature": 2.0, "kind": "tv"}, {"temperature": 2.0, "kind": "lk_hybrid"},
                                    {"temperature": 2.0, "terms": {"kl": 1.0, "rkl": 0.5}},
                                    {"weighting": "first-error"}, {"terms": {"chains": 1.0}}])
def test_config_refuses_bad_values(kwargs):
    with pytest.raises(ConfigError):
        LossConfig(**kwargs)


def test_config_takes_the_new_values():
    assert LossConfig(kind="chain").term_weights() == {"chain": 1.0}
    assert LossConfig(terms={"kl": 1.0, "chain": 0.5, "ce": 0.1}, temperature=2.0).temperature == 2.0
    assert LossConfig(kind="mix", temperature=0.5, weighting="first_error").weighting == "first_error"


def _params(run, step: int) -> dict:
    return safetensors.torch.load_file(str(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


@pytest.mark.parametrize("objective, changed, field, saved", [
    (["--loss-terms", '{"kl": 1, "chain": 1}'], ["--loss-terms", '{"kl": 1, "chain": 2}'], "loss.terms.chain",
     ("terms", {"kl": 1, "chain": 1})),
    (["--loss", "chain"], ["--loss", "kl"], "loss.kind", ("kind", "chain")),
    (["--weighting", "first_error"], ["--weighting", "streak"], "loss.weighting", ("weighting", "first_error")),
    (["--kl-temperature", "2"], ["--kl-temperature", "1"], "loss.temperature", ("temperature", 2.0)),
])
def test_new_objectives_train_resume_exactly_and_export(tmp_path, cache_url, objective, changed, field, saved):
    straight = tmp_path / "straight"
    args = ["run", "--cache", cache_url, "--steps", "4", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "400",
            "--heldout-fraction", "0.05", "--save-every", "2", "--log-every", "1",
            "--eval-sequences", "0", "--quiet"]
    result = CliRunner().invoke(app, [*args, *objective, "--out", str(straight)])
    assert result.exit_code == 0, result.output
    train = [r for r in map(json.loads, (straight / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert len(train) == 4 and all(math.isfinite(r["loss"]) for r in train)
    if "--loss-terms" in objective:  # the chain is logged as a term, and the terms make the loss's sum
        assert all(0.0 <= r["loss_chain"] <= 1.0 for r in train)
    assert json.loads((straight / "config.json").read_text())["loss"][saved[0]] == saved[1]
    exported = safetensors.torch.load_file(str(straight / "drafter" / "model.safetensors"))
    assert exported and all(torch.isfinite(t.float()).all() for t in exported.values())
    again = CliRunner().invoke(app, ["export", str(straight / "checkpoints" / "step-000004"), str(tmp_path / "exp")])
    assert again.exit_code == 0, again.output
    # a run cut after step 2 resumes to the same weights, bit for bit; another value is refused
    cut = tmp_path / "cut"
    shutil.copytree(straight, cut)
    shutil.rmtree(cut / "checkpoints" / "step-000004")
    resumed = CliRunner().invoke(app, [*args, *objective, "--out", str(cut), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    a, b = _params(straight, 4), _params(cut, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    refused = CliRunner().invoke(app, [*args, *changed, "--out", str(cut), "--resume", "--steps", "6"])
    assert refused.exit_code == 1 and f"{field} differs" in refused.output
