"""Real speculative decoding against the teacher: prompts in, a report of what was accepted out.

Runs each prompt twice, with the teacher alone and with the drafter (dflash_train.measuring.speculative),
checks greedy outputs match, and puts the offline estimate for the same prompts beside the
measured accepted length: the greedy replay of the drafter over the teacher's own output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_cache import SequenceRecord, from_storage
from dflash_common.errors import ConfigError, DFlashError
from dflash_common.settings_files import load_settings_file, read_bounded
from dflash_common.values import text_problem
from dflash_teacher.chat_template import render_chat
from dflash_teacher.teacher import Teacher, TeacherConfig, load_teacher
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
from dflash_train.training.data import collate
from dflash_train.training.model import DFlashDrafter


@dataclass
class Prompt:
    id: str
    ids: list[int]


def prompt_ids(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """A chat's prompt tokens, rendered and tokenized the way the build tokenizes chats."""
    text = render_chat(tokenizer, messages, True, chat_template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


PROMPTS_BYTES = 64 << 20  # a prompts file's bound: ~100,000 long prompts, far more than an eval needs


def read_prompts(path: str, tokenizer, limit: int | None = None,
                 chat_template_kwargs: dict | None = None) -> list[Prompt]:
    """Prompts from JSONL rows with `messages` (system/user turns; trailing assistant turns are
    dropped) or `prompt` (plain text, wrapped as one user turn)."""
    prompts = []
    # bounded: a prompts file linked to /dev/zero, or a corpus passed by mistake, is one line, not all memory
    data = read_bounded(lambda: open(path, "rb"), f"prompts file {path}", PROMPTS_BYTES,
                        fix="pass a prompts file of JSON Lines, one prompt a line (a few thousand make a good eval set)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"prompts file {path} is not UTF-8 text (byte {err.start}); pass a JSON Lines file") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            messages = row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{path} row {number}: expected a JSON object with 'messages' or 'prompt'") from None
        contents = [m.get("content") for m in messages if isinstance(m, dict)] if isinstance(messages, list) else [messages]
        problem = next((text_problem(c) for c in contents if isinstance(c, str) and text_problem(c)), None)
        if problem:
            raise ConfigError(f"{path} row {number}: a prompt {problem}; fix the row")
        while messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        prompts.append(Prompt(id=str(row.get("id", f"prompt-{number}")), ids=prompt_ids(tokenizer, messages, chat_template_kwargs)))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts


def run_config_of(checkpoint: str) -> dict | None:
    """The config.json of the training run a checkpoint (RUN/checkpoints/step-N) or an export
    (RUN/drafter) comes from, or None for a drafter that travelled without its run."""
    folder = Path(checkpoint)
    for candidate in (folder / "config.json", folder.parent / "config.json", folder.parent.parent / "config.json"):
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


def recorded_template_kwargs(checkpoint: str, cache_url: str | None, storage_options: dict | None = None
                             ) -> tuple[dict | None, str | None]:
    """The chat-template kwargs the drafter's cache was built with, and which cache said so:
    --cache, else the cache named in the run's config.json (RUN/drafter or a step folder).
    (None, None) when no cache can be found or opened."""
    from dflash_cache import open_cache

    if cache_url is None:
        run = run_config_of(checkpoint)
        cache_url = run["cache"] if run is not None and isinstance(run.get("cache"), str) else None
    if cache_url is None:
        return None, None
    try:
        cache = open_cache(cache_url, storage_options)
    except DFlashError:
        return None, None
    return cache.chat_template_kwargs, cache_url


def resolve_template_kwargs(checkpoint: str, cache_url: str | None, given: dict | None, allow_mismatch: bool,
                            storage_options: dict | None = None) -> dict | None:
    """The kwargs to render prompts with: the cache's by default; a different --chat-template-kwargs
    only with allow_mismatch, since the drafter learned prompts rendered the cache's way."""
    recorded, source = recorded_template_kwargs(checkpoint, cache_url, storage_options)
    if given is None:
        return recorded
    if source is not None and (given or None) != (recorded or None) and not allow_mismatch:
        raise ConfigError(f"--chat-template-kwargs {json.dumps(given)} differs from {json.dumps(recorded)}, which the "
                          f"cache {source} was built with, so the drafter is measured on prompts it never learned; drop "
                          "the option (the cache's setting is the default) or pass --allow-template-mismatch")
    return given


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
    if progress:
        progress.start(len(prompts), "decoding", "prompt")
    for prompt in prompts:
        base = teacher_generate(teacher.model, prompt.ids, cfg)
        spec = speculative_generate(teacher.model, drafter, prompt.ids, cfg)
        base_results.append(base)
        spec_results.append(spec)
        row = {"id": prompt.id, "prompt_tokens": len(prompt.ids), "new_tokens": len(spec.tokens), "accepted_length": _mean(spec),
               "matched_teacher": spec.tokens == base.tokens}
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
        "offline_accepted_length": produced / max(rounds, 1) if cfg.temperature == 0 else None,
        "per_prompt": rows,
        "teacher_outputs": [r.tokens for r in base_results],
    }
    report["speedup"] = report["tokens_per_second"] / report["teacher_tokens_per_second"]
    changes = selector_changes(spec_results)
    if changes:  # DFlash2: how often the selector left the drafter's top-1, and how often that was accepted
        report["selector"] = changes
    return report


def _mean(result: SpecResult) -> float:
    return sum(result.accepted_lengths) / max(len(result.accepted_lengths), 1)
