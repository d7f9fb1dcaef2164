"""What a sweep with seeds measures beyond its final numbers.

A sweep with ``measure`` set (see MeasureConfig; ``--preset recipe`` sets it) keeps a checkpoint
at evenly spaced steps of every run, evaluates each on the held-out split after the run
(``measure_run``: held-out tau against the training tokens seen, from the run's own epoch plan),
and decodes held-out prompts greedily with the real teacher and the exported drafter, checking
that the output equals the teacher's own greedy output (computed once per sweep:
``reference_outputs``). Each run's measurements go to ``runs/<name>/measure.json``, which
dflash_train.sweep.recipe summarizes.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from dflash_common.errors import ConfigError
from dflash_common.files import write_file_atomic
from dflash_common.settings_files import MANIFEST_BYTES, load_settings_file
from dflash_train.measuring.summary_statistics import tokens_by_step
from dflash_train.settings.measure_config import MeasureConfig

MEASURE_FILE = "measure.json"
"""A run's curve and decoding measurements, in its folder."""

REFERENCE_FILE = "teacher_outputs.json"
"""The teacher's own greedy outputs for the sweep's prompts, in the sweep folder."""




def _spec(tokenizer, max_new_tokens: int, temperature: float = 0.0, seed: int = 0, confidence_threshold: float = 0.0):
    from dflash_teacher.chat_template import stop_token_ids
    from dflash_train.settings.spec_config import SpecConfig

    return SpecConfig(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop_token_ids(tokenizer),
                      seed=seed, confidence_threshold=confidence_threshold)


def reference_outputs(measure: MeasureConfig, sweep_dir: str | Path, template_kwargs: dict | None) -> dict:
    """The teacher's own greedy outputs for the prompts, computed once per sweep and kept in
    REFERENCE_FILE (recomputed when the teacher, prompts or lengths differ)."""
    from dflash_teacher.teacher import TeacherConfig, load_teacher
    from dflash_train.measuring.decode_report import read_prompts
    from dflash_train.measuring.speculative import teacher_generate

    path = Path(sweep_dir) / REFERENCE_FILE
    key = {"teacher": str(Path(measure.teacher).resolve()), "prompts": [str(Path(p).resolve()) for p in measure.prompts],
           "max_prompts": measure.max_prompts, "max_new_tokens": measure.max_new_tokens,
           "chat_template_kwargs": template_kwargs}
    if path.exists():
        saved = read_reference(path)
        if saved.get("key") == key:
            return saved
    teacher = load_teacher(TeacherConfig(name_or_path=measure.teacher, dtype="float32", device="cpu", top_k=1))
    prompts = read_prompts(measure.prompts, teacher.tokenizer, measure.max_prompts, template_kwargs)
    spec = _spec(teacher.tokenizer, measure.max_new_tokens)
    record = {"key": key, "prompts": [{"id": p.id, "category": p.category, "ids": p.ids,
                                       "output": teacher_generate(teacher.model, p.ids, spec).tokens} for p in prompts]}
    write_file_atomic(path, (json.dumps(record) + "\n").encode(), Path(sweep_dir))
    return record


def read_reference(path: Path) -> dict:
    """A sweep's REFERENCE_FILE, read with a bound ({} when it is not ours: it is computed again)."""
    try:
        saved = load_settings_file(str(path), limit=MANIFEST_BYTES)
    except ConfigError:
        return {}
    return saved if isinstance(saved, dict) else {}


@functools.lru_cache(maxsize=2)
def _teacher(path: str, device: str):
    # a serial sweep decodes every run with the same teacher: load it once per process
    from dflash_teacher.teacher import TeacherConfig, load_teacher

    return load_teacher(TeacherConfig(name_or_path=path, dtype="float32", device=device, top_k=1))


def decode_heldout(drafter_dir: str | Path, measure: MeasureConfig, reference: dict, device: str,
                   temperature: float = 0.0, seed: int = 0, confidence_threshold: float = 0.0) -> dict:
    """Speculative decoding of the reference prompts, greedy (temperature 0) or sampled, a DSpark
    block cut by its confidence head when `confidence_threshold` > 0: the accepted length, the
    drafts verified per forward, DFlash2's selector_changes and, greedy, whether every output
    equals the teacher's own."""
    from dflash_train.measuring.replay import load_trained_drafter
    from dflash_train.measuring.speculative import (
        drafts_per_forward,
        mean_accepted_length,
        selector_changes,
        speculative_generate,
    )

    teacher = _teacher(str(Path(measure.teacher).resolve()), device)
    head = teacher.model
    drafter = load_trained_drafter(str(drafter_dir), head.get_input_embeddings().weight.detach(),
                                   head.get_output_embeddings().weight.detach(), teacher.device)
    teacher.layer_ids = list(drafter.cfg.target_layer_ids)
    spec = _spec(teacher.tokenizer, measure.max_new_tokens, temperature, seed, confidence_threshold)
    results, matched = [], []
    for prompt in reference["prompts"]:
        result = speculative_generate(teacher.model, drafter, prompt["ids"], spec)
        results.append(result)
        matched.append(result.tokens == prompt["output"] or not spec.greedy)
    lengths = [n for result in results for n in result.accepted_lengths]
    return {"accepted_length": mean_accepted_length(results), "temperature": temperature,
            "confidence_threshold": confidence_threshold, "drafts_per_forward": drafts_per_forward(results),
            # rounds by tokens produced (index n: n tokens): acceptance by block position follows
            "accepted_histogram": [lengths.count(n) for n in range(max(lengths, default=0) + 1)],
            "matched_teacher": all(matched) if spec.greedy else None,
            "prompts": len(results), "mismatched": [p["id"] for p, ok in zip(reference["prompts"], matched) if not ok],
            # per category (the prompt's file or row): accepted tokens over rounds, as accepted_length
            "categories": category_lengths(reference["prompts"], results),
            # DFlash2: how often its selector left the drafter's top-1, and how often that was accepted
            **({"selector": changes} if (changes := selector_changes(results)) else {})}


def category_lengths(prompts: list[dict], results) -> dict[str, float]:
    """The accepted length of each category's prompts (total over rounds, as mean_accepted_length);
    prompts of a reference written before categories count as "prompts"."""
    from dflash_train.measuring.speculative import mean_accepted_length

    groups: dict[str, list] = {}
    for prompt, result in zip(prompts, results):
        groups.setdefault(prompt.get("category") or "prompts", []).append(result)
    return {name: mean_accepted_length(chosen) for name, chosen in groups.items()}


def run_tokens(config, steps: int) -> list[int]:
    """Training tokens after each step of a run, from its epoch plan (what its loader reads)."""
    from dflash_cache import open_cache
    from dflash_train.training.epoch_plan import EpochPlan

    cache = open_cache(config.cache, config.storage_options)
    plan = EpochPlan(cache, config.data)
    per_batch: list[int] = []
    epoch = 0
    while len(per_batch) < steps * config.optim.grad_accum:
        per_batch += [sum(plan.length(s, i) for s, i in batch) for batch in plan.batches(epoch)]
        epoch += 1
    return tokens_by_step(per_batch, config.optim.grad_accum, steps)


def measure_run(config, metrics, measure: MeasureConfig, reference: dict | None, progress=None) -> dict:
    """Evaluate a finished run's kept checkpoints on the held-out split (held-out tau against
    training tokens) and decode the reference prompts with its exported drafter."""
    import torch

    from dflash_cache import open_cache
    from dflash_teacher.teacher import resolve_device
    from dflash_train.measuring.replay import load_drafter_for
    from dflash_train.training.checkpoint import CheckpointManager
    from dflash_train.training.heldout import evaluate_heldout

    device = resolve_device(config.device)
    steps = metrics.last_step
    tokens = run_tokens(config, steps)
    curve = []
    if 0 in metrics.evals:
        curve.append(_point(0, 0, metrics.evals[0]))
    cache = open_cache(config.cache, config.storage_options)
    checkpoints = CheckpointManager(Path(config.out) / "checkpoints").complete()
    if progress:
        progress.message(f"measuring {Path(config.out).name}: {len(checkpoints)} checkpoint(s)"
                         f"{' and real decoding' if reference else ''}")
    for path in checkpoints:
        step = int(path.name.split("-")[1])
        if step == steps and metrics.final_eval:
            record = metrics.final_eval  # the run's own final evaluation: same split, anchors and model
        else:
            model = load_drafter_for(str(path), cache, device, config.data.skip_shards)
            with torch.no_grad():
                record = evaluate_heldout(model, cache, config.data, config.loss, config.eval_sequences, device)
        curve.append(_point(step, tokens[step - 1], record))
    if metrics.final_eval and all(p["step"] != steps for p in curve):
        curve.append(_point(steps, tokens[steps - 1], metrics.final_eval))
    out: dict[str, Any] = {"steps": steps, "tokens": tokens[-1], "curve": sorted(curve, key=lambda p: p["step"])}
    if reference is not None:
        out["decoding"] = decode_heldout(Path(config.out) / "drafter", measure, reference, str(device))
        if measure.sample_temperature > 0:
            out["sampling"] = decode_heldout(Path(config.out) / "drafter", measure, reference, str(device),
                                             measure.sample_temperature, config.seed)
    return out


def _point(step: int, tokens: int, record: dict) -> dict:
    return {"step": step, "tokens": tokens, "tau": record.get("tau"), "tau_greedy": record.get("tau_greedy"),
            "loss": record.get("loss")}


def read_measure(run_dir: str | Path) -> dict | None:
    path = Path(run_dir) / MEASURE_FILE
    if not path.exists():
        return None
    try:
        saved = load_settings_file(str(path), limit=MANIFEST_BYTES)
    except ConfigError:
        return None  # not ours (or from before writes were atomic): measured again
    return saved if isinstance(saved, dict) else None


def write_measure(run_dir: str | Path, record: dict) -> None:
    write_file_atomic(Path(run_dir) / MEASURE_FILE, (json.dumps(record, indent=1) + "\n").encode(), Path(run_dir))
