"""Each setting is declared once, as a config field with its docstring: the command-line options
of `run`, `sweep`, `build` and `regenerate`, --set, the sweep's grid keys and the option tables of docs/options.md
come from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import typer.main

from cli.cache import _build_config
from cli.cache import app as cache_app
from cli.docs import with_tables
from cli.train import _train_config, app
from dflash_build.settings.build_config import BuildConfig, build_knobs
from dflash_cache.settings.storage_config import StorageConfig
from dflash_common.errors import ConfigError
from dflash_common.field_docs import field_docs
from dflash_common.knobs import make_config, nested_values
from dflash_regenerate.settings.regenerate_config import regenerate_knobs
from dflash_teacher.settings.teacher_config import TeacherConfig
from dflash_train.options import (
    eval_knobs,
    find_knob,
    generate_knobs,
    option_overrides,
    set_overrides,
    train_knobs,
)
from dflash_train.settings.loss_config import LossConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.sweep import parse_grid
from dflash_train.sweep.plan import sweep_knobs

OPTIONS = Path(__file__).resolve().parents[1] / "docs" / "options.md"


def _options(command: str) -> dict[str, object]:
    """{option flag: click parameter} of a dflash-train command."""
    cmd = typer.main.get_command(app).commands[command]
    return {decl: p for p in cmd.params for decl in p.opts}


def _parsed(args: list[str]) -> tuple[dict, dict]:
    """How `dflash-train run ARGS` parses: (the command's own values, knob values)."""
    cmd = typer.main.get_command(app).commands["run"]
    params = cmd.make_context("run", args).params
    names = {k.name for k in train_knobs()}
    return {k: v for k, v in params.items() if k not in names}, {k: v for k, v in params.items() if k in names}


def test_every_config_field_is_a_knob_with_its_docstring():
    knobs = train_knobs()
    assert len(knobs) > len(dataclasses.fields(TrainConfig))  # the sections are opened into their fields
    assert find_knob("loss") is find_knob("loss.kind") and find_knob("loss").doc == field_docs(LossConfig)["kind"]
    assert find_knob("data_seed").path == ("data", "seed") and find_knob("noise_seed").path == ("noise", "seed")
    assert find_knob("seed").path == ("seed",) and find_knob("nope") is None
    assert len({k.name for k in knobs}) == len(knobs) and all(k.doc for k in knobs)


def test_run_and_sweep_have_one_option_per_knob_with_help_from_the_field():
    run, sweep = _options("run"), _options("sweep")
    for knob in train_knobs():
        assert knob.flag in run, knob.flag
        assert run[knob.flag].help.startswith(knob.doc[:40]), knob.flag
        assert knob.flag in sweep or knob.name in ("cache", "out"), knob.flag
    for knob in sweep_knobs():  # the sweep's own settings come from SweepConfig's and MeasureConfig's fields
        assert knob.flag in sweep and knob.flag not in run and sweep[knob.flag].help.startswith(knob.doc[:40]), knob.flag
    assert {k.name for k in sweep_knobs()} >= {"parallel", "devices", "seeds", "design", "curve_points", "teacher"}
    assert "default kl; config loss.kind" in run["--loss"].help
    assert "--no-streak-decay" in run["--streak-decay"].secondary_opts


def test_options_reach_the_config_parsed_by_the_field_type(tmp_path):
    own, knobs = _parsed(["--cache", "c", "--out", str(tmp_path / "run"), "--loss", "ce", "--betas", "0.8, 0.9",
                          "--noise-layers", "0,2", "--streak-decay", "--weighting", "streak", "--data-seed", "7",
                          "--skip-shards", "shard-r00000-000001,", "--storage-options", '{"anon": true}', "--epochs", "2",
                          "--set", "optim.lr=0.001"])
    cfg = _train_config(own["config"], False, knobs, own["set_"])
    assert (cfg.loss.kind, cfg.loss.streak_decay, cfg.optim.betas, cfg.noise.layers) == ("ce", True, (0.8, 0.9), (0, 2))
    assert (cfg.data.seed, cfg.data.skip_shards, cfg.storage_options) == (7, ("shard-r00000-000001",), {"anon": True})
    assert (cfg.epochs, cfg.steps, cfg.optim.lr, cfg.seed) == (2.0, None, 0.001, 0)


def test_a_given_run_length_replaces_the_config_files_other_one(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("steps = 50\n")
    own, knobs = _parsed(["--cache", "c", "--out", "o", "--config", str(config), "--epochs", "1.5"])
    cfg = _train_config(own["config"], False, knobs, [])
    assert (cfg.steps, cfg.epochs) == (None, 1.5)
    with pytest.raises(ConfigError, match="--steps 3 and --epochs 1.5 both set the run length; give one"):
        option_overrides({"steps": 3, "epochs": 1.5})


@pytest.mark.parametrize("name, text, message", [
    ("betas", "0.9,x", "--betas takes comma-separated float values, e.g. 0.9,0.95; got '0.9,x'"),
    ("sliding_layers", "0;1", "--sliding-layers takes comma-separated int values, e.g. 0,1; got '0;1'"),
    ("storage_options", "[1]", "--storage-options '[1]' is a JSON list, not an object"),
])
def test_bad_option_text_is_one_line_naming_the_option(name, text, message):
    with pytest.raises(ConfigError) as err:
        option_overrides({name: text})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_set_items_are_json_values_at_their_paths():
    assert set_overrides(["loss.chunk_positions=1024", "optim.betas=[0.8, 0.9]", "device=cpu", "loss.kind=ce"]) == {
        "loss": {"chunk_positions": 1024, "kind": "ce"}, "optim": {"betas": [0.8, 0.9]}, "device": "cpu"}
    with pytest.raises(ConfigError, match="--set takes section.key=value, got 'loss.kind'; e.g. --set"):
        set_overrides(["loss.kind"])


def test_every_knob_is_a_grid_key_by_its_name_or_path():
    axes = parse_grid(["noise_seed=1,2", "optim.min_lr_ratio=0.0,0.1", "read_threads=2"])
    assert [(a.key, a.path) for a in axes] == [("noise_seed", ("noise", "seed")), ("min_lr_ratio", ("optim", "min_lr_ratio")),
                                              ("read_threads", ("data", "read_threads"))]


def test_the_option_tables_are_the_ones_the_fields_make():
    text = OPTIONS.read_text()
    assert with_tables(text) == text, "an option table in docs/options.md is stale: run `make docs`"
    for knob in train_knobs() + build_knobs() + regenerate_knobs():
        assert f"| `{'` / `'.join(knob.flags)}` | `{knob.dotted}` |" in text
    stale = text.replace("| `--top-k` | `teacher.top_k` | 64 |", "| `--top-k` | `teacher.top_k` | 32 |")
    assert with_tables(stale) == text


def _cache_options(command: str) -> dict[str, object]:
    cmd = typer.main.get_command(cache_app).commands[command]
    return {decl: p for p in cmd.params for decl in p.opts + p.secondary_opts}


def _build_parsed(args: list[str]) -> BuildConfig:
    """The BuildConfig `dflash-cache build ARGS` makes."""
    cmd = typer.main.get_command(cache_app).commands["build"]
    params = cmd.make_context("build", ["--teacher", "t", "--data", "d", "--out", "o"] + args).params
    return _build_config({k.name: params[k.name] for k in build_knobs()})


def test_build_and_regenerate_have_one_option_per_field_but_the_environments():
    build, regenerate = _cache_options("build"), _cache_options("regenerate")
    for knob in build_knobs():
        assert knob.flag in build and build[knob.flag].help.startswith(knob.doc[:40]), knob.flag
    for knob in regenerate_knobs():
        assert knob.flag in regenerate and regenerate[knob.flag].help.startswith(knob.doc[:40]), knob.flag
    assert {"--rank", "--world-size"}.isdisjoint(build) and {"--rank", "--world-size", "--backoff-s", "--top-k"}.isdisjoint(regenerate)
    assert {"--teacher", "--tapped-layers", "--drafter-layers", "--shard-size", "--chunk-size", "--layers", "--dry-run",
            "--quiet", "--debug", "--no-overwrite"} <= set(build)
    assert {"--endpoint", "--served-model", "--concurrency", "--merge-only", "--teacher"} <= set(regenerate)
    assert build["--teacher"].required and not regenerate["--teacher"].required  # regenerate may ask servers instead


def test_build_options_reach_the_config_and_the_defaults_are_the_fields():
    plain = _build_parsed([])
    assert plain == BuildConfig(out="o", corpus=plain.corpus, teacher=TeacherConfig("t"))
    assert plain.storage == StorageConfig() and plain.storage.shard_bytes == 512 * 10**6  # the old --shard-size 512MB
    cfg = _build_parsed(["--layers", "1,3,5", "--drafter-layers", "3", "--shard-size", "2GiB", "--chunk-size", "1MB",
                         "--storage-options", '{"anon": true}', "--chat-template-kwargs", '{"enable_thinking": false}',
                         "--overwrite", "--top-k", "8", "--max-length", "64"])
    assert (cfg.teacher.layers, cfg.teacher.num_tapped_layers, cfg.teacher.top_k) == ((1, 3, 5), 3, 8)
    assert (cfg.storage.shard_bytes, cfg.storage.chunk_bytes, cfg.overwrite) == (2 * 2**30, 10**6, True)
    assert (cfg.storage_options, cfg.corpus.chat_template_kwargs, cfg.corpus.max_length) == (
        {"anon": True}, {"enable_thinking": False}, 64)
    with pytest.raises(ConfigError, match="cannot read the size '12 parsecs'"):
        _build_parsed(["--shard-size", "12 parsecs"])


def test_regenerate_options_nest_into_its_teacher_and_server_sections():
    knobs = regenerate_knobs()
    given = {k.name: None for k in knobs} | {"data": "d", "out": "o.jsonl", "endpoint": ["http://a", "http://b"],
                                             "served_model": "m", "concurrency": 3, "top_p": 0.5}
    values = nested_values(knobs, given)
    assert values == {"data": "d", "out": "o.jsonl", "top_p": 0.5,
                      "server": {"endpoints": ["http://a", "http://b"], "served_model": "m", "concurrency": 3}}
    from dflash_regenerate.settings.regenerate_config import RegenerateConfig

    cfg = make_config(RegenerateConfig, {**values, "teacher": None}, rank=0, world_size=1)
    assert (cfg.server.endpoints, cfg.server.concurrency, cfg.top_p, cfg.max_new_tokens) == (("http://a", "http://b"), 3, 0.5, 2048)


def option_default_problems(apps: dict) -> list[str]:
    """Options named like a config field that are declared by hand with a default of their own,
    which could drift from the field's: such options come from the field (default None)."""
    fields = {name for knob in build_knobs() + regenerate_knobs() + train_knobs() + sweep_knobs() + eval_knobs()
              + generate_knobs()
              for name in (knob.name, knob.path[-1])}
    found = []
    for program, typer_app in apps.items():
        for name, cmd in typer.main.get_command(typer_app).commands.items():
            for p in cmd.params:
                if p.name in fields and not p.required and p.default not in (None, (), []):
                    found.append(f"{program} {name} {p.opts[0]}: declared with the default {p.default!r}")
    return found


def test_no_option_default_repeats_a_config_field_default():
    assert option_default_problems({"dflash-cache": cache_app, "dflash-train": app}) == []
    # the check sees a hand-declared field option
    hand = typer.Typer()

    @hand.command()
    def build(top_k: int = typer.Option(64), dry_run: bool = False):
        pass

    @hand.command()
    def other():
        pass

    assert option_default_problems({"x": hand}) == ["x build --top-k: declared with the default 64"]
