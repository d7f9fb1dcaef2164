"""Block speculative decoding with a DFlash drafter: the real check of a trained drafter.

One generation, as the reference DFlash decoder runs it:

1. Prefill: the teacher runs the prompt once with its KV cache; forward hooks on the tapped decoder
   layers capture every prompt position's features. Its last logits give the first new token, the
   anchor `x_a` at position `a` (whose features are not known yet).
2. Draft: the drafter turns `[x_a, MASK x (B-1)]` plus the cached context keys/values of positions
   `0..a-1` into B-1 draft tokens in one forward.
3. Verify: the teacher runs `[x_a, d_1..d_{B-1}]` in ONE forward on its cache, the hooks capture the
   block's features, and the logits give the teacher's next-token distribution after each position.
4. Accept: greedy keeps drafts while they equal the teacher's argmax; sampling uses speculative
   rejection sampling, so the output distribution is exactly the teacher's. A round keeps `m + 1`
   tokens: m accepted drafts plus the teacher's own token (correction or bonus).
5. Keep: the teacher's cache is rolled back to the kept positions, their features are appended to
   the drafter's context, and the teacher's token becomes the next anchor.

Greedy output equals the teacher's own greedy output up to floating-point near ties, where a
block's verify forward and a one-token decode can round to different argmaxes (in bf16 more often
than in fp32); eval names those (dflash_train.measuring.exactness).

How each kind draws one block's drafts (DFlash, DSpark, DFlash2's selector, LiLiCorr's walk) is
dflash_train.measuring.drafting.

Rolling the teacher's cache back: attention layers are cropped (`crop` with a negative count;
sliding-window layers are switched to recording their past after the prefill, so a crop still
works once the window is full). Layers whose state cannot be cropped (the recurrent state of the
Gated-DeltaNet layers in `qwen3_5`) are copied before every verify forward; after a round with a
rejection they are restored, the attention layers are cropped back to before the block, and the
kept tokens run through the teacher once more. Cost: one extra teacher forward of m+1 tokens per
round with a rejection (roughly doubling the teacher's weight reads when acceptance is low); fully
accepted rounds cost nothing extra; the copy is the fixed-size conv/recurrent state, not the KV.
`SpecResult.rerun_forwards` counts the re-runs.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from dflash_common.errors import ConfigError
from dflash_teacher.teacher import LayerTaps, decoder_layers
from dflash_train.measuring.drafting import Drafted, draft_block, last_feature, probs_from_logits
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.training.model import DFlashDrafter


@dataclass(frozen=True)
class TeacherChoice:
    """How clear the teacher's choice of one new token was, read off the logits it was chosen from."""

    top_logit: float
    """The top-1 logit: the magnitude at which the logits' dtype resolves a difference."""
    margin: float
    """The top-1 minus the top-2 logit (0 at an exact tie; inf for a one-token vocabulary)."""
    runner_up: int
    """The top-2 token (the top-1 itself for a one-token vocabulary)."""


@dataclass
class SpecResult:
    """One generation: the new tokens and what it cost the teacher."""

    tokens: list[int]
    """The new tokens only (no prompt), cut after a stop token or at max_new_tokens."""
    accepted_lengths: list[int] = field(default_factory=list)
    """Per teacher forward after the prefill: tokens that forward produced (accepted drafts + 1).
    Counted before the cut, so `1 + sum(accepted_lengths) - len(tokens)` is what the cut dropped."""
    teacher_forwards: int = 0
    """Teacher forwards after the prefill that produced tokens (verify rounds; decode steps for the
    teacher alone); equals len(accepted_lengths)."""
    seconds: float = 0.0
    """Wall time of the whole generation, prefill included."""
    rerun_forwards: int = 0
    """Extra teacher forwards that rebuilt a non-croppable (recurrent) cache after a rejection."""
    draft_tokens: list[list[int]] = field(default_factory=list)
    """Per verify forward, the drafter's proposals (P = block_size - 1, or block_size for DSpark's
    sample_from_anchor; fewer where the confidence threshold ended a block), for per-position
    acceptance analysis; empty for the teacher alone."""
    teacher_choices: list[TeacherChoice] = field(default_factory=list)
    """The teacher alone: per new token, its top two logits where it was chosen, so a greedy
    output that leaves this one can be told a near-tie flip (dflash_train.measuring.exactness);
    empty for speculative decoding."""
    selector_changed: list[list[bool]] = field(default_factory=list)
    """DFlash2: per verify forward, per draft, whether the selector chose a candidate other than the
    drafter's own top-1 (the draft's index in draft_tokens; accepted when below accepted_lengths - 1)."""
    confidences: list[list[float]] = field(default_factory=list)
    """DSpark with a confidence head: per verify forward, the head's estimate of each verified
    draft's acceptance (given the drafts before it accepted); empty for other drafters."""


def mean_accepted_length(results: Sequence[SpecResult]) -> float:
    """Tokens per verify forward over all results: the "acceptance length" tau of the literature.

    Pooled over rounds (not a mean of per-result means), so long generations weigh more; the
    teacher alone scores exactly 1.
    """
    lengths = [n for result in results for n in result.accepted_lengths]
    if not lengths:
        raise ConfigError("the results hold no verify forwards; generate with max_new_tokens >= 2")
    return sum(lengths) / len(lengths)


def drafts_per_forward(results: Sequence[SpecResult]) -> float:
    """Drafts the teacher verified per verify forward, pooled over results: the block's P without
    a confidence threshold, fewer where one ended blocks early."""
    forwards = sum(result.teacher_forwards for result in results)
    return sum(len(drafts) for result in results for drafts in result.draft_tokens) / max(forwards, 1)


def selector_changes(results: Sequence[SpecResult]) -> dict | None:
    """DFlash2's selector in real decoding, pooled over results: the share of drafts where it chose
    other than the drafter's top-1 (`changed`), the share of those the teacher accepted
    (`changed_accepted`) and of the others (`kept_accepted`); None for other drafters."""
    counts = {"changed": 0, "changed_accepted": 0, "kept": 0, "kept_accepted": 0}
    for result in results:
        for changed, kept in zip(result.selector_changed, result.accepted_lengths):
            for index, flag in enumerate(changed):
                name = "changed" if flag else "kept"
                counts[name] += 1
                counts[name + "_accepted"] += index < kept - 1
    drafts = counts["changed"] + counts["kept"]
    if not drafts:
        return None
    return {"changed": counts["changed"] / drafts, "drafts": drafts,
            "changed_accepted": counts["changed_accepted"] / max(counts["changed"], 1),
            "kept_accepted": counts["kept_accepted"] / max(counts["kept"], 1)}


# ---------------------------------------------------------------------------------------------
# Pure decision functions


def greedy_accept_length(drafts: Tensor, targets: Tensor) -> int:
    """Leading drafts [K] that equal the teacher's argmax after the position before each (targets [K+1])."""
    matches = drafts == targets[: drafts.shape[0]]
    return int(matches.long().cumprod(0).sum())


def rejection_sample(p: Tensor, q: Tensor, drafts: Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling over one block; returns (accepted drafts m, teacher's token).

    p [K+1, V]: the teacher's distribution after block positions 0..K; q [K, V]: the drafter's
    distribution that drafts [K] were sampled from (draft j is position j+1, checked against p[j]).
    Draft j is accepted with probability min(1, p/q); at the first rejection the token comes from
    normalise(max(0, p - q)); after K acceptances a bonus token comes from p[K].
    """
    num_drafts = drafts.shape[0]
    rows = torch.arange(num_drafts, device=drafts.device)
    p_draft, q_draft = p[rows, drafts], q[rows, drafts]
    draws = torch.rand(num_drafts, generator=generator, device=p.device)
    # u < p/q written without the division; a draft always has q > 0 since it was sampled from q.
    accepted = draws * q_draft < p_draft
    m = int(accepted.long().cumprod(0).sum())
    if m == num_drafts:
        dist = p[m]
    else:
        residual = (p[m] - q[m]).clamp(min=0)
        total = residual.sum()
        # A rejection implies q > p somewhere, hence mass in p - q; the guard only catches rounding.
        dist = residual / total if total > 0 else p[m]
    token = int(torch.multinomial(dist, 1, generator=generator))
    return m, token


def accept_drafts(logits: Tensor, drafts: Tensor, q: Tensor | None, cfg: SpecConfig,
                  generator: torch.Generator | None) -> tuple[int, int]:
    """(accepted drafts m, the teacher's next token) of one verify forward's logits [K+1, V]: the
    greedy match against the teacher's argmax when q is None, else rejection sampling against q."""
    if q is None:
        targets = logits.argmax(dim=-1)
        m = greedy_accept_length(drafts, targets)
        return m, int(targets[m])
    p = probs_from_logits(logits, cfg.temperature, cfg.top_p)
    return rejection_sample(p, q, drafts, generator)


def extend_until_stop(tokens: list[int], new: Sequence[int], stop_token_ids: Sequence[int],
                      max_new_tokens: int) -> bool:
    """Append `new` to `tokens` up to a stop token (kept) or max_new_tokens; True when generation is done."""
    for token in new:
        if len(tokens) >= max_new_tokens:
            return True
        tokens.append(int(token))
        if token in stop_token_ids:
            return True
    return len(tokens) >= max_new_tokens


def teacher_choice(logits: Tensor) -> TeacherChoice:
    """The top two of last-position logits [V] (one small topk beside the forward that made them)."""
    values, ids = logits.topk(min(2, logits.shape[-1]))
    if values.shape[0] < 2:
        return TeacherChoice(float(values[0]), math.inf, int(ids[0]))
    top, second = values.tolist()
    return TeacherChoice(top, top - second, int(ids[1]))


def _next_token(logits: Tensor, cfg: SpecConfig, generator: torch.Generator) -> int:
    """The teacher's choice from last-position logits [V]: argmax, or a sample."""
    if cfg.greedy:
        return int(logits.argmax())
    probs = probs_from_logits(logits, cfg.temperature, cfg.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


# ---------------------------------------------------------------------------------------------
# Teacher plumbing


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    """transformers 5 names the cache argument `cache`; earlier versions `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _run(model: torch.nn.Module, ids: Tensor, cache: Any, keyword: str, logits_to_keep: int = 0):
    """One teacher forward on its cache; returns (fp32 logits [S or 1, V], the cache)."""
    kwargs = {keyword: cache} if cache is not None else {}
    out = model(input_ids=ids.unsqueeze(0), use_cache=True, logits_to_keep=logits_to_keep, **kwargs)
    new_cache = out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values
    return out.logits[0].float(), new_cache


def _crop_layer(layer: Any, drop: int) -> None:
    """Drop the last `drop` positions of a croppable cache layer.

    crop(0) still matters for layers that record their past (sliding windows): it trims them back
    to their working size. Elsewhere it is skipped, since transformers 4 read crop(0) as "keep 0".
    """
    if drop > 0 or getattr(layer, "record_past", False):
        layer.crop(-drop)


def _restored_whole(layer: Any) -> bool:
    """Whether a cache layer is copied and restored rather than cropped: one that cannot crop, and
    a recurrent (linear-attention) one. transformers >= 5.2x can crop those too, from a history of
    intermediate recurrent states it keeps when asked, but a restore and re-run gives the same
    state on every version."""
    return not getattr(layer, "is_croppable", True) or hasattr(layer, "recurrent_states")


class _CacheRollback:
    """Puts the teacher's cache back to the kept positions after a verify forward.

    Croppable layers are cropped. Non-croppable ones (recurrent state) are snapshotted before each
    verify and restored after a rejection, after which the caller re-runs the kept tokens.
    """

    def __init__(self, cache: Any):
        self.cache = cache
        layers = getattr(cache, "layers", None)
        if layers is None:
            raise ConfigError(
                f"the teacher's cache {type(cache).__name__} has no per-layer list; use a transformers "
                "model whose cache is a DynamicCache (transformers >= 4.56)")
        self.fixed = [i for i, layer in enumerate(layers) if _restored_whole(layer)]
        self.croppable = [layer for i, layer in enumerate(layers) if i not in self.fixed]
        for layer in self.croppable:
            # Sliding-window (and conv-only) layers drop old states on update unless told to keep
            # them until the next crop; done after the prefill so the prompt is not kept whole.
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        self.snapshots: list[Any] = []

    def before_verify(self) -> None:
        self.snapshots = [copy.deepcopy(self.cache.layers[i]) for i in self.fixed]

    def rollback(self, verified: int, kept: int) -> bool:
        """Keep the first `kept` of the `verified` positions; True when the caller must re-run them."""
        drop = verified - kept
        if not self.fixed or drop == 0:
            # Everything croppable, or every position kept (a full block leaves recurrent state right).
            for layer in self.croppable:
                _crop_layer(layer, drop)
            return False
        for layer in self.croppable:
            _crop_layer(layer, verified)
        for index, snapshot in zip(self.fixed, self.snapshots):
            self.cache.layers[index] = snapshot
        self.snapshots = []
        return True

    def after_rerun(self) -> None:
        for layer in self.croppable:
            _crop_layer(layer, 0)


def _input_device(model: torch.nn.Module) -> torch.device:
    """Where token ids go in: the embedding's device (the first GPU of a device_map)."""
    return model.get_input_embeddings().weight.device


def _output_device(model: torch.nn.Module) -> torch.device:
    """Where logits come out, and so where the sampler and its generator live: the LM head's
    device (the last GPU of a device_map)."""
    return model.get_output_embeddings().weight.device


def _check_prompt(teacher: torch.nn.Module, prompt_ids: Sequence[int]) -> int:
    """Vocabulary size of the teacher, after checking the prompt fits it."""
    vocab = int(teacher.get_output_embeddings().weight.shape[0])
    if len(prompt_ids) == 0:
        raise ConfigError("prompt_ids is empty; pass at least one token (e.g. a BOS or chat prefix)")
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
    if bad:
        raise ConfigError(f"prompt token id {bad[0]} is outside the teacher's vocabulary [0, {vocab}); "
                          "tokenize with the teacher's tokenizer")
    return vocab


def _context_of(drafter: DFlashDrafter, hidden: Tensor, start: int) -> tuple[list[tuple[Tensor, Tensor]], Tensor | None]:
    """(the per-layer context keys/values of tapped states hidden [1, T, n_layers, H] at positions
    start.., the last one's normed feature: LiLiCorr's anchor, None for the other kinds)."""
    return drafter.context_kv(hidden, start=start), last_feature(drafter, hidden)


def _append_context(context: list[tuple[Tensor, Tensor]],
                    new: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """Per-layer context keys/values [N, kv_heads, S, D] with the new positions' appended."""
    return [(torch.cat((k, nk), dim=2), torch.cat((v, nv), dim=2)) for (k, v), (nk, nv) in zip(context, new)]


def check_confidence_threshold(drafter_cfg: DrafterConfig, threshold: float) -> None:
    """Refuse a confidence threshold for a drafter without a confidence head: it would be ignored,
    and a measurement taken with it would silently be one without it."""
    if threshold > 0 and (drafter_cfg.dspark is None or not drafter_cfg.dspark.enable_confidence_head):
        kind = ("this DSpark drafter (dspark.enable_confidence_head off)" if drafter_cfg.dspark is not None
                else "a LiLiCorr drafter" if drafter_cfg.lilicorr is not None
                else "a DFlash2 drafter" if drafter_cfg.dflash2 is not None else "a DFlash drafter")
        raise ConfigError(f"confidence threshold {threshold:g} needs a confidence head, which {kind} has none of; "
                          "drop the threshold (or set it to 0), or train with --model-kind dspark")


def _check_inputs(teacher: torch.nn.Module, drafter: DFlashDrafter, prompt_ids: Sequence[int], cfg: SpecConfig) -> None:
    """Refuse a prompt, a teacher-drafter pair or a confidence threshold that cannot decode, in one line."""
    vocab = _check_prompt(teacher, prompt_ids)
    if vocab != drafter.cfg.vocab_size:
        raise ConfigError(f"the teacher's vocabulary has {vocab} rows, the drafter expects "
                          f"{drafter.cfg.vocab_size}; use the drafter trained for this teacher")
    num_layers = len(decoder_layers(teacher))
    if max(drafter.cfg.target_layer_ids) >= num_layers:
        raise ConfigError(f"drafter taps layers {list(drafter.cfg.target_layer_ids)} but the teacher has "
                          f"{num_layers}; use the drafter trained for this teacher")
    check_confidence_threshold(drafter.cfg, cfg.confidence_threshold)


# ---------------------------------------------------------------------------------------------
# Generation


def teacher_generate(teacher: torch.nn.Module, prompt_ids: Sequence[int], cfg: SpecConfig) -> SpecResult:
    """The teacher alone, one token per forward on its own KV cache (the reference output)."""
    _check_prompt(teacher, prompt_ids)
    device = _input_device(teacher)
    generator = torch.Generator(device=_output_device(teacher)).manual_seed(cfg.seed)
    keyword = _cache_keyword(type(teacher))
    start = time.perf_counter()
    with torch.inference_mode():
        logits, cache = _run(teacher, torch.tensor(list(prompt_ids), device=device), None, keyword, 1)
        tokens: list[int] = []
        choices: list[TeacherChoice] = []
        forwards = 0
        while True:
            # one token a step (max_new_tokens >= 1 and a step is only taken while below it), so
            # choices[i] is token i's
            choices.append(teacher_choice(logits[-1]))
            if extend_until_stop(tokens, [_next_token(logits[-1], cfg, generator)], cfg.stop_token_ids,
                                 cfg.max_new_tokens):
                break
            logits, cache = _run(teacher, torch.tensor([tokens[-1]], device=device), cache, keyword, 1)
            forwards += 1
    return SpecResult(tokens=tokens, accepted_lengths=[1] * forwards, teacher_forwards=forwards,
                      seconds=time.perf_counter() - start, teacher_choices=choices)


def speculative_generate(teacher: torch.nn.Module, drafter: DFlashDrafter, prompt_ids: Sequence[int],
                         cfg: SpecConfig) -> SpecResult:
    """Generate with DFlash block speculative decoding (see the module docstring for the rounds).

    The teacher must be in eval mode (no dropout) for greedy output to equal its own greedy output.
    Every verify forward runs a full block, also in the last round, as the reference decoder does
    (unless the confidence threshold ended the block early).
    """
    _check_inputs(teacher, drafter, prompt_ids, cfg)
    device, logits_device = _input_device(teacher), _output_device(teacher)
    drafter_device = drafter.fc.weight.device
    generator = torch.Generator(device=logits_device).manual_seed(cfg.seed)
    keyword = _cache_keyword(type(teacher))
    mask_block = torch.full((drafter.cfg.block_size - 1,), drafter.cfg.mask_token_id, dtype=torch.long,
                            device=drafter_device)

    start = time.perf_counter()
    result = SpecResult(tokens=[])
    tokens = result.tokens
    with torch.inference_mode(), LayerTaps(teacher, drafter.cfg.target_layer_ids) as taps:
        prompt = torch.tensor(list(prompt_ids), device=device)
        logits, cache = _run(teacher, prompt, None, keyword, 1)
        rollback = _CacheRollback(cache)
        context, context_anchor = _context_of(drafter, taps.take().to(drafter_device), 0)
        position = len(prompt_ids)  # of the anchor, whose features come with the next verify
        anchor = _next_token(logits[-1], cfg, generator)
        done = extend_until_stop(tokens, [anchor], cfg.stop_token_ids, cfg.max_new_tokens)

        while not done:
            drafted = draft_block(drafter, anchor, mask_block, context, cfg, generator, logits_device, context_anchor)
            drafts = drafted.drafts

            verify_ids = torch.cat((torch.tensor([anchor], device=device), drafts.to(device)))
            rollback.before_verify()
            logits, cache = _run(teacher, verify_ids, cache, keyword)
            hidden = taps.take()
            m, anchor = accept_drafts(logits, drafts, drafted.q, cfg, generator)
            kept = m + 1
            _record_round(result, drafted, kept, drafter.confidence_head is not None)
            done = extend_until_stop(tokens, drafts[:m].tolist() + [anchor], cfg.stop_token_ids, cfg.max_new_tokens)
            if done:
                break  # nothing after this round is needed: skip the rollback and context update

            if rollback.rollback(verified=verify_ids.shape[0], kept=kept):
                _, cache = _run(teacher, verify_ids[:kept], cache, keyword, 1)
                taps.take()  # the verify forward already gave these positions' features
                rollback.after_rerun()
                result.rerun_forwards += 1
            new, context_anchor = _context_of(drafter, hidden[:, :kept].to(drafter_device), position)
            context = _append_context(context, new)
            position += kept

    result.teacher_forwards, result.seconds = len(result.accepted_lengths), time.perf_counter() - start
    return result


def _record_round(result: SpecResult, drafted: Drafted, kept: int, has_confidence: bool) -> None:
    """One verify round's numbers added to the result: tokens kept, drafts, the walk's changes,
    the confidence head's estimates (every round where there is a head, so confidences[i] is
    accepted_lengths[i]'s even when a threshold left a round without drafts)."""
    result.accepted_lengths.append(kept)
    result.draft_tokens.append(drafted.drafts.tolist())
    if drafted.changed:
        result.selector_changed.append(drafted.changed)
    if has_confidence:
        result.confidences.append(drafted.confidences)
