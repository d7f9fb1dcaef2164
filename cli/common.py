"""What both commands share: one-line errors and a progress bar."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import traceback
from collections.abc import Collection, Sequence
from typing import Callable, List, Optional

import typer
from tqdm import tqdm

from dflash_common.errors import DFlashError
from dflash_common.progress import Progress
from dflash_common.redact import redact
from dflash_common.values import json_object as json_option  # noqa: F401 (the commands' name for it)

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


def run(action: Callable[[], object], debug: bool, resume_hint: str = "rerun the same command to resume") -> object:
    """Run a command's one call; expected errors become one line on stderr and exit code 1."""
    quiet_transformers()
    try:
        return action()
    except DFlashError as err:
        if debug:
            traceback.print_exc()
        # a last guard: no URL credentials or bearer token reach the terminal (or a CI log)
        typer.echo(f"error: {redact(str(err))}", err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; {resume_hint}", err=True)
        raise typer.Exit(130)


def split_ints(text: str | None, option: str) -> tuple[int, ...] | None:
    if text is None or text == "":
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{option} takes comma-separated integers, e.g. 1,16,31; got {text!r}") from None


def knob_options(knobs: Sequence, exclude: Collection[str] = (), paths: bool = True):
    """Give a command one option per knob (dflash_train.knobs), after its own parameters: the
    option's name, type, help and default text all come from the config field. The command gets
    them as one parameter, `knob_values`: {knob name: value, or None when the option is not given}.
    ``paths``: name each field's config path in its help (for commands that read config files)."""
    from rich.markup import escape

    chosen = [k for k in knobs if k.name not in exclude]

    def option(knob) -> inspect.Parameter:
        kind = List[knob.value_type.__args__[0]] if knob.repeat else str if knob.is_text else knob.value_type
        notes = ([f"default {knob.shown_default()}"] if knob.shown_default() != "-" else []) + \
            ([f"config {knob.dotted}"] if paths and knob.dotted != knob.name else [])
        text = escape(f"{knob.doc} ({'; '.join(notes)})" if notes else knob.doc)
        decls = (f"{knob.flag}/--no-{knob.flag[2:]}",) if kind is bool else ()
        default = typer.Option(..., *decls, help=escape(knob.doc), rich_help_panel=_panel(knob)) if knob.required else \
            typer.Option(None, *decls, help=text, show_default=False, rich_help_panel=_panel(knob))
        return inspect.Parameter(knob.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                 annotation=kind if knob.required else Optional[kind])

    def decorate(command: Callable) -> Callable:
        own = [p for name, p in inspect.signature(command, eval_str=True).parameters.items() if name != "knob_values"]

        @functools.wraps(command)
        def with_knobs(**values):
            # a repeatable option not given arrives as an empty list: not given, like the others
            given = {k.name: values.pop(k.name) for k in chosen}
            return command(knob_values={name: value if value != [] and value != () else None
                                        for name, value in given.items()}, **values)

        params = own + [option(k) for k in chosen]
        with_knobs.__signature__ = inspect.Signature(params)
        with_knobs.__annotations__ = {p.name: p.annotation for p in params}
        del with_knobs.__wrapped__  # typer reads the signature above, not the command's
        return with_knobs

    return decorate


def _panel(knob) -> str:
    return knob.panel or (f"{knob.section} settings" if knob.section else "run settings")
