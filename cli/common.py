"""What both command lines share: one-line errors, a progress bar, the options of config fields and
the options every command has (each declared once, here)."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import traceback
import typing
from collections.abc import Collection, Iterable, Sequence
from typing import Annotated, Callable, List, Optional

import typer
from tqdm import tqdm

from dflash_common.errors import DFlashError
from dflash_common.progress import Progress
from dflash_common.redact import redact

# The options that are no config's field, shared by the commands: `debug: Debug = False`.
Debug = Annotated[bool, typer.Option(help="Show tracebacks.")]
Quiet = Annotated[bool, typer.Option(help="No progress bar.")]
TrustRemoteCode = Annotated[bool, typer.Option(
    help="Run modeling/tokenizer code shipped in the teacher's folder (only for code you trust).")]
ChatTemplateKwargs = Annotated[Optional[str], typer.Option(
    help="Chat-template variables as JSON, e.g. '{\"enable_thinking\": false}' (default: what the drafter's cache was built with).")]
StorageOptions = Annotated[Optional[str], typer.Option(help="fsspec storage options as JSON, e.g. '{\"endpoint_url\": ...}'.")]

# Our own bar reports progress; transformers' per-load bars and warnings would bury it and break
# the one-line error contract.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class BarProgress(Progress):
    """Draws progress with tqdm on stderr (rate and ETA included); messages go above the bar."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.bar = enabled, None

    def start(self, total, desc, unit):
        self.close()
        self.bar = tqdm(total=total, desc=desc, unit=unit, disable=not self.enabled, dynamic_ncols=True,
                        file=sys.stderr, smoothing=0.1)

    def advance(self, n, **stats):
        if self.bar is not None:
            if stats:
                self.bar.set_postfix(stats, refresh=False)
            self.bar.update(n)

    def message(self, text):
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run(action: Callable[[], object], debug: bool, resume_hint: str = "rerun the same command to resume",
        secrets: Iterable[str] = ()) -> object:
    """Run a command's one call; expected errors become one line on stderr and exit code 1.
    ``secrets`` (an API key, say) are hidden in what is printed, as URL credentials and bearer
    tokens always are."""
    if "transformers" in sys.modules:  # else the environment above quiets it when it loads (info and verify never do)
        quiet_transformers()
    try:
        return action()
    except DFlashError as err:
        # a last guard: no URL credentials, bearer token or key reach the terminal (or a CI log),
        # --debug's traceback included (it quotes the messages of the whole chain)
        if debug:
            typer.echo(redact(traceback.format_exc(), secrets).rstrip("\n"), err=True)
        typer.echo(f"error: {redact(str(err), secrets)}", err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; {resume_hint}", err=True)
        raise typer.Exit(130)
    except (typer.Exit, typer.Abort, typer.BadParameter):  # the command line's own ways out
        raise
    except Exception as err:  # noqa: BLE001 - a bug of ours: its traceback, but with the secrets hidden too
        typer.echo(redact(traceback.format_exc(), secrets).rstrip("\n"), err=True)
        typer.echo(f"error: unexpected {type(err).__name__}, a bug in dflash; please report it with the traceback above",
                   err=True)
        raise typer.Exit(1)


def knob_options(knobs: Sequence, exclude: Collection[str] = (), top_panel: str = "run settings", paths: bool = True):
    """Give a command one option per knob (dflash_common.knobs), after its own parameters: the
    option's name, type, help and default text all come from the config field, and its default is
    None, so the field's default applies (a test holds every command to that). The command gets
    them as one parameter, `knob_values`: {knob name: value, or None when the option is not given}.
    ``paths``: name each field's config path in its help (for commands that read config files)."""
    from rich.markup import escape

    chosen = [k for k in knobs if k.name not in exclude]

    def option(knob) -> inspect.Parameter:
        kind = List[typing.get_args(knob.value_type)[0]] if knob.repeat else str if knob.is_text else knob.value_type
        notes = ([f"default {knob.shown_default()}"] if knob.shown_default() not in ("-", "required") else []) + \
            ([f"config {knob.dotted}"] if paths and knob.dotted != knob.name else [])
        text = escape(f"{knob.doc} ({'; '.join(notes)})" if notes else knob.doc)
        decls = (f"{knob.flag}/--no-{knob.flag[2:]}",) if kind is bool else knob.flags
        panel = knob.panel or (f"{knob.section} settings" if knob.section else top_panel)
        default = typer.Option(..., *decls, help=text, rich_help_panel=panel) if knob.required else \
            typer.Option(None, *decls, help=text, show_default=False, rich_help_panel=panel)
        return inspect.Parameter(knob.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                 annotation=kind if knob.required else Optional[kind])

    def decorate(command: Callable) -> Callable:
        own = [p for name, p in inspect.signature(command, eval_str=True).parameters.items() if name != "knob_values"]

        @functools.wraps(command)
        def with_knobs(**values):
            given = {k.name: values.pop(k.name) for k in chosen}
            # a repeatable option given no time arrives as an empty list: not given
            return command(knob_values={name: value if value != [] and value != () else None
                                        for name, value in given.items()}, **values)

        params = own + [option(k) for k in chosen]
        with_knobs.__signature__ = inspect.Signature(params)
        with_knobs.__annotations__ = {p.name: p.annotation for p in params}
        with_knobs.knobs = tuple(chosen)  # for the test that no option repeats a field default
        del with_knobs.__wrapped__  # typer reads the signature above, not the command's
        return with_knobs

    return decorate
