"""Real speculative decoding against the teacher: prompts in, a report of what was accepted out.

Runs each prompt twice, with the teacher alone and with the drafter (dflash_train.measuring.speculative),
checks greedy outputs match, and puts the offline estimate for the same prompts beside the
measured accepted length: the greedy replay of the drafter over the teacher's own output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from dflash_cache import SequenceRecord, from_storage
from dflash_common.errors import ConfigError, DFlashError
from dflash_common.settings_files import load_settings_file
from dflash_teacher.chat_template import render_chat
from dflash_teacher.teacher import Teacher, TeacherConfig, load_teacher, tokenizer_hashes
from dflash_train.measuring.exactness import exactness_summary, first_divergence
from dflash_train.measuring.replay import load_trained_drafter, replay_batch, replay_histogram
from dflash_train.measuring.speculative import (
    SpecResult,
    drafts_per_forward,
    mean_accepted_length,
    selector_changes,
    speculative_generate,
    teacher_generate,
)
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.training.batch import collate
from dflash_train.training.model import DFlashDrafter


@dataclass
class Prompt:
    id: str
    ids: list[int]
    category: str = ""
    """The benchmark category (the row's, else its file's name)."""


def prompt_ids(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """A chat's prompt tokens, rendered and tokenized the way the build tokenizes chats."""
    text = render_chat(tokenizer, messages, True, chat_template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def read_prompts(paths: str | Sequence[str], tokenizer, limit: int | None = None,
                 chat_template_kwargs: dict | None = None) -> list[Prompt]:
    """The prompts of one or more prompt files (dflash_train.measuring.prompt_files: our chat JSONL,
    MT-Bench, SPEED-Bench, HumanEval, GSM8K), the first ``limit`` of each, tokenized with the chat template."""
    from dflash_train.measuring.prompt_files import read_prompt_files

    return tokenize_prompts(read_prompt_files([paths] if isinstance(paths, str) else list(paths), limit), tokenizer,
                            chat_template_kwargs)


def tokenize_prompts(rows, tokenizer, chat_template_kwargs: dict | None = None) -> list[Prompt]:
    """PromptRows (prompt_files) as Prompts: rendered with the chat template and tokenized."""
    return [Prompt(id=r.id, ids=prompt_ids(tokenizer, list(r.messages), chat_template_kwargs), category=r.category)
            for r in rows]


def run_config_of(checkpoint: str) -> dict | None:
    """The config.json of the training run a checkpoint (RUN/checkpoints/step-N) or an export
    (RUN/drafter) comes from, or None for a drafter that travelled without its run."""
    folder = Path(checkpoint)
    for candidate in (folder / "config.json", folder.parent / "config.json", folder.parent.parent / "config.json"):
        if candidate.is_symlink() or not candidate.is_file():  # a link out of the run, or a FIFO, is not its config
            continue
        try:
            values = load_settings_file(str(candidate))
        except (OSError, DFlashError):
            continue
        if isinstance(values, dict) and "optim" in values and isinstance(values.get("data"), dict):
            return values
    return None


def run_heldout_fraction(checkpoint: str, given: float | None) -> float:
    """The held-out fraction to evaluate with: the one given, else the run's, else the default.
    Evaluating with another fraction than training used would score sequences it trained on."""
    from dflash_train.settings.data_config import DataConfig

    if given is not None:
        return given
    run = run_config_of(checkpoint)
    fraction = run["data"].get("heldout_fraction") if run is not None else None
    return float(fraction) if isinstance(fraction, (int, float)) else DataConfig().heldout_fraction


@dataclass(frozen=True)
class CacheTemplate:
    """How the drafter's cache rendered its chats: what eval and generate render prompts with by default."""

    kwargs: dict | None = None
    """The chat-template kwargs the cache was built with (None: none)."""
    template_hash: str | None = None
    """The hash of the teacher's chat template the build rendered with (its manifest's tokenizer record)."""
    source: str | None = None
    """The cache that said so (None: no cache found; nothing is checked)."""


def cache_template(checkpoint: str, cache_url: str | None, storage_options: dict | None = None) -> CacheTemplate:
    """The drafter's cache's template settings: --cache, else the cache named in the run's
    config.json (RUN/drafter or a step folder); empty when no cache can be found or opened."""
    from dflash_cache import open_cache

    if cache_url is None:
        run = run_config_of(checkpoint)
        cache_url = run["cache"] if run is not None and isinstance(run.get("cache"), str) else None
    if cache_url is None:
        return CacheTemplate()
    try:
        cache = open_cache(cache_url, storage_options)
    except DFlashError:
        return CacheTemplate()
    tokenizer = cache.manifest.get("tokenizer")
    template_hash = tokenizer.get("chat_template_hash") if isinstance(tokenizer, dict) else None
    return CacheTemplate(cache.chat_template_kwargs, template_hash if isinstance(template_hash, str) else None, cache_url)


def recorded_template_kwargs(checkpoint: str, cache_url: str | None, storage_options: dict | None = None
                             ) -> tuple[dict | None, str | None]:
    """The chat-template kwargs the drafter's cache was built with, and which cache said so
    ((None, None) when no cache can be found or opened)."""
    recorded = cache_template(checkpoint, cache_url, storage_options)
    return recorded.kwargs, recorded.source


def choose_template_kwargs(recorded: CacheTemplate, given: dict | None, allow_mismatch: bool) -> dict | None:
    """The kwargs to render prompts with: the cache's by default; a different --chat-template-kwargs
    only with allow_mismatch, since the drafter learned prompts rendered the cache's way."""
    if given is None:
        return recorded.kwargs
    if recorded.source is not None and (given or None) != (recorded.kwargs or None) and not allow_mismatch:
        raise ConfigError(f"--chat-template-kwargs {json.dumps(given)} differs from {json.dumps(recorded.kwargs)}, which "
                          f"the cache {recorded.source} was built with, so the drafter is measured on prompts it never "
                          "learned; drop the option (the cache's setting is the default) or pass --allow-template-mismatch")
    return given


def resolve_template_kwargs(checkpoint: str, cache_url: str | None, given: dict | None, allow_mismatch: bool,
                            storage_options: dict | None = None) -> dict | None:
    """choose_template_kwargs with the drafter's cache found as cache_template finds it."""
    return choose_template_kwargs(cache_template(checkpoint, cache_url, storage_options), given, allow_mismatch)


def template_warnings(recorded: CacheTemplate, used: dict | None, teacher_template_hash: str | None) -> list[str]:
    """One line per way the prompts are rendered otherwise than the cache's chats were (pure):
    other kwargs (given with --allow-template-mismatch), another chat template in the teacher's folder."""
    if recorded.source is None:
        return []
    out = []
    if (used or None) != (recorded.kwargs or None):
        out.append(f"warning: prompts rendered with chat-template kwargs {json.dumps(used)}, the cache {recorded.source} "
                   f"with {json.dumps(recorded.kwargs)}: the drafter is measured on prompts rendered otherwise than it "
                   "learned (expect lower acceptance)")
    if recorded.template_hash and teacher_template_hash and recorded.template_hash != teacher_template_hash:
        out.append(f"warning: the teacher's chat template (hash {teacher_template_hash}) is not the one the cache "
                   f"{recorded.source} was built with ({recorded.template_hash}): the drafter is measured on prompts "
                   "rendered otherwise than it learned; pass the teacher the cache was built from")
    return out


def chat_template_hash(tokenizer) -> str:
    """The hash a build records of a tokenizer's chat template (its manifest's tokenizer.chat_template_hash)."""
    return tokenizer_hashes(tokenizer)["chat_template_hash"]


def load_pair(checkpoint: str, teacher_path: str, dtype: str, device: str,
              trust_remote_code: bool = False) -> tuple[Teacher, DFlashDrafter]:
    """The teacher (tapping the drafter's layers) and the trained drafter with the teacher's head."""
    teacher = load_teacher(TeacherConfig(name_or_path=teacher_path, dtype=dtype, device=device, top_k=1,
                                         trust_remote_code=trust_remote_code))
    model = teacher.model
    drafter = load_trained_drafter(checkpoint, model.get_input_embeddings().weight.detach(),
                                   model.get_output_embeddings().weight.detach(), teacher.device)
    teacher.layer_ids = list(drafter.cfg.target_layer_ids)
    return teacher, drafter


@torch.no_grad()
def offline_estimate(teacher: Teacher, drafter: DFlashDrafter, prompt: Prompt, output: list[int]) -> tuple[int, int]:
    """Greedy replay of the drafter over prompt + the teacher's output, from the teacher's features."""
    seq = np.array(prompt.ids + output, dtype=np.int32)
    out = teacher.forward([seq])
    hidden = np.asarray(from_storage(out.hidden, teacher.cfg.dtype), dtype=np.float32)
    mask = np.zeros(len(seq), dtype=np.uint8)
    mask[len(prompt.ids):] = 1
    record = SequenceRecord(id=prompt.id, input_ids=seq, loss_mask=mask, hidden=hidden,
                            topk_ids=out.topk_ids, topk_logprobs=out.topk_logprobs)
    return replay_record(drafter, record, teacher.device)


def replay_record(drafter: DFlashDrafter, record: SequenceRecord, device) -> tuple[int, int]:
    """The greedy replay (replay_batch) of one sequence: (tokens produced, rounds)."""
    batch = collate([record], [np.zeros(0, np.int64)], [record.hidden]).to(device)
    # sized by the drafter's drafts per block: a DSpark drafter drafts block_size tokens, and a
    # histogram of block_size + 1 had no slot for its whole accepted block (an IndexError)
    return replay_batch(drafter, batch, replay_histogram(drafter.cfg))


def offline_accepted_length(teacher: Teacher, drafter: DFlashDrafter, prompts: list[Prompt],
                            outputs: list[list[int]]) -> float:
    """The greedy replay's accepted length over prompts and the teacher's greedy outputs for them."""
    produced = rounds = 0
    for prompt, output in zip(prompts, outputs):
        p, r = offline_estimate(teacher, drafter, prompt, output)
        produced, rounds = produced + p, rounds + r
    return produced / max(rounds, 1)


def decode_report(teacher: Teacher, drafter: DFlashDrafter, prompts: list[Prompt], cfg: SpecConfig,
                  progress=None) -> dict:
    """Teacher alone vs speculative decoding on each prompt, plus the offline estimate."""
    rows, spec_results, base_results = [], [], []
    produced = rounds = 0
    logits_dtype = teacher.model.get_output_embeddings().weight.dtype  # what the teacher's logits are rounded to
    if progress:
        progress.start(len(prompts), "decoding", "prompt")
    for prompt in prompts:
        base = teacher_generate(teacher.model, prompt.ids, cfg)
        spec = speculative_generate(teacher.model, drafter, prompt.ids, cfg)
        base_results.append(base)
        spec_results.append(spec)
        row = _prompt_row(prompt, spec, base, cfg, logits_dtype)
        if cfg.temperature == 0:
            p, r = offline_estimate(teacher, drafter, prompt, base.tokens)
            produced, rounds = produced + p, rounds + r
            row["offline_accepted_length"] = p / max(r, 1)
        rows.append(row)
        if progress:
            progress.advance(1)
    if progress:
        progress.close()
    spec_tokens, base_tokens = sum(len(r.tokens) for r in spec_results), sum(len(r.tokens) for r in base_results)
    forwards, base_forwards = sum(r.teacher_forwards for r in spec_results), sum(r.teacher_forwards for r in base_results)
    report = {
        "mode": "greedy" if cfg.temperature == 0 else f"sampling (temperature {cfg.temperature}, top_p {cfg.top_p})",
        "temperature": cfg.temperature,
        "prompts": len(prompts),
        "block_size": drafter.cfg.block_size,
        "confidence_threshold": cfg.confidence_threshold,
        "accepted_length": mean_accepted_length(spec_results),
        # what the drafter saves: the teacher's forwards after the prefill, alone vs verifying
        "teacher_forwards": forwards,
        "teacher_alone_forwards": base_forwards,
        "teacher_forwards_saved": base_forwards - forwards,
        # what a confidence threshold saves: drafts the teacher verifies per forward (P without one)
        "drafts_per_forward": drafts_per_forward(spec_results),
        # tokens kept per verify forward: the last round of an answer counts only up to its stop
        # token, as the offline replay does (accepted_length counts that round before the cut)
        "kept_per_forward": sum(len(r.tokens) - 1 for r in spec_results) / max(sum(r.teacher_forwards for r in spec_results), 1),
        "tokens_per_second": spec_tokens / sum(r.seconds for r in spec_results),
        "teacher_tokens_per_second": base_tokens / sum(r.seconds for r in base_results),
        "matched_teacher": all(r["matched_teacher"] for r in rows) if cfg.temperature == 0 else None,
        # beside the exact verdict: how many outputs left the teacher's at a near tie, how many not
        "exactness": exactness_summary([r["divergence"] for r in rows], logits_dtype) if cfg.temperature == 0 else None,
        "offline_accepted_length": produced / max(rounds, 1) if cfg.temperature == 0 else None,
        "per_prompt": rows,
        "teacher_outputs": [r.tokens for r in base_results],
    }
    report["speedup"] = report["tokens_per_second"] / report["teacher_tokens_per_second"]
    changes = selector_changes(spec_results)
    if changes:  # DFlash2: how often the selector left the drafter's top-1, and how often that was accepted
        report["selector"] = changes
    report.update(acceptance_parts(spec_results, drafter.cfg.num_draft_positions))
    return report


def acceptance_parts(results: list[SpecResult], draft_positions: int) -> dict:
    """The report's accepted length by its three definitions with the per-request histogram
    (measuring.acceptance), and with a confidence head its calibration against the drafts the
    teacher accepted (training.calibration)."""
    from dflash_train.measuring.acceptance import acceptance_summary, counts_of, step_observations
    from dflash_train.training.calibration import observation_summary

    out = {"num_speculative_tokens": draft_positions,
           "acceptance": acceptance_summary([counts_of(r.accepted_lengths) for r in results], draft_positions + 1)}
    if any(r.confidences for r in results):
        seen = [o for r in results for estimates, kept in zip(r.confidences, r.accepted_lengths)
                for o in step_observations(estimates, kept - 1)]
        out["calibration"] = observation_summary([o[0] for o in seen], [o[1] for o in seen], [o[2] for o in seen],
                                                 draft_positions)
    return out


def _prompt_row(prompt: Prompt, spec: SpecResult, base: SpecResult, cfg: SpecConfig, logits_dtype: torch.dtype) -> dict:
    """One prompt's row of the report; greedy, where its output first left the teacher's
    (`divergence`, exactness.first_divergence; None when equal or when sampling)."""
    return {"id": prompt.id, "category": prompt.category, "prompt_tokens": len(prompt.ids),
            "new_tokens": len(spec.tokens), "accepted_length": _mean(spec), "verify_forwards": len(spec.accepted_lengths),
            "accepted_drafts": sum(spec.accepted_lengths) - len(spec.accepted_lengths),
            "seconds": spec.seconds,
            "teacher_new_tokens": len(base.tokens), "teacher_seconds": base.seconds,
            "matched_teacher": spec.tokens == base.tokens,
            "divergence": first_divergence(spec.tokens, base.tokens, base.teacher_choices, logits_dtype)
            if cfg.temperature == 0 else None}


def _mean(result: SpecResult) -> float:
    return sum(result.accepted_lengths) / max(len(result.accepted_lengths), 1)
