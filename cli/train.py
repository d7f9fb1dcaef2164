"""`dflash-train`: train a DFlash drafter from a cache, and export it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from cli.common import (
    BarProgress,
    ChatTemplateKwargs,
    Debug,
    Quiet,
    StorageOptions,
    TrustRemoteCode,
    json_option,
    knob_options,
    run,
)
from dflash_train.knobs import config_knobs, nested_values, train_knobs
from dflash_train.sweep.plan import sweep_knobs

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Stage 2: train a DFlash drafter from a teacher cache.")

def _train_config(config, resume, knob_values, sets):
    """The run's TrainConfig: a config file (or, on resume, the run's saved config.json), then the
    options given, then --set."""
    from dflash_common.settings_files import load_settings_file
    from dflash_train.config import config_from_dict, merge, read_config_file
    from dflash_train.knobs import option_overrides, set_overrides

    saved = Path(knob_values["out"]) / "config.json"
    base = read_config_file(config) if config else (
        load_settings_file(str(saved), f"the run's saved config {saved}", fix="pass --config, or start a new --out")
        if resume and saved.exists() else {})
    return config_from_dict(merge(merge(base, option_overrides(knob_values)), set_overrides(sets)))


@app.command("run")
@knob_options(train_knobs())
def run_(
    config: Optional[str] = typer.Option(None, help="A .toml or .json train config; options below override it."),
    resume: bool = typer.Option(False, help="Continue from the newest complete checkpoint in --out."),
    resume_from: Optional[str] = typer.Option(None, help="Continue from this step-NNNNNN checkpoint folder instead (e.g. an older one when the newest is damaged)."),
    set_: list[str] = typer.Option([], "--set", help="Any config field: section.key=value (JSON values), e.g. loss.chunk_positions=1024."),
    quiet: Quiet = False,
    debug: Debug = False,
    knob_values: dict = None,
):
    """Train a drafter on a cache; checkpoints, metrics and the exported drafter go to --out."""

    def action():
        from dflash_train.trainer import train

        cfg = _train_config(config, resume or resume_from is not None, knob_values, set_)
        result = train(cfg, resume=resume, progress=BarProgress(enabled=not quiet), resume_from=resume_from)
        if result.before and result.after:
            typer.echo(f"held-out tau: {result.before['tau']:.3f} before -> {result.after['tau']:.3f} after {result.steps} steps")
        typer.echo(f"drafter exported to {result.export_dir}")
        if result.export_dir.exists():
            _echo_serve_commands(result.export_dir)

    run(action, debug, resume_hint="rerun the same command with --resume to continue from the last checkpoint")


@app.command()
def export(
    checkpoint: str = typer.Argument(..., help="A step-NNNNNN checkpoint folder."),
    out_dir: str = typer.Argument(..., help="Folder for config.json and model.safetensors."),
    debug: Debug = False,
):
    """Export a checkpoint's drafter in the format vLLM, SGLang and the reference DFlash code load."""

    def action():
        from dflash_train.trainer import export_checkpoint

        exported = export_checkpoint(checkpoint, out_dir)
        typer.echo(f"drafter exported to {exported}")
        _echo_serve_commands(exported)

    run(action, debug)


def decoding_knobs():
    """The built-in decoder's options that come from SpecConfig's fields (eval and generate)."""
    from dflash_train.settings.speculative import SpecConfig

    return config_knobs(SpecConfig, names=("confidence_threshold",), panel="decoding settings")


def _echo_serve_commands(export_dir) -> None:
    from dflash_train.export import read_export_config
    from dflash_train.serving import serve_commands

    commands = serve_commands(export_dir, read_export_config(export_dir))
    typer.echo("serve it with its teacher (TEACHER: the model the cache was built from):")
    typer.echo(f"  vLLM:   {commands['vllm']}")
    typer.echo(f"  SGLang: {commands['sglang']}")


@app.command("eval")
@knob_options(decoding_knobs())
def eval_(
    checkpoint: str = typer.Option(..., help="A step-NNNNNN checkpoint folder or an exported drafter folder."),
    cache: Optional[str] = typer.Option(None, help="Offline mode: a cache URL; evaluates on its held-out split."),
    teacher: Optional[str] = typer.Option(None, help="Real mode: the teacher (folder or hub name) to decode with."),
    prompts: Optional[str] = typer.Option(None, help="Real mode: JSONL prompts ('messages' without the answer, or 'prompt')."),
    split: str = typer.Option("heldout", help="Offline mode: only 'heldout' (the split training never sees)."),
    heldout_fraction: Optional[float] = typer.Option(None, help="Held-out fraction (default: the training run's, from its config.json)."),
    max_sequences: int = typer.Option(512, help="Offline mode: held-out sequences to evaluate."),
    skip_shards: Optional[str] = typer.Option(None, help="Offline mode: evaluate without these (damaged) shards: NAME[,NAME...]."),
    num_anchors: int = typer.Option(8, help="Offline mode: sampled anchors per sequence."),
    batch_tokens: int = typer.Option(8192, help="Offline mode: sequence tokens per batch."),
    max_prompts: Optional[int] = typer.Option(None, help="Real mode: use the first N prompts."),
    max_new_tokens: int = typer.Option(256, help="Real mode: tokens to generate per prompt."),
    temperature: List[float] = typer.Option([0.0], help="Real mode: 0 = greedy (output must equal the teacher's); > 0 = "
                                            "speculative sampling; repeat to report several, e.g. --temperature 0 --temperature 1."),
    top_p: float = typer.Option(1.0, help="Real mode: nucleus sampling mass."),
    teacher_dtype: str = typer.Option("auto", help="Real mode: teacher dtype; auto = bfloat16 on CUDA, float32 on CPU."),
    engine: str = typer.Option("dflash", help="Real mode: dflash (the built-in decoder), vllm (vLLM's engine and DFlash "
                               "proposer, greedy) or both side by side."),
    vllm_python: Optional[str] = typer.Option(None, help="Python of an environment with vLLM (default: $DFLASH_VLLM_PYTHON, "
                                              "else .venv-vllm/bin/python from `make serving`)."),
    trust_remote_code: TrustRemoteCode = False,
    chat_template_kwargs: ChatTemplateKwargs = None,
    allow_template_mismatch: bool = typer.Option(False, help="Render prompts with --chat-template-kwargs even when the cache was built with others."),
    out: Optional[str] = typer.Option(None, help="JSON report (default: eval.json next to the checkpoint); a PNG goes beside it."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    storage_options: StorageOptions = None,
    quiet: Quiet = False,
    debug: Debug = False,
    knob_values: dict = None,
):
    """Measure a drafter: offline acceptance on a cache's held-out split (--cache) and/or real
    speculative decoding with the teacher (--teacher --prompts), side by side."""

    def action():
        from dflash_common.devices import resolve_device
        from dflash_common.errors import ConfigError

        if not cache and not (teacher and prompts):
            raise ConfigError("give --cache (offline) and/or --teacher with --prompts (real decoding)")
        threshold = knob_values["confidence_threshold"]
        if threshold is not None and (not (teacher and prompts) or engine == "vllm"):
            raise ConfigError(f"--confidence-threshold {threshold:g} is a setting of the built-in decoder; give --teacher "
                              "and --prompts with --engine dflash or both, or drop it")
        if split != "heldout":
            raise ConfigError(f"--split {split!r} is not supported; use heldout")
        if max_sequences < 1 or (max_prompts is not None and max_prompts < 1):
            raise ConfigError(f"--max-sequences {max_sequences} and --max-prompts {max_prompts} must be at least 1 "
                              "(leave --max-prompts unset for every prompt)")
        path = Path(out) if out else Path(checkpoint) / "eval.json"
        # checked before minutes of evaluation, whose report would then have nowhere to go
        if path.is_dir():
            raise ConfigError(f"--out {path} is a folder; pass the report's file name, e.g. {path / 'eval.json'}")
        if any(parent.exists() and not parent.is_dir() for parent in path.parents):
            raise ConfigError(f"--out {path} lies under a file, not a folder; pass another path")
        dev = resolve_device(device)
        path = Path(out) if out else Path(checkpoint) / "eval.json"
        from dflash_common.files import refuse_links

        for written in (path, path.with_suffix(".png"), path.with_suffix(".vllm.log")):
            refuse_links(written)  # before any work: the report would be written through it at the end
        report: dict = {"checkpoint": checkpoint}
        lines: list[tuple[str, str]] = []
        if cache:
            skip = tuple(n.strip() for n in (skip_shards or "").split(",") if n.strip())
            from dflash_train.decoding import run_heldout_fraction

            fraction = run_heldout_fraction(checkpoint, heldout_fraction)
            report.update(_offline(checkpoint, cache, dev, fraction, max_sequences, num_anchors, batch_tokens,
                                   storage_options, skip))
            o = report["offline"]
            lines += [("offline tau (sampling estimate)", f"{o['tau']:.3f}"), ("offline tau (greedy streak)", f"{o['tau_greedy']:.3f}"),
                      ("offline greedy replay accepted length", f"{report['greedy_replay']['accepted_length']:.3f}"),
                      ("held-out loss", f"{o['loss']:.4f}")]
        if teacher and prompts:
            from dflash_train.decoding import resolve_template_kwargs

            kwargs = resolve_template_kwargs(checkpoint, cache, json_option(chat_template_kwargs, "--chat-template-kwargs"),
                                             allow_template_mismatch, json_option(storage_options, "--storage-options"))
            report["chat_template_kwargs"] = kwargs
            real, real_lines = _real(checkpoint, teacher, prompts, engine, dev, teacher_dtype, max_prompts, max_new_tokens,
                                     temperature, top_p, vllm_python, path.with_suffix(".vllm.log"), quiet, trust_remote_code,
                                     kwargs, threshold or 0.0)
            report.update(real)
            lines += real_lines
        path.parent.mkdir(parents=True, exist_ok=True)
        from dflash_common.files import write_file_atomic

        write_file_atomic(path, (json.dumps(report, indent=1) + "\n").encode())
        typer.echo("\n".join(f"{k:<40}{v}" for k, v in lines))
        if cache:
            from dflash_train.evaluate import plot_acceptance

            o = report["offline"]
            plot_acceptance({"alpha (sampling)": o["alpha"], "greedy": o["greedy"]}, path.with_suffix(".png"),
                            f"held-out acceptance, tau {o['tau']:.2f}")
            typer.echo("alpha_k  " + " ".join(f"{x:.3f}" for x in o["alpha"]))
            typer.echo("greedy_k " + " ".join(f"{x:.3f}" for x in o["greedy"]))
        typer.echo(f"report: {path}" + (f" and {path.with_suffix('.png')}" if cache else ""))
        decodings = report.get("decodings", [report.get("decoding", {})])
        if any(d.get("matched_teacher") is False for d in decodings) or report.get("vllm", {}).get("matched_teacher") is False:
            raise typer.Exit(1)

    run(action, debug)


ENGINES = ("dflash", "vllm", "both")


def _real(checkpoint, teacher, prompts, engine, dev, teacher_dtype, max_prompts, max_new_tokens, temperatures, top_p,
          vllm_python, vllm_log, quiet, trust_remote_code=False, template_kwargs=None,
          confidence_threshold=0.0) -> tuple[dict, list[tuple[str, str]]]:
    """Real decoding with the built-in decoder (at each of `temperatures`) and/or vLLM (greedy):
    the report parts and their table lines."""
    from dflash_common.errors import ConfigError
    from dflash_train.decoding import decode_report, load_pair, offline_accepted_length, read_prompts
    from dflash_train.speculative import SpecConfig, check_confidence_threshold

    if engine not in ENGINES:
        raise ConfigError(f"--engine {engine!r} is unknown; use one of {', '.join(ENGINES)}")
    if engine != "dflash" and 0 not in temperatures:
        raise ConfigError(f"--engine {engine} measures greedy decoding; add --temperature 0 (got "
                          f"{', '.join(f'{x:g}' for x in temperatures)})")
    if engine != "dflash":
        from dflash_train.serving import find_vllm_python

        find_vllm_python(vllm_python)  # fail before loading anything
    from dflash_common.devices import teacher_dtype as dtype_for

    dtype = dtype_for(teacher_dtype, dev)
    t, drafter = load_pair(checkpoint, teacher, dtype, str(dev), trust_remote_code)
    check_confidence_threshold(drafter.cfg, confidence_threshold)
    prompt_list = read_prompts(prompts, t.tokenizer, max_prompts, template_kwargs)
    specs = [SpecConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop_token_ids=t.stop_token_ids(),
                        confidence_threshold=confidence_threshold) for temperature in temperatures]
    spec = next(s for s in specs if s.greedy) if engine != "dflash" else specs[0]
    report: dict = {}
    lines: list[tuple[str, str]] = []
    reference = None
    if engine in ("dflash", "both"):
        decodings = [decode_report(t, drafter, prompt_list, s, BarProgress(enabled=not quiet)) for s in specs]
        report["decoding"] = r = decodings[0]
        if len(decodings) > 1:
            report["decodings"] = decodings
        reference = next((d["teacher_outputs"] for d, s in zip(decodings, specs) if s.greedy), None)
        for s, d in zip(specs, decodings):
            at = f" (T={s.temperature:g})" if len(specs) > 1 else ""
            lines += [("real decoding" + at, d["mode"]), ("measured accepted length" + at, f"{d['accepted_length']:.3f}"),
                      ("  kept per forward (after stop cut)", f"{d['kept_per_forward']:.3f}"),
                      ("  teacher forwards saved" + at, f"{d['teacher_forwards_saved']:,} of {d['teacher_alone_forwards']:,} "
                                                         f"(teacher alone)")]
            if confidence_threshold:
                lines.append((f"  drafts verified per forward (confidence >= {confidence_threshold:g})",
                              f"{d['drafts_per_forward']:.3f} of {drafter.cfg.num_draft_positions}"))
        if r["offline_accepted_length"] is not None:
            lines.append(("offline estimate, same prompts", f"{r['offline_accepted_length']:.3f}"))
        lines += [("tokens/s with drafter", f"{r['tokens_per_second']:,.1f}"),
                  ("tokens/s teacher alone", f"{r['teacher_tokens_per_second']:,.1f} (speedup {r['speedup']:.2f}x)")]
        if any(d["matched_teacher"] is not None for d in decodings):
            matched = all(d["matched_teacher"] is not False for d in decodings)
            lines.append(("output equals teacher's greedy", "yes" if matched else "NO"))
    if engine in ("vllm", "both"):
        v = _vllm(checkpoint, teacher, drafter.cfg.block_size, prompt_list, spec, dtype, vllm_python, vllm_log, reference)
        if "decoding" not in report:
            v["offline_accepted_length"] = offline_accepted_length(t, drafter, prompt_list, v["teacher_outputs"])
        else:
            v["offline_accepted_length"] = report["decoding"]["offline_accepted_length"]
        report["vllm"] = v
        lines += [(f"vLLM {v['vllm_version']} accepted length", f"{v['accepted_length']:.3f} ({v['drafts']:,} draft steps)")]
        if "decoding" not in report:
            lines.append(("offline estimate, same prompts", f"{v['offline_accepted_length']:.3f}"))
        lines += [("vLLM tokens/s with drafter", f"{v['tokens_per_second']:,.1f}"),
                  ("vLLM tokens/s teacher alone", f"{v['teacher_tokens_per_second']:,.1f} (speedup {v['speedup']:.2f}x)"),
                  ("vLLM output equals vLLM teacher alone", "yes" if v["matched_teacher"] else "NO")]
        if v["matched_transformers"] is not None:
            lines.append(("vLLM teacher equals transformers", "yes" if v["matched_transformers"] else "no"))
    return report, lines


def _vllm(checkpoint, teacher, block_size, prompt_list, spec, dtype, vllm_python, vllm_log, reference) -> dict:
    """vLLM's report for a drafter; a checkpoint folder is exported first (vLLM loads exports only)."""
    import tempfile

    from dflash_train.checkpoint import COMPLETE
    from dflash_train.serving import VllmConfig, vllm_report
    from dflash_train.trainer import export_checkpoint

    cfg = VllmConfig(python=vllm_python, dtype=dtype, log=str(vllm_log))
    with tempfile.TemporaryDirectory(prefix="dflash-export-") as tmp:
        export_dir = export_checkpoint(checkpoint, Path(tmp) / "drafter") if (Path(checkpoint) / COMPLETE).exists() else checkpoint
        return vllm_report(teacher, str(export_dir), block_size, [p.ids for p in prompt_list], spec.max_new_tokens,
                           spec.stop_token_ids, cfg, reference)


def _offline(checkpoint, cache, dev, heldout_fraction, max_sequences, num_anchors, batch_tokens, storage_options,
             skip_shards=()) -> dict:
    from dflash_cache import open_cache
    from dflash_train.data import DataConfig
    from dflash_train.evaluate import evaluate, greedy_replay, load_drafter_for
    from dflash_train.loss import LossConfig

    c = open_cache(cache, json_option(storage_options, "--storage-options"))
    model = load_drafter_for(checkpoint, c, dev, skip_shards)
    data = DataConfig(batch_tokens=batch_tokens, num_anchors=num_anchors, heldout_fraction=heldout_fraction,
                      skip_shards=skip_shards)
    return {"cache": cache, "offline": evaluate(model, c, data, LossConfig(), max_sequences, dev),
            "greedy_replay": greedy_replay(model, c, data, max_sequences, dev)}


@app.command()
@knob_options(decoding_knobs())
def generate(
    checkpoint: str = typer.Option(..., help="A checkpoint or exported drafter folder."),
    teacher: str = typer.Option(..., help="The teacher (folder or hub name)."),
    prompt: str = typer.Option(..., help="The user message."),
    max_new_tokens: int = typer.Option(256, help="Tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 = speculative sampling."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass."),
    teacher_dtype: str = typer.Option("auto", help="auto = bfloat16 on CUDA, float32 on CPU."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    trust_remote_code: TrustRemoteCode = False,
    chat_template_kwargs: ChatTemplateKwargs = None,
    allow_template_mismatch: bool = typer.Option(False, help="Render prompts with --chat-template-kwargs even when the cache was built with others."),
    debug: Debug = False,
    knob_values: dict = None,
):
    """Generate an answer with speculative decoding and show how many tokens each teacher forward accepted."""

    def action():
        from dflash_common.devices import resolve_device
        from dflash_common.devices import teacher_dtype as dtype_for
        from dflash_train.decoding import load_pair, prompt_ids, resolve_template_kwargs
        from dflash_train.speculative import SpecConfig, check_confidence_threshold, speculative_generate

        dev = resolve_device(device)
        dtype = dtype_for(teacher_dtype, dev)
        kwargs = resolve_template_kwargs(checkpoint, None, json_option(chat_template_kwargs, "--chat-template-kwargs"),
                                         allow_template_mismatch)
        threshold = knob_values["confidence_threshold"] or 0.0
        t, drafter = load_pair(checkpoint, teacher, dtype, str(dev), trust_remote_code)
        check_confidence_threshold(drafter.cfg, threshold)
        ids = prompt_ids(t.tokenizer, [{"role": "user", "content": prompt}], kwargs)
        spec = SpecConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop_token_ids=t.stop_token_ids(),
                          confidence_threshold=threshold)
        result = speculative_generate(t.model, drafter, list(ids), spec)
        typer.echo(t.tokenizer.decode(result.tokens, skip_special_tokens=True))
        mean = sum(result.accepted_lengths) / max(len(result.accepted_lengths), 1)
        drafts = sum(len(d) for d in result.draft_tokens) / max(result.teacher_forwards, 1)
        typer.echo(f"[{len(ids)} prompt tokens, {len(result.tokens)} tokens, {result.teacher_forwards} teacher forwards "
                   f"({len(result.tokens) - 1 - result.teacher_forwards} saved), {drafts:.2f} drafts verified per forward, accepted length {mean:.2f}, "
                   f"{len(result.tokens) / result.seconds:,.1f} tokens/s; per forward: {result.accepted_lengths}]", err=True)

    run(action, debug)


@app.command()
@knob_options(train_knobs() + sweep_knobs(), exclude=("cache", "out"))
def sweep(
    cache: str = typer.Option(..., help="Cache URL made by `dflash-cache build`; every run trains on it."),
    out: str = typer.Option(..., help="Sweep folder: runs/<name>/, results.csv, results.md, loss_curves.png, acceptance_by_position.png, sweep.json."),
    grid: list[str] = typer.Option([], "--grid", help="key=v1,v2,... (repeatable; one run per combination). Keys: the train "
                                   "options' names (loss, weighting, noise, lr, ...) or config paths such as loss.streak_smoothing; "
                                   "values are JSON when they parse."),
    preset: Optional[str] = typer.Option(None, help="A named design instead of --grid: 'recipe' = loss ce,kl,mix x weighting decay,streak x "
                                         "noise off,constant(0.05),cosine, 3 seeds, 3 curve points, compared with the paper's recipe (ce, decay, off)."),
    config: Optional[str] = typer.Option(None, help="A .toml or .json train config shared by every run."),
    set_: list[str] = typer.Option([], "--set", help="Any shared config field: section.key=value (JSON values); "
                                   "the train options below set what every run shares."),
    quiet: Quiet = False,
    debug: Debug = False,
    knob_values: dict = None,
):
    """Train one drafter per grid combination on one cache and compare them; rerun to resume."""

    def action():
        from dflash_common.errors import ConfigError
        from dflash_train.sweep import SweepConfig, parse_grid, run_sweep
        from dflash_train.sweep import preset as find_preset
        from dflash_train.sweep.recipe import MeasureConfig

        given = nested_values(sweep_knobs(), {k.name: knob_values.pop(k.name) for k in sweep_knobs()})
        base = _train_config(config, False, {**knob_values, "cache": cache, "out": out}, set_)
        chosen = find_preset(preset) if preset else None
        if chosen and grid:
            raise ConfigError(f"--preset {preset} sets the grid; drop --grid {grid[0]} (or drop --preset)")
        measure = MeasureConfig(**{"curve_points": chosen.curve_points if chosen else 0, **given.pop("measure", {})})
        choices = {"grid": chosen.grid, "seeds": chosen.seeds, "reference": chosen.reference, "centers": chosen.centers,
                   "include": chosen.include} if chosen else {"grid": parse_grid(grid)}
        sweep_cfg = SweepConfig(out=out, base=base, measure=measure, **{**choices, **given})
        result = run_sweep(sweep_cfg, progress=BarProgress(enabled=not quiet))
        typer.echo(result.report.summary or result.report.markdown, nl=False)

    run(action, debug)


def main():
    app()


if __name__ == "__main__":
    main()
