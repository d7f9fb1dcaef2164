"""What both commands share: one-line errors and a progress bar."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

import typer
from tqdm import tqdm

from dflash_cache.errors import DFlashError
from dflash_cache.progress import Progress

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


def run(action: Callable[[], object], debug: bool) -> object:
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
        typer.echo("interrupted; rerun the same command to resume", err=True)
        raise typer.Exit(130)


def split_ints(text: str | None, option: str) -> tuple[int, ...] | None:
    if text is None or text == "":
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{option} takes comma-separated integers, e.g. 1,16,31; got {text!r}") from None
