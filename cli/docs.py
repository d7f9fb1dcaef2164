"""`make docs`: the option tables of docs/options.md, made from the config fields
(tests/test_knobs.py fails when one is stale). Run as `python -m cli.docs docs/options.md`."""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_build.settings.build_config import build_knobs
from dflash_common.knobs import readme_table, with_table
from dflash_regenerate.settings.regenerate_config import regenerate_knobs
from dflash_train.options import train_knobs

# {command: its knobs}: each has a table between the markers below in docs/options.md
TABLES = {"train": train_knobs, "build": build_knobs, "regenerate": regenerate_knobs}


def markers(command: str) -> tuple[str, str]:
    return f"<!-- {command} options: made by `make docs` from the config fields -->", f"<!-- end of {command} options -->"


def with_tables(text: str) -> str:
    """The text with every option table replaced by the one the config fields make now."""
    for command, knobs in TABLES.items():
        text = with_table(text, *markers(command), readme_table(knobs()))
    return text


if __name__ == "__main__":
    for path in sys.argv[1:] or ["docs/options.md"]:
        page = Path(path)
        page.write_text(with_tables(page.read_text()))
        print(f"{path}: option tables of {', '.join(TABLES)} rewritten")
