"""What both commands share: one-line errors and a progress bar."""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Callable

import typer
from tqdm import tqdm

from dflash_common.errors import DFlashError
from dflash_common.progress import Progress

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
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        typer.echo(f"interrupted; {resume_hint}", err=True)
        raise typer.Exit(130)


def json_option(text: str | None, option: str) -> dict | None:
    """A JSON-object option such as --storage-options, or None when not given."""
    from dflash_common.errors import ConfigError

    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{option} {text!r} is not valid JSON ({err.msg} at character {err.pos}); "
                          f"pass an object, e.g. {option} '{{\"endpoint_url\": \"http://127.0.0.1:9000\"}}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{option} {text!r} is a JSON {type(value).__name__}, not an object; pass {{\"key\": value, ...}}")
    return value


def split_ints(text: str | None, option: str) -> tuple[int, ...] | None:
    if text is None or text == "":
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{option} takes comma-separated integers, e.g. 1,16,31; got {text!r}") from None
