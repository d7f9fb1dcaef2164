"""The held-out evaluation the trainer runs every `eval_every` steps: per-position acceptance, the loss
and tau on the held-out split of a cache (fixed anchors, no noise), summed over batches and ranks."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from dflash_cache import Cache
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.loss_config import LossConfig
from dflash_train.training.batch_objective import block_states
from dflash_train.training.calibration import BIN_SUMS, calibration_summary
from dflash_train.training.data import heldout_batches
from dflash_train.training.dflash2 import unary_scores
from dflash_train.training.loss import CONFIDENCE_SUMS, SELECTOR_SUMS, LossOutput, block_loss, tau_from_alpha
from dflash_train.training.model import DFlashDrafter

SUMS = ("alpha", "greedy", "count", "loss")
"""The per-position sums every LossOutput carries, in the order ranks all-reduce them."""


def meter_rows(loss_cfg: LossConfig, drafter_cfg: DrafterConfig | None = None) -> tuple[str, ...]:
    """Names of the [P] sums a meter keeps for a loss: SUMS, then each term of a several-term loss,
    then the confidence head's sums when the drafter has one, the candidate walk's (DFlash2's selector, LiLiCorr's correlator)."""
    terms = loss_cfg.term_weights()
    confidence = drafter_cfg is not None and drafter_cfg.dspark is not None and drafter_cfg.dspark.enable_confidence_head
    return (SUMS + (tuple(f"loss_{name}" for name in sorted(terms)) if len(terms) > 1 else ())
            + (CONFIDENCE_SUMS if confidence else ())
            + (SELECTOR_SUMS if drafter_cfg is not None and (drafter_cfg.dflash2 is not None
                                                             or drafter_cfg.lilicorr is not None) else ()))


class AcceptanceMeter:
    """Sums of per-position statistics over batches, turned into means and tau."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, out: LossOutput) -> None:
        parts = {"alpha": out.alpha_sum, "greedy": out.greedy_sum, "count": out.count, "loss": out.loss_sum,
                 **{f"loss_{name}": value for name, value in out.term_sums.items()}, **out.confidence_sums, **out.selector_sums}
        for name, part in parts.items():
            part = part.detach().double()
            self.sums[name] = self.sums[name] + part if name in self.sums else part.clone()

    def stacked(self, positions: int, rows: tuple[str, ...] = SUMS) -> torch.Tensor:
        """The sums named by rows as one [len(rows), positions] float64 tensor (zeros where nothing
        was added): what ranks all-reduce so that rank 0 logs the whole global batch."""
        zeros = torch.zeros(positions, dtype=torch.float64)
        return torch.stack([self.sums.get(name, zeros).cpu() for name in rows])

    @classmethod
    def from_stacked(cls, stats: torch.Tensor, rows: tuple[str, ...] = SUMS) -> "AcceptanceMeter":
        meter = cls()
        meter.sums = {name: row.clone() for name, row in zip(rows, stats.double().cpu())}
        return meter

    def summary(self) -> dict:
        count = self.sums.get("count")
        if count is None or count.sum() == 0:
            return {}
        total, count = count.sum(), count.clamp(min=1)
        alpha, greedy = self.sums["alpha"] / count, self.sums["greedy"] / count
        terms = {name: float(value.sum() / total) for name, value in self.sums.items() if name.startswith("loss_")}
        # the confidence head's calibration against the acceptance it is trained on (alpha or
        # greedy, dspark.confidence_target): per position, and binned by its predicted value
        calibration = {"calibration": calibration_summary(
            self.sums["count"].tolist(), self.sums["predicted"].tolist(), self.sums["measured"].tolist(),
            {name: self.sums[name].tolist() for name in BIN_SUMS})} if "predicted" in self.sums else {}
        # DFlash2: per position, the teacher's top-1 among the top-k, the selector choosing it, the
        # selector leaving the drafter's top-1 (teacher-forced)
        selector = {"selector": {name.removeprefix("selector_"): [round(float(x), 5) for x in self.sums[name] / count]
                                 for name in SELECTOR_SUMS[1:]}} if "selector_hit" in self.sums else {}
        return {
            "loss": float(self.sums["loss"].sum() / total),
            **terms,
            "alpha": [round(float(x), 5) for x in alpha],
            "greedy": [round(float(x), 5) for x in greedy],
            "tau": tau_from_alpha(alpha),
            "positions": int(total),
            **calibration,
            **selector,
        }


@torch.no_grad()
def evaluate_heldout(model: DFlashDrafter, cache: Cache, data_cfg: DataConfig, loss_cfg: LossConfig,
             max_sequences: int, device: torch.device, autocast: AbstractContextManager | None = None) -> dict:
    """Acceptance on held-out sequences (fixed anchors, no noise): the sampling estimate alpha_k
    and tau, the greedy acceptance per position and the greedy streak per block. ``autocast``:
    what the drafter's forward runs under (the trainer passes its training autocast, so compiled
    flex_attention sees the training dtypes and reuses its graphs instead of adding fp32 ones
    towards dynamo's recompile limit); the LM head's logits stay fp32 either way."""
    was_training = model.training
    model.eval()
    meter, streaks = AcceptanceMeter(), []
    batches = heldout_batches(cache, data_cfg, max_sequences, model.cfg.num_draft_positions)
    for whole in batches:
        spans = whole.parts(model.cfg.block_size, data_cfg, model.attention_backend != "flex")
        for batch in map(whole.to(device).columns, spans):
            streaks.append(_heldout_part(model, batch, loss_cfg, meter, autocast or nullcontext()))
    model.train(was_training)
    summary = meter.summary()
    if streaks and summary:
        streak = torch.cat(streaks).double()
        summary["greedy_streak"] = float(streak.mean())
        summary["tau_greedy"] = 1.0 + summary["greedy_streak"]
    return summary


def _heldout_part(model: DFlashDrafter, batch, loss_cfg: LossConfig, meter: AcceptanceMeter,
                  autocast: AbstractContextManager) -> torch.Tensor:
    """One forward of held-out blocks: its sums added to ``meter``; its blocks' greedy streaks."""
    with autocast:  # as micro_step runs them; the greedy choice below reads fp32 logits, as the loss's do
        states, targets, heads = block_states(model, batch)
        meter.add(block_loss(states, model.lm_head_weight, targets["targets"], targets["topk_ids"],
                             targets["topk_logprobs"], targets["valid"], loss_cfg, model.cfg.block_size, heads))
    if heads.lattice_scores is not None:
        choice = walk_choice(heads.lattice_scores, heads.lattice_ids)
    else:
        choice = argmax_chunks(model, states, heads.features if heads.selector_context is None else heads.selector_context)
    hits = (choice == targets["topk_ids"][..., 0]) & targets["valid"]
    used = targets["valid"][:, 0]  # blocks whose first position counts
    return streak_lengths(hits)[used]


def walk_choice(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """LiLiCorr's greedy choice [...] from the walk's scores along the teacher-forced path [..., k]
    of candidates [..., k] (what greedy decoding draws along an accepted streak)."""
    return candidates.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)


def argmax_chunks(model: DFlashDrafter, states: torch.Tensor, features: torch.Tensor | None = None,
                   chunk: int = 1024) -> torch.Tensor:
    """The drafter's greedy choice at [..., H] states, a chunk of positions at a time: the
    full-vocabulary argmax (plus the Markov bias of DSpark's features [..., r]) or, for DFlash2
    with features its selector's context [..., r], the selector's best among the top-k (the
    teacher-forced previous token: what greedy decoding draws along an accepted streak)."""
    flat = states.reshape(-1, states.shape[-1])
    feats = None if features is None else features.reshape(-1, features.shape[-1])
    selector = model.candidate_selector

    def choose(i: int) -> torch.Tensor:
        part = None if feats is None else feats[i:i + chunk]
        if selector is None or part is None:
            return model.logits(flat[i:i + chunk], part).argmax(-1)
        top = model.logits(flat[i:i + chunk]).float().topk(model.cfg.selector.selector_top_k, dim=-1)
        scores = selector.scores(part, top.indices, unary_scores(top.values, model.cfg.selector))
        return top.indices.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)

    return torch.cat([choose(i) for i in range(0, flat.shape[0], chunk)]).view(states.shape[:-1])


def streak_lengths(hits: torch.Tensor) -> torch.Tensor:
    """Consecutive hits from block position 1: [M, P] bool -> [M] long."""
    return torch.cumprod(hits.long(), dim=1).sum(dim=1)


