"""Tests for dflash_train.training.loss: hand-computed cases, a float64 brute force, chunking and memory."""

import json
import math

import pytest
import torch

from dflash_common.errors import ConfigError
from dflash_train.settings.loss_config import LOSS_KINDS, WEIGHTINGS, LossConfig
from dflash_train.training.loss import LossOutput, block_loss, tau_from_alpha
from dflash_train.training.weighting import decay_weights, default_gamma, dpace_weights, position_weights, streak_weights

# ---------------------------------------------------------------------------------------------
# Hand case: vocab 6, identity LM head (logits == states), teacher top-2 = ids (2, 4) with
# probabilities (0.5, 0.3) and tail 0.2.


def hand_case(drafter_probs, target=4):
    """One block of size 2 (one position) whose drafter softmax is exactly drafter_probs."""
    states = torch.tensor(drafter_probs, dtype=torch.float32).log().view(1, 1, 6).requires_grad_()
    lm_head = torch.eye(6)
    targets = torch.tensor([[target]])
    ids = torch.tensor([[[2, 4]]])
    logprobs = torch.tensor([[[0.5, 0.3]]]).log()
    valid = torch.ones(1, 1, dtype=torch.bool)
    return states, lm_head, targets, ids, logprobs, valid


# Drafter with the teacher's exact buckets (tail 0.2 spread over the 4 other ids).
MATCHING = [0.05, 0.05, 0.5, 0.05, 0.3, 0.05]
# Drafter whose top-k, renormalised, equals the teacher's (0.625, 0.375) but whose tail is 0.04.
SHIFTED = [0.01, 0.01, 0.6, 0.01, 0.36, 0.01]
SHIFTED_KL = 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.36) + 0.2 * math.log(0.2 / 0.04)
SHIFTED_CE = -math.log(0.36)


def run(case, **cfg):
    return block_loss(*case, LossConfig(weighting="none", **cfg), block_size=2)


def test_kl_is_zero_when_drafter_buckets_equal_teacher_buckets():
    out = run(hand_case(MATCHING))
    assert abs(out.loss.item()) < 1e-6
    assert out.alpha_sum.item() == pytest.approx(1.0, abs=1e-6)


def test_kl_counts_the_tail_instead_of_renormalising_the_topk():
    out = run(hand_case(SHIFTED))
    assert SHIFTED_KL == pytest.approx(0.1760312, abs=1e-6)
    assert out.loss.item() == pytest.approx(SHIFTED_KL, rel=1e-5)


def test_ce_is_negative_log_prob_of_target():
    assert run(hand_case(SHIFTED), kind="ce").loss.item() == pytest.approx(SHIFTED_CE, rel=1e-5)
    # -log 0.6 for the drafter's argmax as target.
    assert run(hand_case(SHIFTED, target=2), kind="ce").loss.item() == pytest.approx(0.5108256, rel=1e-5)


def test_mix_weights_kl_by_lambda():
    out = run(hand_case(SHIFTED), kind="mix", mix_lambda=0.25)
    assert out.loss.item() == pytest.approx(0.25 * SHIFTED_KL + 0.75 * SHIFTED_CE, rel=1e-5)


def test_alpha_and_greedy_on_hand_case():
    out = run(hand_case(SHIFTED))
    # min(.5,.6) + min(.3,.36) + min(.2,.04)
    assert out.alpha_sum.item() == pytest.approx(0.84, abs=1e-6)
    assert out.greedy_sum.item() == 1.0
    assert out.count.tolist() == [1]
    # Drafter argmax on id 0, not on the teacher's top-1 (id 2): greedy 0; alpha
    # min(.5,.2) + min(.3,.1) + min(.2,.7) = 0.5.
    out = run(hand_case([0.4, 0.1, 0.2, 0.1, 0.1, 0.1]))
    assert out.greedy_sum.item() == 0.0
    assert out.alpha_sum.item() == pytest.approx(0.5, abs=1e-6)


# Acceptance objectives on the SHIFTED hand case: teacher buckets p = (0.5, 0.3, tail 0.2),
# drafter buckets q = (0.6, 0.36, tail 0.04), so alpha = 0.5 + 0.3 + 0.04 = 0.84.
SHIFTED_RKL = 0.6 * math.log(0.6 / 0.5) + 0.36 * math.log(0.36 / 0.3) + 0.04 * math.log(0.04 / 0.2)
SHIFTED_JSD = 0.5 * (0.5 * math.log(0.5 / 0.55) + 0.3 * math.log(0.3 / 0.33) + 0.2 * math.log(0.2 / 0.12)) + 0.5 * (
    0.6 * math.log(0.6 / 0.55) + 0.36 * math.log(0.36 / 0.33) + 0.04 * math.log(0.04 / 0.12))


@pytest.mark.parametrize("kind, expected", [
    ("tv", 0.16),
    ("nla", -math.log(0.84)),
    ("lk_hybrid", math.exp(-3 * 0.84) * SHIFTED_KL + (1 - math.exp(-3 * 0.84)) * 0.16),
    ("rkl", SHIFTED_RKL),
    ("jsd", SHIFTED_JSD),
])
def test_acceptance_objectives_on_hand_case(kind, expected):
    assert run(hand_case(SHIFTED), kind=kind).loss.item() == pytest.approx(expected, rel=1e-5)


def test_lk_hybrid_blend_follows_eta():
    # eta 0: the blend is 1, all kl; a large eta: all tv
    assert run(hand_case(SHIFTED), kind="lk_hybrid", lk_eta=0.0).loss.item() == pytest.approx(SHIFTED_KL, rel=1e-5)
    assert run(hand_case(SHIFTED), kind="lk_hybrid", lk_eta=50.0).loss.item() == pytest.approx(0.16, rel=1e-4)


def test_weighted_terms_sum_and_are_logged_one_by_one():
    out = run(hand_case(SHIFTED), terms={"ce": 0.1, "tv": 0.9})
    assert out.loss.item() == pytest.approx(0.1 * SHIFTED_CE + 0.9 * 0.16, rel=1e-5)
    assert out.term_sums["ce"].item() == pytest.approx(SHIFTED_CE, rel=1e-5)
    assert out.term_sums["tv"].item() == pytest.approx(0.16, rel=1e-5)
    # terms replace kind; mix is its two terms; one term logs no split
    assert run(hand_case(SHIFTED), kind="ce", terms={"tv": 1.0}).loss.item() == pytest.approx(0.16, rel=1e-5)
    assert set(run(hand_case(SHIFTED), kind="mix").term_sums) == {"kl", "ce"}
    assert run(hand_case(SHIFTED), kind="tv").term_sums == {}


def test_onpolicy_kl_splits_blocks_at_the_drafters_first_greedy_miss():
    # one block of three positions: the drafter's argmax is the teacher's top-1 (id 2) at k=1 and
    # k=3, not at k=2 (id 0): kl at k=1, rkl at k=2 (weight 1) and at k=3 (weight decay)
    miss = [0.4, 0.1, 0.2, 0.1, 0.1, 0.1]
    states = torch.tensor([SHIFTED, miss, SHIFTED]).log().view(1, 3, 6)
    case = (states, torch.eye(6), torch.tensor([[4, 4, 4]]), torch.tensor([[[2, 4]] * 3]),
            torch.tensor([[[0.5, 0.3]] * 3]).log(), torch.ones(1, 3, dtype=torch.bool))
    miss_rkl = 0.2 * math.log(0.2 / 0.5) + 0.1 * math.log(0.1 / 0.3) + 0.7 * math.log(0.7 / 0.2)
    out = block_loss(*case, LossConfig(kind="onpolicy_kl", onpolicy_decay=0.25, weighting="none"), block_size=4)
    assert out.loss_sum.tolist() == pytest.approx([SHIFTED_KL, miss_rkl, 0.25 * SHIFTED_RKL], rel=1e-5)
    # a miss at an invalid position does not count: all three are then kl (k=2 is not trained)
    case = case[:5] + (torch.tensor([[True, False, True]]),)
    out = block_loss(*case, LossConfig(kind="onpolicy_kl", weighting="none"), block_size=4)
    assert out.loss_sum.tolist() == pytest.approx([SHIFTED_KL, 0.0, SHIFTED_KL], rel=1e-5)


def test_dpace_weights_on_hand_case():
    # confidence c = (0.5, 0.25, 1.0), s = 0.5: c~ = (0.75, 0.625, 1.0), reach = (0.75, 0.46875,
    # 0.46875), weight_k = sum of reach from k on
    confidence, valid = torch.tensor([[0.5, 0.25, 1.0]]), torch.ones(1, 3, dtype=torch.bool)
    assert dpace_weights(confidence, valid, 0.5)[0].tolist() == pytest.approx([1.6875, 0.9375, 0.46875])
    # an invalid position: c~ = 1, no weight of its own, nothing added to the sums before it
    assert dpace_weights(confidence, torch.tensor([[True, False, True]]), 0.5)[0].tolist() == pytest.approx([1.5, 0.0, 0.75])
    # s = 1: every reach is 1, weight_k = the valid positions from k on
    assert dpace_weights(confidence, valid, 1.0).tolist() == [[3.0, 2.0, 1.0]]
    # in the loss, confidence is the drafter's probability of the true token (0.25: uniform over 4)
    out = block_loss(*uniform_ce_case([True, True]), LossConfig(kind="ce", weighting="dpace", dpace_smoothing=0.5),
                     block_size=3)
    c = 0.5 + 0.5 * 0.25
    assert out.loss.item() == pytest.approx(math.log(4) * ((c + c * c) + c * c) / 2, rel=1e-6)


@pytest.mark.parametrize("kind", ["tv", "nla", "lk_hybrid", "rkl", "jsd", "onpolicy_kl", "chain"])
@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_objective_gradients_equal_float64_reference(kind, weighting):
    states, lm_head, targets, ids, logprobs, valid, b = random_batch(3)
    cfg = LossConfig(kind=kind, weighting=weighting, chunk_positions=4)
    states64 = states.double().requires_grad_()
    ref_loss, *_ = brute_force_loss(states64, lm_head.double(), targets, ids, logprobs, valid, cfg, b)
    ref_loss.backward()
    states32 = states.clone().requires_grad_()
    out = block_loss(states32, lm_head, targets, ids, logprobs, valid, cfg, b)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    torch.testing.assert_close(states32.grad.double(), states64.grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Float64 brute force over the full vocabulary, written without the logsumexp tricks.


def brute_force_terms(states, lm_head, targets, ids, logprobs, eta=3.0):
    """Per-row ({term: value}, alpha, greedy, confidence) in float64 for already-gathered rows."""
    logits = states.double() @ lm_head.double().T
    q = logits.softmax(-1)
    p = logprobs.double().exp()
    in_topk = torch.zeros_like(q, dtype=torch.bool).scatter(1, ids, True)
    q_top = q.gather(1, ids)
    q_tail = (q * ~in_topk).sum(-1)
    p_tail = (1 - p.sum(-1)).clamp(min=0)
    kl = (p * (p.log() - q_top.log())).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
    ce = -q.gather(1, targets[:, None]).squeeze(1).log()
    alpha = torch.minimum(p, q_top).sum(-1) + torch.minimum(p_tail, q_tail)
    greedy = (logits.argmax(-1) == ids[:, 0]).double()
    pb, qb = torch.cat([p, p_tail[:, None]], 1), torch.cat([q_top, q_tail[:, None]], 1)
    mb = (pb + qb) / 2
    blend = torch.exp(-eta * alpha.detach())
    terms = {"kl": kl, "ce": ce, "top1": -q_top[:, 0].log(), "tv": 1 - alpha, "nla": -alpha.log(), "lk_hybrid": blend * kl + (1 - blend) * (1 - alpha),
             "rkl": (qb * (qb.log() - pb.log())).sum(-1),
             "jsd": 0.5 * (pb * (pb.log() - mb.log())).sum(-1) + 0.5 * (qb * (qb.log() - mb.log())).sum(-1)}
    return terms, alpha, greedy, (-ce).exp().detach()


def brute_force_loss(states, lm_head, targets, ids, logprobs, valid, cfg, block_size):
    """The whole objective, unchunked, float64 (weights from the brute-force alpha)."""
    m, p, h = states.shape
    rows = valid.reshape(-1).nonzero().squeeze(1)
    terms, alpha, greedy, confidence = brute_force_terms(
        states.reshape(-1, h)[rows],
        lm_head,
        targets.reshape(-1)[rows],
        ids.reshape(m * p, -1)[rows],
        logprobs.reshape(m * p, -1)[rows],
        cfg.lk_eta,
    )
    grid = lambda v: torch.zeros(m * p, dtype=torch.float64).index_copy(0, rows, v.detach()).view(m, p)  # noqa: E731
    # onpolicy_kl by its definition, block by block: kl up to the first valid miss, then
    # decay ** j * rkl at the j-th position from that miss on
    hits = grid(greedy).bool()
    onpolicy = torch.zeros(m, p, dtype=torch.float64)
    for block in range(m):
        missed_at = None
        for k in range(p):
            if valid[block, k] and not hits[block, k] and missed_at is None:
                missed_at = k
            onpolicy[block, k] = 0.0 if missed_at is None else cfg.onpolicy_decay ** (k - missed_at)
    factor = onpolicy.reshape(-1)[rows]
    terms["onpolicy_kl"] = torch.where(factor > 0, factor * terms["rkl"], terms["kl"])
    # chain by its definition, block by block: 1 - the product of alpha up to each position, an
    # invalid position ending the product
    row_of = {int(r): i for i, r in enumerate(rows)}
    chain = [None] * rows.numel()
    for block in range(m):
        reach = torch.ones((), dtype=torch.float64)
        for k in range(p):
            reach = reach * alpha[row_of[block * p + k]] if valid[block, k] else reach * 0.0
            if valid[block, k]:
                chain[row_of[block * p + k]] = 1.0 - reach
    terms["chain"] = torch.stack(chain)
    weighted = sum(w * terms[name] for name, w in cfg.term_weights().items() if name != "chain")
    unweighted = cfg.term_weights().get("chain", 0.0) * terms["chain"]
    weights = position_weights(grid(alpha), valid, cfg, block_size, grid(confidence)).double().reshape(-1)[rows]
    loss = (weights * weighted + unweighted).sum() / rows.numel()
    return loss, weighted + unweighted, alpha, greedy, rows


def random_batch(seed, m=5, block_size=8, hidden=12, vocab=97, k=6, valid_fraction=0.75):
    gen = torch.Generator().manual_seed(seed)
    p = block_size - 1
    states = torch.randn(m, p, hidden, generator=gen)
    lm_head = torch.randn(vocab, hidden, generator=gen) * 0.5
    teacher = (torch.randn(m, p, vocab, generator=gen) * 2).log_softmax(-1)
    logprobs, ids = teacher.topk(k, dim=-1)
    targets = torch.randint(0, vocab, (m, p), generator=gen)
    valid = torch.rand(m, p, generator=gen) < valid_fraction
    valid[0, 0] = True
    # Garbage where invalid must never be read.
    targets[~valid] = -100
    ids[~valid] = -1
    return states, lm_head, targets, ids, logprobs, valid, block_size


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_matches_float64_brute_force(kind):
    states, lm_head, targets, ids, logprobs, valid, b = random_batch(1)
    cfg = LossConfig(kind=kind, mix_lambda=0.3, weighting="none", onpolicy_decay=0.7)
    out = block_loss(states, lm_head, targets, ids, logprobs, valid, cfg, b)
    ref_loss, per_position, alpha, greedy, rows = brute_force_loss(
        states, lm_head, targets, ids, logprobs, valid, cfg, b
    )
    assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    columns = rows % (b - 1)
    per_column = lambda v: torch.zeros(b - 1, dtype=torch.float64).index_add(0, columns, v)  # noqa: E731
    torch.testing.assert_close(out.loss_sum.double(), per_column(per_position), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.alpha_sum.double(), per_column(alpha), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.greedy_sum.double(), per_column(greedy))
    assert out.count.tolist() == valid.sum(0).tolist()


def test_tail_is_stable_when_topk_holds_almost_all_mass():
    # Drafter tail mass ~e-20: log(1 - sum q) would give -inf or garbage in fp32.
    logits = torch.tensor([[[30.0, 29.0, -15.0, -16.0]]], requires_grad=True)
    ids = torch.tensor([[[0, 1]]])
    logprobs = torch.tensor([[[0.7, 0.2]]]).log()
    valid = torch.ones(1, 1, dtype=torch.bool)
    out = block_loss(logits, torch.eye(4), torch.tensor([[0]]), ids, logprobs, valid, LossConfig(weighting="none"), 2)
    ref, *_ = brute_force_loss(logits, torch.eye(4), torch.tensor([[0]]), ids, logprobs, valid, LossConfig(weighting="none"), 2)
    assert math.isfinite(out.loss.item())
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_topk_covering_whole_vocab_has_no_tail_bucket():
    states = torch.tensor([[[0.0, 1.0, 2.0]]], requires_grad=True)
    q = torch.softmax(states.detach()[0, 0], -1)
    ids = torch.tensor([[[2, 1, 0]]])
    logprobs = q[[2, 1, 0]].log().view(1, 1, 3)
    out = block_loss(states, torch.eye(3), torch.tensor([[2]]), ids, logprobs, torch.ones(1, 1, dtype=torch.bool),
                     LossConfig(weighting="none"), 2)
    assert abs(out.loss.item()) < 1e-6
    out.loss.backward()
    assert torch.isfinite(states.grad).all()


# ---------------------------------------------------------------------------------------------
# Weights and normalisation.


def test_default_gamma_table_and_interpolation():
    assert default_gamma(16) == 7.0
    assert default_gamma(10) == 5.0
    assert default_gamma(8) == 4.0
    assert default_gamma(12) == pytest.approx(5 + 2 * 2 / 6)
    assert default_gamma(4) == 2.0
    assert default_gamma(2) == 1.0
    with pytest.raises(ConfigError):
        default_gamma(1)


def test_decay_weights_for_gamma_7():
    w = decay_weights(15, 7.0)
    assert w[0].item() == 1.0
    assert w[1].item() == pytest.approx(0.8668779, rel=1e-6)  # exp(-1/7)
    assert w[7].item() == pytest.approx(0.3678794, rel=1e-6)  # exp(-1)
    assert w[14].item() == pytest.approx(0.1353353, rel=1e-6)  # exp(-2)


def test_streak_weights_with_smoothing_and_invalid_position():
    alpha = torch.tensor([[0.8, 0.6, 0.123, 0.4, 0.9]])
    valid = torch.tensor([[True, True, False, True, True]])
    # s = 0.5: alpha~ = 0.9, 0.8, (invalid) 1, 0.7 -> exclusive products 1, .9, .72, .72, .504
    w = streak_weights(alpha, valid, 0.5)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.9, 0.72, 0.72, 0.504]]))
    # s = 0: raw alphas 0.8, 0.6, (invalid) 1, 0.4 -> 1, .8, .48, .48, .192
    w = streak_weights(alpha, valid, 0.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.8, 0.48, 0.48, 0.192]]))
    # s = 1: every weight 1.
    torch.testing.assert_close(streak_weights(alpha, valid, 1.0), torch.ones(1, 5))


def test_streak_weights_are_detached_and_optionally_decayed():
    alpha = torch.tensor([[0.8, 0.6, 0.4]], requires_grad=True)
    valid = torch.ones(1, 3, dtype=torch.bool)
    cfg = LossConfig(weighting="streak", streak_decay=True, gamma=2.0)
    w = position_weights(alpha, valid, cfg, block_size=4)
    assert not w.requires_grad
    expected = torch.tensor([[1.0, 0.9 * math.exp(-0.5), 0.72 * math.exp(-1.0)]])
    torch.testing.assert_close(w, expected)


def test_min_weight_floors_decay_and_streak_weights():
    alpha, valid = torch.tensor([[0.5, 0.5, 0.5, 0.5]]), torch.ones(1, 4, dtype=torch.bool)
    decay = position_weights(alpha, valid, LossConfig(weighting="decay", gamma=1.0, min_weight=0.2), block_size=5)
    torch.testing.assert_close(decay, torch.tensor([[1.0, math.exp(-1.0), 0.2, 0.2]]))  # exp(-2), exp(-3) < 0.2
    streak = position_weights(alpha, valid, LossConfig(streak_smoothing=0.0, min_weight=0.2), block_size=5)
    torch.testing.assert_close(streak, torch.tensor([[1.0, 0.5, 0.25, 0.2]]))  # 0.125 floored
    assert position_weights(alpha, valid, LossConfig(streak_smoothing=0.0), block_size=5)[0, 3].item() == 0.125
    with pytest.raises(ConfigError, match=r"min_weight 1.5 is not a number in \[0, 1\]"):
        LossConfig(min_weight=1.5)


def uniform_ce_case(valid_mask):
    """Every position has drafter probability 0.25 on its target (uniform over 4 ids)."""
    p = len(valid_mask)
    states = torch.zeros(1, p, 4, requires_grad=True)
    ids = torch.tensor([0, 1]).expand(1, p, 2).clone()
    logprobs = torch.tensor([0.5, 0.3]).log().expand(1, p, 2).clone()
    return states, torch.eye(4), torch.zeros(1, p, dtype=torch.long), ids, logprobs, torch.tensor([valid_mask])


def test_loss_divides_by_number_of_valid_positions_not_sum_of_weights():
    case = uniform_ce_case([True, False, True])
    out = block_loss(*case, LossConfig(kind="ce", weighting="decay", gamma=1.0), block_size=4)
    # positions k=1 and k=3 valid, weights 1 and exp(-2), each ce = log 4
    expected = math.log(4) * (1 + math.exp(-2)) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    # streak: alpha = min(.5,.25)+min(.3,.25)+min(.2,.5) = 0.7 at k=1; alpha~ = 0.85; k=2 invalid
    out = block_loss(*case, LossConfig(kind="ce"), block_size=4)
    assert out.loss.item() == pytest.approx(math.log(4) * (1 + 0.85) / 2, rel=1e-6)
    assert out.alpha_sum.tolist() == pytest.approx([0.7, 0.0, 0.7], abs=1e-6)
    assert out.count.tolist() == [1, 0, 1]


def test_nothing_valid_gives_zero_loss_with_grad_path():
    case = uniform_ce_case([False, False, False])
    out = block_loss(*case, LossConfig(), block_size=4)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert case[0].grad is not None and (case[0].grad == 0).all()
    assert out.count.tolist() == [0, 0, 0]


def test_tau_from_alpha():
    assert tau_from_alpha([0.5, 0.5]) == pytest.approx(1.75)
    assert tau_from_alpha(torch.tensor([1.0, 1.0, 0.0, 1.0])) == pytest.approx(3.0)
    assert LossOutput.tau_from_alpha([0.8]) == pytest.approx(1.8)


# ---------------------------------------------------------------------------------------------
# Chunking, checkpointing and memory.


@pytest.mark.parametrize("chunk", [1, 3, 10_000])
@pytest.mark.parametrize("weighting", ["streak", "decay"])
def test_chunked_loss_and_gradients_equal_unchunked_reference(chunk, weighting):
    states, lm_head, targets, ids, logprobs, valid, b = random_batch(2)
    cfg = LossConfig(kind="mix", mix_lambda=0.6, weighting=weighting, chunk_positions=chunk)
    states64 = states.double().requires_grad_()
    head64 = lm_head.double().requires_grad_()
    ref_loss, *_ = brute_force_loss(states64, head64, targets, ids, logprobs, valid, cfg, b)
    ref_loss.backward()

    states32 = states.clone().requires_grad_()
    head32 = lm_head.clone().requires_grad_()
    out = block_loss(states32, head32, targets, ids, logprobs, valid, cfg, b)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    torch.testing.assert_close(states32.grad.double(), states64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head32.grad.double(), head64.grad, rtol=1e-4, atol=1e-6)


def saved_numels(fn):
    """numel of every tensor autograd saves for backward while fn runs (excluding the LM head,
    which is the caller's own parameter, not an activation)."""
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sizes


def test_no_vocab_sized_activation_is_kept_for_backward():
    vocab = 4096
    states, lm_head, targets, ids, logprobs, valid, b = random_batch(3, m=8, vocab=vocab, valid_fraction=1.0)
    num_valid = int(valid.sum())
    states.requires_grad_()
    head_numel = lm_head.numel()

    # The brute force keeps [num_valid, V] tensors: the measurement does see them.
    unchunked = saved_numels(lambda: brute_force_loss(states, lm_head, targets, ids, logprobs, valid, LossConfig(), b))
    assert max(unchunked) >= num_valid * vocab

    for chunk in (4, 10_000):
        sizes = [s for s in saved_numels(
            lambda: block_loss(states, lm_head, targets, ids, logprobs, valid, LossConfig(chunk_positions=chunk), b)
        ) if s != head_numel]
        assert max(sizes) < vocab
        assert sum(sizes) < vocab * 4


def peak_bytes(fn):
    """Peak CPU bytes allocated (above the start) while fn runs, from the profiler's memory events."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = [e["args"] for e in json.load(fh)["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        pytest.skip("this torch profiler records no memory events")
    base = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - base


def test_peak_memory_scales_with_chunk_size_not_batch():
    vocab = 8192
    states, lm_head, targets, ids, logprobs, valid, b = random_batch(4, m=8, vocab=vocab, valid_fraction=1.0)
    num_valid = int(valid.sum())  # 56
    states.requires_grad_()

    def step(chunk):
        out = block_loss(states, lm_head, targets, ids, logprobs, valid, LossConfig(chunk_positions=chunk), b)
        out.loss.backward()

    step(4)  # warm-up so one-off allocations do not land in the measurement
    chunk_logits_bytes = 4 * vocab * 4
    small = peak_bytes(lambda: step(4))
    whole = peak_bytes(lambda: step(num_valid))
    # A handful of [chunk, V] fp32 buffers at a time, never the batch's [num_valid, V].
    assert small < 8 * chunk_logits_bytes
    assert small < num_valid * vocab * 4
    assert whole > 4 * small


# ---------------------------------------------------------------------------------------------
# Robustness.


def test_autocast_does_not_lower_logit_precision():
    states, lm_head, targets, ids, logprobs, valid, b = random_batch(5)
    cfg = LossConfig(weighting="none")
    plain = block_loss(states, lm_head, targets, ids, logprobs, valid, cfg, b).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = block_loss(states, lm_head, targets, ids, logprobs, valid, cfg, b).loss
    assert autocast.dtype == torch.float32
    assert autocast.item() == pytest.approx(plain.item(), rel=1e-6)


def test_bf16_head_rounds_the_matmul_inputs_and_keeps_fp32_accumulation():
    """head_matmul bf16: the loss of bf16-rounded states and head accumulated in fp32 (what cuBLAS
    computes on CUDA), close to fp32's; CPU keeps the stored head in fp32, CUDA holds it in bf16."""
    from dflash_train.training.objectives import head_dtype, head_logits

    states, lm_head, targets, ids, logprobs, valid, b = random_batch(5)
    states = states.detach().requires_grad_()
    exact = block_loss(states, lm_head, targets, ids, logprobs, valid, LossConfig(), b)
    half = block_loss(states, lm_head, targets, ids, logprobs, valid, LossConfig(head_matmul="bf16"), b)
    rounded = block_loss(states.detach().bfloat16().float().requires_grad_(), lm_head.bfloat16().float(), targets, ids,
                         logprobs, valid, LossConfig(), b)
    assert half.loss.item() == pytest.approx(rounded.loss.item(), rel=1e-6)
    assert half.loss.item() != exact.loss.item() and half.loss.item() == pytest.approx(exact.loss.item(), rel=1e-2)
    half.loss.backward()
    assert states.grad is not None and torch.isfinite(states.grad).all()
    # fp32 accumulation: far closer to fp32 than logits rounded to bf16 afterwards would be
    plain = states.detach()[0]
    logits = head_logits(plain, lm_head, "bf16")
    assert logits.dtype == torch.float32
    error = (logits - plain @ lm_head.T).abs().max()
    assert error < (plain.bfloat16() @ lm_head.bfloat16().T).float().sub(plain @ lm_head.T).abs().max()
    assert head_dtype("bf16", torch.device("cpu")) == torch.float32
    assert head_dtype("bf16", torch.device("cuda")) == torch.bfloat16 and head_dtype("fp32", torch.device("cuda")) == torch.float32


def test_no_grad_evaluation_runs_without_checkpoint():
    states, lm_head, targets, ids, logprobs, valid, b = random_batch(6)
    with torch.no_grad():
        out = block_loss(states, lm_head, targets, ids, logprobs, valid, LossConfig(chunk_positions=2), b)
    assert not out.loss.requires_grad
    ref, *_ = brute_force_loss(states, lm_head, targets, ids, logprobs, valid, LossConfig(), b)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "kld"},
        {"mix_lambda": 1.5},
        {"mix_lambda": float("nan")},
        {"weighting": "linear"},
        {"gamma": 0.0},
        {"gamma": -3},
        {"streak_smoothing": -0.1},
        {"streak_decay": True, "weighting": "decay"},
        {"streak_decay": 1},
        {"chunk_positions": 0},
        {"chunk_positions": 2.5},
        {"chunk_bytes": 0},
        {"chunk_bytes": True},
        {"kind": "tvd"},
        {"terms": {}},
        {"terms": {"tv": -1.0}},
        {"terms": {"tv": 0.0}},
        {"terms": {"kl": 1.0, "hinge": 0.5}},
        {"terms": {"tv": float("nan")}},
        {"weighting": "dpace", "dpace_smoothing": 0.0},
        {"onpolicy_decay": 1.5},
        {"lk_eta": -1.0},
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError):
        LossConfig(**kwargs)


def test_default_chunks_are_sized_by_bytes_of_logits():
    cfg = LossConfig()
    assert cfg.positions_per_chunk(248_320) == 270  # 256 MiB of fp32 logits at the production vocabulary
    assert cfg.positions_per_chunk(2048) == 32_768  # a whole batch at small vocabularies
    assert LossConfig(chunk_bytes=10).positions_per_chunk(248_320) == 1
    assert LossConfig(chunk_positions=7, chunk_bytes=10).positions_per_chunk(248_320) == 7
    # chunks by bytes give the same loss as explicit chunks of the same size
    states, lm_head, targets, ids, logprobs, valid, b = random_batch(7)
    vocab = lm_head.shape[0]
    by_bytes = block_loss(states, lm_head, targets, ids, logprobs, valid, LossConfig(chunk_bytes=3 * 4 * vocab), b)
    by_count = block_loss(states, lm_head, targets, ids, logprobs, valid, LossConfig(chunk_positions=3), b)
    assert torch.equal(by_bytes.loss, by_count.loss)


def test_shape_mismatch_is_rejected():
    states, lm_head, targets, ids, logprobs, valid, b = random_batch(7)
    with pytest.raises(ValueError, match="block_size"):
        block_loss(states, lm_head, targets, ids, logprobs, valid, LossConfig(), b + 1)
    with pytest.raises(ValueError, match="topk_logprobs"):
        block_loss(states, lm_head, targets, ids, logprobs[..., :-1], valid, LossConfig(), b)
