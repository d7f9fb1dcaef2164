"""`dflash-train`: train a DFlash drafter from a cache, and export it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from cli.common import (
    BarProgress,
    Debug,
    Quiet,
    knob_options,
    run,
)
from dflash_common.knobs import nested_values
from dflash_train.options import eval_knobs, generate_knobs, train_knobs
from dflash_train.sweep.plan import sweep_knobs

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Stage 2: train a DFlash drafter from a teacher cache.")


def _train_config(config, resume, knob_values, sets):
    """The run's TrainConfig: a config file (or, on resume, the run's saved config.json), then the
    options given, then --set."""
    from dflash_common.settings_files import load_settings_file
    from dflash_train.config import config_from_dict, merge, read_config_file
    from dflash_train.options import option_overrides, set_overrides

    saved = Path(knob_values["out"]) / "config.json"
    fix = "pass --config, or start a new --out"
    base = read_config_file(config) if config else (
        load_settings_file(_saved_config(saved, fix),
                           f"the run's saved config {saved}", fix=fix)
        if resume and os.path.lexists(saved) else {})
    return config_from_dict(merge(merge(base, option_overrides(knob_values)), set_overrides(sets)))


def _saved_config(saved: Path, fix: str) -> str:
    """A run's saved config.json to resume from: refused when a link (the run folder is an output,
    see refuse_links) or a FIFO or device (regular_file_inside), which would block or never end."""
    from dflash_common.errors import ConfigError
    from dflash_common.files import refuse_links, regular_file_inside

    refuse_links(saved)
    return regular_file_inside(saved.parent, saved.name, f"--resume: run {saved.parent}", ConfigError, fix)


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
        from dflash_train.training.trainer import train

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
        from dflash_train.training.trainer import export_checkpoint

        exported = export_checkpoint(checkpoint, out_dir)
        typer.echo(f"drafter exported to {exported}")
        _echo_serve_commands(exported)

    run(action, debug)


def _echo_serve_commands(export_dir) -> None:
    from dflash_train.measuring.serving import serve_commands
    from dflash_train.training.export import read_export_config

    commands = serve_commands(export_dir, read_export_config(export_dir))
    typer.echo("serve it with its teacher (TEACHER: the model the cache was built from):")
    typer.echo(f"  vLLM:   {commands['vllm']}")
    typer.echo(f"  SGLang: {commands['sglang']}")


@app.command("eval")
@knob_options(eval_knobs(), paths=False)
def eval_(
    quiet: Quiet = False,
    debug: Debug = False,
    knob_values: dict = None,
):
    """Measure a drafter: offline acceptance on a cache's held-out split (--cache) and/or real
    speculative decoding with the teacher (--teacher --prompts), side by side."""

    def action():
        from dflash_train.measuring.commands import eval_config, eval_text, run_eval

        result = run_eval(eval_config(nested_values(eval_knobs(), knob_values)), BarProgress(enabled=not quiet))
        typer.echo(eval_text(result))
        if not result.lossless:  # a near-tie flip is named in the report, a real mismatch fails
            raise typer.Exit(1)

    run(action, debug)


@app.command()
@knob_options(generate_knobs(), paths=False)
def generate(
    debug: Debug = False,
    knob_values: dict = None,
):
    """Generate an answer with speculative decoding and show how many tokens each teacher forward accepted."""

    def action():
        from dflash_common.knobs import make_config
        from dflash_train.measuring.commands import run_generate
        from dflash_train.settings.eval_config import GenerateConfig

        for answer in run_generate(make_config(GenerateConfig, nested_values(generate_knobs(), knob_values))):
            typer.echo(answer.text)
            typer.echo(answer.summary, err=True)

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
        from dflash_train.sweep import run_sweep, sweep_config

        given = nested_values(sweep_knobs(), {k.name: knob_values.pop(k.name) for k in sweep_knobs()})
        base = _train_config(config, False, {**knob_values, "cache": cache, "out": out}, set_)
        sweep_cfg = sweep_config(out, base, grid, preset, given)
        result = run_sweep(sweep_cfg, progress=BarProgress(enabled=not quiet))
        typer.echo(result.report.summary or result.report.markdown, nl=False)

    run(action, debug)


def main():
    app()


if __name__ == "__main__":
    main()
