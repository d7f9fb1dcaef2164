"""`dflash-train eval` and `generate` carried out: a drafter measured offline on a cache's held-out
split and/or decoding with its teacher (the built-in decoder, vLLM or both), and answers
generated with it. The commands only parse their options (dflash_train.settings.eval_config) and
print what these return."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dflash_common.errors import ConfigError
from dflash_common.files import disk_full_stops, refuse_links, write_file_atomic
from dflash_common.knobs import make_config
from dflash_train.settings.eval_config import DecodingConfig, EvalConfig, GenerateConfig

Lines = list[tuple[str, str]]


@dataclass
class EvalResult:
    """What an evaluation wrote and what to print."""

    report: dict
    """The JSON report (written to ``path``)."""
    lines: Lines
    """The table of results: (what, value)."""
    path: Path
    """Where the report went; with an offline part, a PNG of acceptance by position beside it."""

    @property
    def matched(self) -> bool:
        """Whether every greedy decoding (built-in and vLLM) produced the teacher's own output."""
        decodings = self.report.get("decodings", [self.report.get("decoding", {})])
        return not (any(d.get("matched_teacher") is False for d in decodings)
                    or self.report.get("vllm", {}).get("matched_teacher") is False)

    @property
    def lossless(self) -> bool:
        """Whether every greedy output of the built-in decoder equals the teacher's or leaves it only
        at near-tie flips (dflash_train.measuring.exactness), and vLLM's equals its teacher alone:
        what eval fails without. A flip at a near tie is rounding (bf16's block and one-token
        forwards), not a decoding error, and is named in the report instead."""
        decodings = self.report.get("decodings", [self.report.get("decoding", {})])
        return not (any(d.get("matched_teacher") is False and (d.get("exactness") or {}).get("mismatches", 1) > 0
                        for d in decodings)
                    or self.report.get("vllm", {}).get("matched_teacher") is False)


def eval_config(values: dict) -> EvalConfig:
    """An EvalConfig from nested option values; the held-out fraction, when not given, is the
    training run's (another fraction would score sequences the drafter trained on)."""
    from dflash_train.measuring.decode_report import run_heldout_fraction

    data = values.get("data", {})
    if data.get("heldout_fraction") is None:
        checkpoint = values.get("decoding", {}).get("checkpoint", "")
        values = {**values, "data": {**data, "heldout_fraction": run_heldout_fraction(checkpoint, None)}}
    return make_config(EvalConfig, values)


def report_path(cfg: EvalConfig) -> Path:
    """Where the report goes, refused before minutes of evaluation whose report would have nowhere
    to go (a folder, a path under a file) or would be written through a link."""
    path = Path(cfg.out) if cfg.out else Path(cfg.decoding.checkpoint) / "eval.json"
    if path.is_dir():
        raise ConfigError(f"--out {path} is a folder; pass the report's file name, e.g. {path / 'eval.json'}")
    if any(parent.exists() and not parent.is_dir() for parent in path.parents):
        raise ConfigError(f"--out {path} lies under a file, not a folder; pass another path")
    for written in (path, path.with_suffix(".png"), path.with_suffix(".vllm.log"), categories_png(path),
                    calibration_png(path)):
        refuse_links(written)
    return path


def categories_png(path: Path) -> Path:
    """The per-category plot beside a report: eval.json -> eval.categories.png."""
    return path.with_suffix(".categories.png")


def calibration_png(path: Path) -> Path:
    """The confidence head's reliability plot beside a report: eval.json -> eval.calibration.png."""
    return path.with_suffix(".calibration.png")


def check_fits_context(teacher, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt plus --max-new-tokens past the teacher's context (its max_position_embeddings),
    checked once the teacher is loaded and before any decoding: positions beyond it were never
    trained, and a billion new tokens would decode for days."""
    from dflash_common.values import is_int

    config = getattr(teacher, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if is_int(limit) and limit > 0 and prompt_tokens + max_new_tokens > limit:
        room = limit - prompt_tokens
        fix = f"pass --max-new-tokens {room:,} or less" if room > 0 else "shorten the prompt: it fills the context alone"
        raise ConfigError(f"--max-new-tokens {max_new_tokens:,} after a prompt of {prompt_tokens:,} tokens runs past the "
                          f"teacher's context of {limit:,} positions (max_position_embeddings); {fix}")


def check_drafter(decoding: DecodingConfig) -> None:
    """What needs only the drafter, checked before minutes of loading the teacher: a confidence
    threshold needs a drafter with a confidence head."""
    from dflash_train.measuring.speculative import check_confidence_threshold

    if decoding.spec.confidence_threshold > 0:
        check_confidence_threshold(drafter_config_of(decoding.checkpoint), decoding.spec.confidence_threshold)


def drafter_config_of(checkpoint: str):
    """The DrafterConfig of a checkpoint folder or an export folder, without a teacher."""
    from dflash_train.settings.drafter_config import DrafterConfig
    from dflash_train.training.checkpoint import COMPLETE, CheckpointManager
    from dflash_train.training.export import read_export_config

    if (Path(checkpoint) / COMPLETE).exists():
        return DrafterConfig.from_hf_config(CheckpointManager.load(checkpoint)["trainer"]["drafter"])
    return read_export_config(checkpoint)


def run_eval(cfg: EvalConfig, progress=None) -> EvalResult:
    """Evaluate as cfg says, write the report (and the PNG of an offline part), return it."""
    from dflash_common.devices import resolve_device

    path = report_path(cfg)
    if cfg.real and cfg.engine != "vllm":
        check_drafter(cfg.decoding)
    dev = resolve_device(cfg.decoding.device)
    report: dict = {"checkpoint": cfg.decoding.checkpoint}
    lines: Lines = []
    if cfg.cache:
        report.update(offline(cfg, dev))
        lines += offline_lines(report)
    if cfg.real:
        from dflash_train.measuring.decode_report import cache_template, choose_template_kwargs

        recorded = cache_template(cfg.decoding.checkpoint, cfg.cache, cfg.storage_options)
        report["chat_template_kwargs"] = choose_template_kwargs(recorded, cfg.decoding.chat_template_kwargs,
                                                                cfg.decoding.allow_template_mismatch)
        real, real_lines = real_decoding(cfg, dev, recorded, report["chat_template_kwargs"],
                                         path.with_suffix(".vllm.log"), progress)
        report["settings"] = {**report.get("settings", {}), **real.pop("settings")}
        report.update(real)
        lines += real_lines
    from dflash_train.measuring.calibration_report import calibration_lines, calibration_sources, plot_reliability

    lines += calibration_lines(report)
    again = "run the same command again (or pass --out a file on another disk)"
    with disk_full_stops(path, "the report was not written (the checkpoint and the cache are only read, nothing of "
                         "them changed)", again):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, (json.dumps(report, indent=1) + "\n").encode())
    plotted = f"the report {path} was written whole; only its plot is missing"
    if cfg.cache:
        from dflash_train.measuring.replay import plot_acceptance

        o = report["offline"]
        with disk_full_stops(path.with_suffix(".png"), plotted, again):
            plot_acceptance({"alpha (sampling)": o["alpha"], "greedy": o["greedy"]}, path.with_suffix(".png"),
                            f"held-out acceptance, tau {o['tau']:.2f}")
    if report.get("categories"):
        from dflash_train.measuring.categories import plot_categories

        with disk_full_stops(categories_png(path), plotted, again):
            plot_categories(report["categories"], categories_png(path), "accepted length by prompt category "
                            "(mean over prompts, 95% interval)")
    if calibration_sources(report):
        with disk_full_stops(calibration_png(path), plotted, again):
            plot_reliability(calibration_sources(report), calibration_png(path), "confidence head: reliability")
    return EvalResult(report, lines, path)


def eval_text(result: EvalResult) -> str:
    """The printout of an evaluation: its table, the acceptance by position, where the report went."""
    text = [f"{k:<40}{v}" for k, v in result.lines]
    offline_part = result.report.get("offline")
    if offline_part:
        text += ["alpha_k  " + " ".join(f"{x:.3f}" for x in offline_part["alpha"]),
                 "greedy_k " + " ".join(f"{x:.3f}" for x in offline_part["greedy"])]
    pngs = ([result.path.with_suffix(".png")] if offline_part else []) + (
        [categories_png(result.path)] if result.report.get("categories") else [])
    from dflash_train.measuring.calibration_report import calibration_sources

    pngs += [calibration_png(result.path)] if calibration_sources(result.report) else []
    if result.report.get("categories"):
        from dflash_train.measuring.categories import category_table, definitions_table, histogram_lines

        rows = result.report["categories"]
        text += ["", "per category: accepted length per teacher forward (the headline: mean over requests ± 95% "
                 "t-interval), speedup in tokens/s", category_table(rows),
                 "", "accepted length by definition: per-request mean, pooled (all accepted over all draft steps), "
                 "token-weighted; share of requests below the floor", definitions_table(rows), ""] + histogram_lines(rows)
    if result.report.get("settings", {}).get("engines") is not None:
        from dflash_train.measuring.report_settings import settings_lines

        text += ["", "settings"] + [f"  {k:<38}{v}" for k, v in settings_lines(result.report["settings"])]
    return "\n".join(text + [f"report: {result.path}" + "".join(f" and {p}" for p in pngs)])


def offline(cfg: EvalConfig, dev) -> dict:
    """The offline part of the report: acceptance and the greedy replay on the held-out split."""
    from dflash_cache import open_cache
    from dflash_train.measuring.replay import greedy_replay, load_drafter_for
    from dflash_train.settings.data_config import RANDOM
    from dflash_train.settings.drafter_config import check_block_tokens
    from dflash_train.settings.loss_config import LossConfig
    from dflash_train.training.heldout import evaluate_heldout

    cache = open_cache(cfg.cache, cfg.storage_options)
    model = load_drafter_for(cfg.decoding.checkpoint, cache, dev, cfg.data.skip_shards)
    if cfg.data.anchors == RANDOM:
        check_block_tokens(model.cfg.block_size, cfg.data.num_anchors)
    from dflash_train.measuring.report_settings import drafter_identity

    return {"cache": cfg.cache, "offline": evaluate_heldout(model, cache, cfg.data, LossConfig(), cfg.max_sequences, dev),
            "greedy_replay": greedy_replay(model, cache, cfg.data, cfg.max_sequences, dev),
            "settings": {"cache": cfg.cache, "heldout_fraction": cfg.data.heldout_fraction,
                         "max_sequences": cfg.max_sequences, "drafter": drafter_identity(model, cfg.decoding.checkpoint)}}


def offline_lines(report: dict) -> Lines:
    o = report["offline"]
    return [("offline tau (sampling estimate)", f"{o['tau']:.3f}"), ("offline tau (greedy streak)", f"{o['tau_greedy']:.3f}"),
            ("offline greedy replay accepted length", f"{report['greedy_replay']['accepted_length']:.3f}"),
            ("held-out loss", f"{o['loss']:.4f}")]


def real_decoding(cfg: EvalConfig, dev, recorded, template_kwargs: dict | None, vllm_log: Path,
                  progress=None) -> tuple[dict, Lines]:
    """Real decoding with the built-in decoder (at each temperature) and/or vLLM (greedy): the
    report parts (with one row per prompt category) and their table lines."""
    from dflash_train.measuring.categories import by_category
    from dflash_train.measuring.decode_report import (
        chat_template_hash,
        decode_report,
        load_pair,
        template_warnings,
        tokenize_prompts,
    )
    from dflash_train.measuring.prompt_files import read_prompt_files
    from dflash_train.measuring.report_settings import drafter_identity, settings_block

    decoding = cfg.decoding
    if cfg.engine != "dflash":
        from dflash_common.vllm_env import find_vllm_python

        find_vllm_python(cfg.vllm_python)  # fail before loading anything
    rows = read_prompt_files(cfg.prompts, cfg.max_prompts)  # a broken file fails before the teacher loads
    dtype = decoding.dtype(dev.type)
    t, drafter = load_pair(decoding.checkpoint, decoding.teacher, dtype, str(dev), decoding.trust_remote_code)
    prompt_list = tokenize_prompts(rows, t.tokenizer, template_kwargs)
    check_fits_context(t.model, max((len(p.ids) for p in prompt_list), default=0), decoding.spec.max_new_tokens)
    specs = decoding.specs(t.stop_token_ids())
    report: dict = {"chat_template_hash": chat_template_hash(t.tokenizer),
                    "warnings": template_warnings(recorded, template_kwargs, chat_template_hash(t.tokenizer))}
    if progress:
        for warning in report["warnings"]:
            progress.message(warning)
    lines: Lines = []
    reference = None
    decodings: list[dict] = []
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompt_list):
        groups.setdefault(prompt.category, []).append(i)
    if cfg.engine in ("dflash", "both"):
        decodings = [decode_report(t, drafter, prompt_list, s, progress) for s in specs]
        report["decoding"] = decodings[0]
        if len(decodings) > 1:
            report["decodings"] = decodings
        reference = next((d["teacher_outputs"] for d, s in zip(decodings, specs) if s.greedy), None)
        lines += decoding_lines(specs, decodings, drafter.cfg.num_draft_positions)
    vllm_groups = None
    identities = (t.identity, drafter_identity(drafter, decoding.checkpoint))  # vLLM's part may release the pair
    block = (drafter.cfg.block_size, drafter.cfg.num_draft_positions)
    if cfg.engine in ("vllm", "both"):
        vllm_groups = vllm_part(cfg, report, lines, t, drafter, prompt_list, next(s for s in specs if s.greedy), dtype,
                                vllm_log, reference, dev, groups)
    report["categories"] = by_category(decodings, vllm_groups)
    report["settings"] = settings_block(cfg, dtype=dtype, device=str(dev), teacher=identities[0], drafter=identities[1],
                                        block_size=block[0], speculative_tokens=block[1], template_kwargs=template_kwargs,
                                        template_hash=report["chat_template_hash"],
                                        vllm_version=report.get("vllm", {}).get("vllm_version"))
    return report, lines


def vllm_part(cfg: EvalConfig, report: dict, lines: Lines, t, drafter, prompt_list, greedy, dtype: str, vllm_log: Path,
              reference, dev, groups: dict[str, list[int]]) -> dict:
    """vLLM's decoding of the prompts (greedy) added to ``report`` and ``lines``; returns its rows
    per category, overall included."""
    from dflash_train.measuring.categories import OVERALL
    from dflash_train.measuring.decode_report import offline_accepted_length

    block_size, alone = drafter.cfg.block_size, "decoding" not in report
    # vLLM asks for 0.9 of the GPU: the teacher (54 GB at 27B) and the drafter (reading the
    # teacher's embedding and head) leave it first, kept in host memory only when the estimate below needs them
    t, drafter = release_for_vllm(t, drafter, dev, keep=alone)
    v = vllm_decoding(cfg, block_size, prompt_list, greedy, dtype, vllm_log, reference, dev, groups)
    if alone:
        from dflash_train.measuring.replay import share_teacher_head

        t.model.to(dev)
        drafter = share_teacher_head(drafter, t.model, dev).to(dev)
    v["offline_accepted_length"] = offline_accepted_length(t, drafter, prompt_list, v["teacher_outputs"]) if alone \
        else report["decoding"]["offline_accepted_length"]
    report["vllm"] = v
    lines += vllm_lines(v, alone=alone)
    return {**v["categories"], OVERALL: {"prompts": len(prompt_list),
                                         **{k: v[k] for k in ("accepted_length", "speedup", "matched_teacher", "acceptance")}}}


def decoding_lines(specs, decodings: list[dict], draft_positions: int) -> Lines:
    """The table lines of the built-in decoder's reports, one block per temperature."""
    from dflash_train.measuring.acceptance import DEFINITIONS

    lines: Lines = []
    for s, d in zip(specs, decodings):
        at = f" (T={s.temperature:g})" if len(specs) > 1 else ""
        a = d["acceptance"]
        lines += [("real decoding" + at, d["mode"]), ("measured accepted length" + at, f"{d['accepted_length']:.3f}"),
                  ("  per-request, pooled, token-weighted", ", ".join(_number(a[k]) for k in DEFINITIONS)),
                  (f"  requests below {a['below_floor']['floor']:g}", f"{a['below_floor']['requests']} of {a['requests']}"),
                  ("  kept per forward (after stop cut)", f"{d['kept_per_forward']:.3f}"),
                  ("  teacher forwards saved" + at, f"{d['teacher_forwards_saved']:,} of {d['teacher_alone_forwards']:,} "
                                                     "(teacher alone)")]
        if s.confidence_threshold:
            lines.append((f"  drafts verified per forward (confidence >= {s.confidence_threshold:g})",
                          f"{d['drafts_per_forward']:.3f} of {draft_positions}"))
        if d.get("selector"):
            c = d["selector"]
            lines.append(("  selector left the top-1" + at, f"{c['changed']:.1%} of drafts, {c['changed_accepted']:.1%} "
                          f"of those accepted ({c['kept_accepted']:.1%} of the others)"))
    r = decodings[0]
    if r["offline_accepted_length"] is not None:
        lines.append(("offline estimate, same prompts", f"{r['offline_accepted_length']:.3f}"))
    lines += [("tokens/s with drafter", f"{r['tokens_per_second']:,.1f}"),
              ("tokens/s teacher alone", f"{r['teacher_tokens_per_second']:,.1f} (speedup {r['speedup']:.2f}x)")]
    greedy_rows = [row for d in decodings if d["matched_teacher"] is not None for row in d["per_prompt"]]
    if greedy_rows:
        from dflash_train.measuring.exactness import exactness_text

        lines.append(("output equals teacher's greedy", exactness_text(greedy_rows)))
    return lines


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def vllm_lines(v: dict, alone: bool) -> Lines:
    """The table lines of vLLM's report; ``alone``: without the built-in decoder's beside it."""
    from dflash_train.measuring.acceptance import DEFINITIONS

    lines = [(f"vLLM {v['vllm_version']} accepted length", f"{v['accepted_length']:.3f} ({v['drafts']:,} draft steps)")]
    if v.get("acceptance"):  # its per-request metrics: the three definitions as ours
        lines.append(("  per-request, pooled, token-weighted", ", ".join(_number(v["acceptance"][k]) for k in DEFINITIONS)))
    if alone:
        lines.append(("offline estimate, same prompts", f"{v['offline_accepted_length']:.3f}"))
    lines += [("vLLM tokens/s with drafter", f"{v['tokens_per_second']:,.1f}"),
              ("vLLM tokens/s teacher alone", f"{v['teacher_tokens_per_second']:,.1f} (speedup {v['speedup']:.2f}x)"),
              ("vLLM output equals vLLM teacher alone", "yes" if v["matched_teacher"] else "NO")]
    if v["matched_transformers"] is not None:
        lines.append(("vLLM teacher equals transformers", "yes" if v["matched_transformers"] else "no"))
    return lines


VLLM_DEFAULT_SHARE = 0.9
"""vLLM's own gpu_memory_utilization default."""
OWN_RESERVE_BYTES = 1 << 30
"""Left free for vLLM's own CUDA context and this process's allocations while vLLM runs."""


def release_for_vllm(teacher, drafter, dev, keep: bool) -> tuple:
    """Free `dev` (a GPU) of the teacher and the drafter before vLLM starts there: moved to host
    memory when `keep` (they are used after vLLM), else dropped (the caller's references are
    replaced by the (None, None) returned); then the CUDA cache allocator returns its blocks. On
    the CPU (vLLM's CPU build sizes its own KV cache) nothing moves."""
    import gc

    import torch

    if dev.type != "cuda":
        return teacher, drafter
    if keep:
        from dflash_train.measuring.replay import share_teacher_head

        teacher.model.to("cpu")
        # the drafter's frozen tensors are the teacher's: re-shared, not copied to the host
        drafter = share_teacher_head(drafter, teacher.model, torch.device("cpu")).to("cpu")
    else:
        teacher = drafter = None
    gc.collect()
    torch.cuda.empty_cache()
    return teacher, drafter


def vllm_memory_share(free: int, total: int, wanted: float = VLLM_DEFAULT_SHARE,
                      reserve: int = OWN_RESERVE_BYTES) -> float:
    """vLLM's gpu_memory_utilization on a GPU this process shares: vLLM refuses to start unless
    that share of the whole GPU is free, so at most what is free now less `reserve`, at most
    `wanted`; one line when almost nothing is free."""
    from dflash_train.measuring.serving import ServingError

    share = min(wanted, (free - reserve) / total)
    if share < 0.05:
        raise ServingError(f"only {free / 2**30:.1f} GiB of the GPU's {total / 2**30:.1f} GiB are free for vLLM after the "
                           "teacher and drafter left it; stop the other processes on this GPU or choose another with "
                           "--device cuda:N")
    return round(share, 4)


def vllm_decoding(cfg: EvalConfig, block_size: int, prompt_list, spec, dtype: str, vllm_log: Path, reference,
                  dev=None, groups: dict[str, list[int]] | None = None) -> dict:
    """vLLM's report for a drafter; a checkpoint folder is exported first (vLLM loads exports only).
    On a GPU `dev`, vLLM runs on that GPU with the share of it that is free (vllm_memory_share)."""
    from dflash_train.measuring.serving import vllm_report
    from dflash_train.settings.vllm_config import VllmConfig
    from dflash_train.training.checkpoint import COMPLETE
    from dflash_train.training.trainer import export_checkpoint

    checkpoint = cfg.decoding.checkpoint
    share = gpus = None
    if dev is not None and dev.type == "cuda":
        import os

        import torch

        from dflash_common.devices import child_devices_of

        share = vllm_memory_share(*torch.cuda.mem_get_info(dev))
        gpus = child_devices_of(dev, os.environ.get("CUDA_VISIBLE_DEVICES"))
    vllm_cfg = VllmConfig(python=cfg.vllm_python, dtype=dtype, log=str(vllm_log), gpu_memory_utilization=share,
                          cuda_visible_devices=gpus)
    with tempfile.TemporaryDirectory(prefix="dflash-export-") as tmp:
        export_dir = export_checkpoint(checkpoint, Path(tmp) / "drafter") if (Path(checkpoint) / COMPLETE).exists() else checkpoint
        return vllm_report(cfg.decoding.teacher, str(export_dir), block_size, [p.ids for p in prompt_list],
                           spec.max_new_tokens, spec.stop_token_ids, vllm_cfg, reference, groups)


@dataclass
class Answer:
    """One generated answer and what it cost."""

    text: str
    """The answer, special tokens left out."""
    summary: str
    """Prompt and answer tokens, teacher forwards, drafts verified per forward, accepted lengths, speed."""


def run_generate(cfg: GenerateConfig) -> list[Answer]:
    """An answer to cfg.prompt per temperature, with speculative decoding."""
    from dflash_common.devices import resolve_device
    from dflash_train.measuring.decode_report import load_pair, prompt_ids, resolve_template_kwargs
    from dflash_train.measuring.speculative import drafts_per_forward, speculative_generate

    decoding = cfg.decoding
    kwargs = resolve_template_kwargs(decoding.checkpoint, None, decoding.chat_template_kwargs, decoding.allow_template_mismatch)
    check_drafter(decoding)
    dev = resolve_device(decoding.device)
    t, drafter = load_pair(decoding.checkpoint, decoding.teacher, decoding.dtype(dev.type), str(dev), decoding.trust_remote_code)
    ids = prompt_ids(t.tokenizer, [{"role": "user", "content": cfg.prompt}], kwargs)
    check_fits_context(t.model, len(ids), decoding.spec.max_new_tokens)
    answers = []
    for spec in decoding.specs(t.stop_token_ids()):
        result = speculative_generate(t.model, drafter, list(ids), spec)
        mean = sum(result.accepted_lengths) / max(len(result.accepted_lengths), 1)
        drafts = drafts_per_forward([result])
        answers.append(Answer(t.tokenizer.decode(result.tokens, skip_special_tokens=True), (
            f"[{len(ids)} prompt tokens, {len(result.tokens)} tokens, {result.teacher_forwards} teacher forwards "
            f"({len(result.tokens) - 1 - result.teacher_forwards} saved), {drafts:.2f} drafts verified per forward, "
            f"accepted length {mean:.2f}, {len(result.tokens) / result.seconds:,.1f} tokens/s; per forward: "
            f"{result.accepted_lengths}]")))
    return answers
