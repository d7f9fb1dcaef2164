"""A train run's TrainConfig (dflash_train.settings.train_config) built from config files and overrides,
merged, and compared with a saved one on resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_common.errors import ConfigError
from dflash_common.knobs import make_config
from dflash_common.settings_files import load_settings_file
from dflash_train.settings.data_config import OPERATIONAL_FIELDS as DATA_OPERATIONAL
from dflash_train.settings.loss_config import OPERATIONAL_FIELDS as LOSS_OPERATIONAL
from dflash_train.settings.model_config import MODEL_OPERATIONAL
from dflash_train.settings.train_config import TrainConfig


def config_from_dict(values: dict) -> TrainConfig:
    """A TrainConfig from nested plain values (a config file, or a saved config.json)."""
    if not isinstance(values, dict):
        raise ConfigError(f"a train config is a table of options, not {type(values).__name__} {values!r}; "
                          "write a TOML file or a JSON object")
    return make_config(TrainConfig, values, fix="fix it in the config file or --set {path}=...")


def with_run_length(overrides: dict) -> dict:
    """Overrides in which a given steps (or epochs) also clears the other: the two exclude each other,
    so one given on the command line or by a sweep axis replaces the other one of a config file."""
    steps, epochs = overrides.get("steps"), overrides.get("epochs")
    if steps is not None and epochs is not None:
        raise ConfigError(f"--steps {steps} and --epochs {epochs} both set the run length; give one")
    if epochs is not None:
        return {**overrides, "steps": None}
    if steps is not None:
        return {**overrides, "epochs": None}
    return overrides


def read_config_file(path: str) -> dict:
    """Plain nested values from a .toml or .json config file."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {path} does not exist")
    if p.suffix not in (".toml", ".json"):
        raise ConfigError(f"config file {path} is neither .toml nor .json; write the config as TOML or JSON "
                          "(YAML is not read)")
    if not p.is_file():
        raise ConfigError(f"config file {path} is not a regular file; pass a .toml or .json file")
    values = load_settings_file(path, f"config file {path}", fix="fix the file, or pass another --config")
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} holds a JSON {type(values).__name__}, not a table of options; write an "
                          'object such as {"optim": {"lr": 0.001}}')
    return values


def merge(base: dict, overrides: dict) -> dict:
    """Nested update: overrides win, sections merge key by key."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif isinstance(value, dict) and out.get(key) is not None:
            raise ConfigError(f"the {key} section is {out[key]!r}, not a table of fields; write them as [{key}] "
                              "in TOML or an object in JSON")
        else:
            out[key] = value
    return out


# Settings (dotted paths) that change how a run is executed or logged, not what it learns: a
# checkpoint resumes with other values of these, and a sweep counts a finished run made with other
# values as its combination.
OPERATIONAL_PATHS = frozenset({"out", "device", "strategy", "grad_reduce_dtype", "wrap_single_rank", "tensorboard", "log_every", "save_every", "keep_checkpoints",
                               "collective_timeout", "save_timeout",
                               "storage_options", *(f"model.{name}" for name in MODEL_OPERATIONAL),
                               *(f"data.{name}" for name in DATA_OPERATIONAL),
                               *(f"loss.{name}" for name in LOSS_OPERATIONAL)})
# What a resume may change besides: the cache's URL (its fingerprint is checked), the run's
# length, its evaluation and the seed of the initial weights (the checkpoint's weights replace
# them). A sweep does compare these: a run of other length or seed is another result.
# data.partitions: 0 keeps the run's own partitions (the loader state's), any other value must equal
# them (resolve_partitions refuses it otherwise).
RESUME_MAY_CHANGE = OPERATIONAL_PATHS | {"cache", "steps", "epochs", "eval_sequences", "seed", "data.partitions"}


def flat_config(values: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted path: value} (storage_options stays one value)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and key != "storage_options":
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


PREDATED = {"data.anchors": "random"}
"""Settings whose default changed after runs were saved: a saved config without one had this
value, not today's default (a run of the seed recipe resumes only as it was trained)."""


def config_differences(saved: dict, wanted: dict, free: frozenset[str] = OPERATIONAL_PATHS) -> list[tuple[str, Any, Any]]:
    """(path, saved value, wanted value) of every setting outside `free` in which a saved config
    (a run's config.json, a checkpoint's) differs from the wanted one; a setting the saved config
    predates counts as its default then (PREDATED), else as today's."""
    defaults = {**flat_config(json.loads(json.dumps(TrainConfig(cache="", out="").to_dict()))), **PREDATED}
    a = {**defaults, **flat_config(json.loads(json.dumps(saved)))}
    b = flat_config(json.loads(json.dumps(wanted)))
    return [(k, a.get(k), b.get(k)) for k in sorted((set(a) | set(b)) - free) if a.get(k) != b.get(k)]
