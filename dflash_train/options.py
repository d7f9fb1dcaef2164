"""Every setting of a train run as a knob, read from TrainConfig's fields: the one declaration.

A knob is a leaf field of TrainConfig (``loss.kind``, ``optim.lr``, ``steps``). Its field says
everything else needs: the type, the default, the docstring below it and, where the field name
alone would be ambiguous or unclear, a short ``name`` in the field's metadata (``loss.kind`` is
``loss``, ``data.seed`` is ``data_seed``). From that come the command-line option
(``--loss``), the ``--set`` path, the sweep's grid key, and the option table in the README
(``make docs`` rewrites it; a test fails when it is stale). What any config's knobs share lives
in dflash_common.knobs; this module holds what is a train run's own.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from dflash_common.errors import ConfigError
from dflash_common.knobs import Knob, check_names, config_knobs, nested_values, set_path
from dflash_common.values import parse_json
from dflash_train.config import with_run_length
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.eval_config import DATA_OPTIONS, SPEC_OPTIONS, DecodingConfig, EvalConfig, GenerateConfig
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.settings.train_config import SECTIONS, TrainConfig


@functools.cache
def train_knobs() -> tuple[Knob, ...]:
    """Every knob of TrainConfig, in field order."""
    return config_knobs(TrainConfig, sections=SECTIONS)


def find_knob(key: str) -> Knob | None:
    """The knob a key names: its short name ("loss") or its dotted path ("loss.kind")."""
    return next((k for k in train_knobs() if key in (k.name, k.dotted)), None)


def option_overrides(options: Mapping[str, Any]) -> dict:
    """A train config's overrides from its command-line options; a given run length replaces the
    other one of a config file (steps and epochs exclude each other)."""
    return with_run_length(nested_values(train_knobs(), options))


def set_overrides(items: Sequence[str]) -> dict:
    """Nested config overrides from --set items "section.key=value" (a JSON value, else the text)."""
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set takes section.key=value, got {item!r}; e.g. --set loss.chunk_positions=1024")
        try:
            value = parse_json(text, f"--set {key.strip()}=...")
        except json.JSONDecodeError:
            value = text
        set_path(out, key.strip().split("."), value)
    return out


# --- the measuring commands: eval and generate share DecodingConfig's knobs ---------------------


def decoding_knobs() -> tuple[Knob, ...]:
    """DecodingConfig's options (SpecConfig's among them), under the path ("decoding", ...)."""
    own = [f.name for f in dataclasses.fields(DecodingConfig) if f.name != "spec"]
    return (config_knobs(DecodingConfig, names=own, panel="decoding settings", prefix=("decoding",))
            + config_knobs(SpecConfig, names=SPEC_OPTIONS, panel="decoding settings", prefix=("decoding", "spec")))


def eval_knobs() -> tuple[Knob, ...]:
    """Every option of `dflash-train eval`, from EvalConfig's, DecodingConfig's and DataConfig's fields."""
    own = [f.name for f in dataclasses.fields(EvalConfig) if f.name not in ("decoding", "data")]
    data = tuple(_run_default(k) for k in config_knobs(DataConfig, names=DATA_OPTIONS, panel="offline settings",
                                                       prefix=("data",)))
    return check_names(config_knobs(EvalConfig, names=own, panel="eval settings") + decoding_knobs() + data)


def generate_knobs() -> tuple[Knob, ...]:
    """Every option of `dflash-train generate`: its prompt and the decoding settings eval has too."""
    return check_names(config_knobs(GenerateConfig, names=("prompt",)) + decoding_knobs())


def _run_default(knob: Knob) -> Knob:
    # a drafter is evaluated on the held-out split of its own run, which its config.json names
    if knob.name != "heldout_fraction":
        return knob
    return dataclasses.replace(knob, default=None, doc="Held-out fraction (default: the training run's, from its config.json).")
