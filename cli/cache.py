"""`dflash-cache`: build, inspect and verify teacher caches."""

from __future__ import annotations

import json
from typing import Optional

import typer

from cli.common import BarProgress, Debug, Quiet, StorageOptions, knob_options, run
from dflash_build.settings.build_config import build_knobs
from dflash_common.errors import ConfigError, shown
from dflash_common.knobs import make_config, nested_values
from dflash_common.redact import server_secrets
from dflash_common.values import json_object as json_option
from dflash_regenerate.settings.regenerate_config import regenerate_knobs

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Stage 1: run a teacher over a corpus once and cache what drafter training needs.")


def _build_config(knob_values: dict):
    """The BuildConfig of the options given (the fields' defaults for the rest); the rank from torchrun's environment."""
    from dflash_build.settings.build_config import BuildConfig
    from dflash_common.environment import rank_and_world

    rank, world_size = rank_and_world()
    return make_config(BuildConfig, nested_values(build_knobs(), knob_values), rank=rank, world_size=world_size)


@app.command()
@knob_options(build_knobs(), top_panel="build settings")
def build(
    dry_run: bool = typer.Option(False, help="Tokenize only and estimate sequences, tokens, bytes and shards."),
    quiet: Quiet = False,
    debug: Debug = False,
    knob_values: dict = None,
):
    """Run the teacher over the corpus and write (or resume) a sharded cache."""
    progress = BarProgress(enabled=not quiet)

    def action():
        from dflash_build import build_cache, estimate

        cfg = _build_config(knob_values)
        if dry_run:
            e = estimate(cfg, progress)
            typer.echo(
                f"rows {e.rows:,}  sequences {e.sequences:,}  tokens {e.tokens:,} ({e.loss_tokens:,} in the loss mask)\n"
                f"bytes {e.bytes / 1e9:,.3f} GB ({e.bytes_per_token:,} B/token)  shards {e.shards:,}"
                + (f"\nskipped {e.skipped}" if e.skipped else "")
            )
            return
        manifest = build_cache(cfg, progress)
        if manifest.get("complete"):  # under torchrun: only the rank that completed the cache
            typer.echo(f"cache ready at {cfg.out}")
        else:
            typer.echo(f"rank {cfg.rank} finished its part of {cfg.out}; the last rank to finish completes the cache")

    run(action, debug)


@app.command()
def finalize(
    url: str = typer.Argument(..., help="Cache URL built by several ranks."),
    storage_options: StorageOptions = None,
    debug: Debug = False,
):
    """Merge the ranks' shard records into the final manifest (for ranks run as independent jobs)."""

    def action():
        from dflash_build import finalize_cache

        m = finalize_cache(url, json_option(storage_options, "--storage-options"))
        typer.echo(f"finalized {url}: {m['totals']['shards']} shard(s), {m['totals']['sequences']:,} sequences")

    run(action, debug)


MAX_LISTED = 20
"""Items of a list `info` prints on one line (layers, skip reasons); a count says the rest."""


def _damaged_manifest(url: str, manifest: dict):
    """The error info ends with after describing a manifest whose described fields are malformed
    (None: they are sound). What it shows of them stays readable, but the command fails: a script
    reading info's exit code must not take a manifest holding a string for a count as sound."""
    from dflash_cache import format as fmt
    from dflash_common.errors import CacheError

    problems = fmt.described_field_problems(manifest)
    if not problems:
        return None
    return CacheError(f"{url}: manifest.json {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                      + "; the manifest is damaged or edited: restore manifest.json or rebuild the cache with "
                      "`dflash-cache build ... --overwrite`")


@app.command()
def info(
    url: str = typer.Argument(..., help="Cache URL."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole manifest as JSON."),
    storage_options: StorageOptions = None,
    debug: Debug = False,
):
    """Describe a cache: teacher, layers, k, sizes, shards, skipped rows."""

    def action():
        from dflash_cache import open_cache
        from dflash_cache.verify import health_lines

        cache = open_cache(url, json_option(storage_options, "--storage-options"))
        m = cache.manifest
        damaged = _damaged_manifest(url, m)
        if as_json:
            typer.echo(json.dumps(m, indent=1))
            if damaged:
                raise damaged
            return
        # totals are a sum the build writes last; an older or hand-made manifest may lack them
        t, teacher = m.get("totals") or cache.totals, m["teacher"]
        # an edited or hand-made manifest: descriptive fields of the wrong type print as "?", not a traceback
        t = {k: (v if k == "skipped" and isinstance(v, dict) else v if isinstance(v, int) and not isinstance(v, bool) else 0)
             for k, v in (t if isinstance(t, dict) else {}).items()}
        teacher = {k: teacher.get(k, "?") for k in ("name", "model_type", "num_hidden_layers", "hidden_size",
                                                    "vocab_size", "weights_hash")}
        if not isinstance(teacher["vocab_size"], int):
            teacher["vocab_size"] = 0
        # values it did not write are shown cut to a line's share: a 50 MB name is not printed back
        teacher = {k: v if k == "vocab_size" else shown(v) for k, v in teacher.items()}
        layers = ",".join(map(str, cache.layer_ids[:MAX_LISTED])) + (
            f",... ({len(cache.layer_ids):,} layers)" if len(cache.layer_ids) > MAX_LISTED else "")
        skipped = sorted(t["skipped"].items(), key=lambda kv: str(kv[0])) if t.get("skipped") else []
        tokens = max(t.get("tokens", 0), 1)
        lines = [
            f"cache        {url} ({'complete' if cache.complete else 'INCOMPLETE: rerun the build to finish it'})",
            f"format       {m['format']} v{m['format_version']}",
            f"teacher      {teacher['name']} ({teacher['model_type']}, {teacher['num_hidden_layers']} layers, hidden {teacher['hidden_size']}, vocab {teacher['vocab_size']:,}; weights {teacher['weights_hash']})",
            f"layers       {layers}   dtype {cache.hidden_dtype}   top-k {cache.top_k}",
            f"sequences    {t.get('sequences', 0):,}   tokens {t.get('tokens', 0):,} ({t.get('loss_tokens', 0):,} in the loss mask)",
            f"storage      {t.get('bytes', 0) / 1e6:,.1f} MB in {t.get('shards', 0)} shard(s), {t.get('bytes', 0) / tokens:,.0f} B/token",
        ]
        if cache.hidden_format != "lossless":
            lines.append(f"hidden       {cache.hidden_format} with a power-of-two scale per token and layer "
                         f"(lossy; read back as {cache.hidden_dtype})")
        if skipped:
            lines.append(f"skipped      {', '.join(f'{shown(k, 40)}: {shown(v, 40)}' for k, v in skipped[:MAX_LISTED])}"
                         + (f", ... ({len(skipped):,} reasons)" if len(skipped) > MAX_LISTED else ""))
        lines += health_lines(*cache.capture_health())
        typer.echo("\n".join(lines))
        if damaged:
            raise damaged

    run(action, debug)


@app.command()
def verify(
    url: str = typer.Argument(..., help="Cache URL."),
    deep: bool = typer.Option(False, help="Also re-run the teacher on a sample of sequences and compare hidden states and top-k with the stored values."),
    sample: int = typer.Option(64, help="Sequences re-run by --deep, spread over all shards."),
    teacher: Optional[str] = typer.Option(None, help="Teacher for --deep (default: the manifest's build.teacher.name_or_path)."),
    device: Optional[str] = typer.Option(None, help="Device for --deep: auto (the default: CUDA when present), cpu, cuda or cuda:N."),
    damaged: Optional[str] = typer.Option(None, help="Also write every damaged shard's name to this file, comma-separated "
                                          "(empty when none is): the output names the first 20 only; train without "
                                          "them with --skip-shards \"$(cat FILE)\"."),
    storage_options: StorageOptions = None,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """Check every shard's checksums, shapes, dtypes and finiteness; exit 1 naming each bad shard."""

    def action():
        from dflash_cache import open_cache
        from dflash_cache.verify import finding_lines, verdict, verify_cache

        if deep and sample < 1:  # -1 re-ran nothing and said ok
            raise ConfigError(f"--sample {sample} must be at least 1: the number of sequences --deep re-runs, e.g. 64")
        cache = open_cache(url, json_option(storage_options, "--storage-options"))
        report = verify_cache(cache, BarProgress(enabled=not quiet))
        if damaged is not None:  # every name, for --skip-shards
            from dflash_common.files import write_file_atomic

            write_file_atomic(damaged, (",".join(report.bad_shards) + "\n" if report.bad_shards else "").encode())
        for line in finding_lines(report, damaged):
            typer.echo(line, err=True)
        deep_report = None
        if deep:
            from dflash_build.deep_verify import deep_verify, mismatch_lines

            deep_report = deep_verify(cache, sample, teacher, progress=BarProgress(enabled=not quiet),
                                      skip=set(report.bad_shards), **({"device": device} if device else {}))
            for line in mismatch_lines(deep_report):
                typer.echo(line, err=True)
        code, last = verdict(cache, report, deep_report)
        typer.echo(last, err=code != 0)
        if code:
            raise typer.Exit(code)

    run(action, debug)


@app.command()
@knob_options(regenerate_knobs())
def regenerate(
    merge_only: bool = typer.Option(False, help="Only concatenate the committed parts into OUT (after every rank finished)."),
    quiet: Quiet = False,
    debug: Debug = False,
    knob_values: dict = None,
):
    """Keep the corpus prompts and replace the assistant turns with the teacher's own answers (resumable; torchrun splits rows)."""
    progress = BarProgress(enabled=not quiet)

    def action():
        from dflash_common.environment import rank_and_world
        from dflash_regenerate import merge_parts
        from dflash_regenerate import regenerate as regenerate_corpus
        from dflash_regenerate.settings.regenerate_config import RegenerateConfig

        out = knob_values["out"]
        if merge_only:
            result = merge_parts(out, progress)
        else:
            teacher, endpoint = knob_values["teacher"], knob_values["endpoint"]
            if bool(teacher) == bool(endpoint):
                raise ConfigError("give --teacher (generate here with transformers) or --endpoint with --served-model "
                                  "(ask inference servers), not both or neither")
            if endpoint and not knob_values["served_model"]:
                raise ConfigError("--endpoint needs --served-model, the name the server serves the teacher under "
                                  "(see its /v1/models)")
            values = nested_values(regenerate_knobs(), knob_values)
            # the one source of answers: the other one's options are left unused
            if endpoint:
                values["teacher"] = None
            else:
                values.pop("server", None)
            rank, world_size = rank_and_world()
            result = regenerate_corpus(make_config(RegenerateConfig, values, rank=rank, world_size=world_size), progress)
        if result.complete:
            typer.echo(f"regenerated corpus ready at {out} ({result.rows:,} rows)")
        else:
            typer.echo(f"this rank is done; {result.parts_missing} part(s) of other ranks are missing")

    run(action, debug, secrets=server_secrets(knob_values["endpoint"] or (), knob_values["api_key_env"]))


def main():
    app()


if __name__ == "__main__":
    main()
