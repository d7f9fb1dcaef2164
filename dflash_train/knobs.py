"""Every setting of a train run as a knob, read from TrainConfig's fields: the one declaration.

A knob is a leaf field of TrainConfig (``loss.kind``, ``optim.lr``, ``steps``). Its field says
everything else needs: the type, the default, the docstring below it and, where the field name
alone would be ambiguous or unclear, a short ``name`` in the field's metadata (``loss.kind`` is
``loss``, ``data.seed`` is ``data_seed``). From that come the command-line option
(``--loss``), the ``--set`` path, the sweep's grid key, and the option table in the README
(``make docs`` rewrites it; a test fails when it is stale).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_common.errors import ConfigError
from dflash_common.field_docs import field_docs
from dflash_common.values import json_object
from dflash_train.config import SECTIONS, TrainConfig, set_path, with_run_length
from dflash_train.settings.data import DataConfig
from dflash_train.settings.evaluation import DATA_OPTIONS, SPEC_OPTIONS, DecodingConfig, EvalConfig, GenerateConfig
from dflash_train.settings.speculative import SpecConfig

README_BEGIN = "<!-- train options: made by `python -m dflash_train.knobs README.md` from the config fields -->"
README_END = "<!-- end of train options -->"


@dataclass(frozen=True)
class Knob:
    """One leaf field of TrainConfig, as the command line, sweeps and the docs see it."""

    path: tuple[str, ...]
    """Where it sits in the config, e.g. ("loss", "kind") or ("steps",)."""

    name: str
    """Its one short name: the option --NAME (underscores as dashes) and the sweep's grid key."""

    hint: Any
    """The field's type annotation."""

    default: Any
    """The dataclass default (dataclasses.MISSING for a required field)."""

    doc: str
    """The docstring under the field."""

    panel: str = ""
    """Where --help lists it (default: by section, "run settings" for the top level)."""

    repeat: bool = False
    """A list field given by repeating its option (--temperature 0 --temperature 1), not as comma-separated text."""

    @property
    def dotted(self) -> str:
        """The path as --set and config files write it: "loss.kind"."""
        return ".".join(self.path)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def section(self) -> str | None:
        return self.path[0] if len(self.path) > 1 else None

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    @property
    def value_type(self) -> Any:
        """The annotation without its None alternative: int, float, str, bool, a tuple or dict."""
        args = [a for a in typing.get_args(self.hint) if a is not type(None)]
        union = typing.get_origin(self.hint) in (typing.Union, types.UnionType)
        return args[0] if union and len(args) == 1 else self.hint

    @property
    def is_text(self) -> bool:
        """Whether the command line passes it as text to parse (lists and tables) rather than a plain value."""
        kind = self.value_type
        return typing.get_origin(kind) in (tuple, dict) or kind is dict

    def value(self, given: Any) -> Any:
        """A command-line option's value as the field takes it (text of lists and tables parsed,
        a repeated option's values as a tuple)."""
        if self.repeat:
            return tuple(given)
        return self.parse(given) if isinstance(given, str) and self.is_text else given

    def parse(self, text: str) -> Any:
        """A command-line value: comma-separated entries for a list field, a JSON object for a table
        field, anything else as given (the command line already converted it)."""
        kind = self.value_type
        if typing.get_origin(kind) is tuple:
            element = typing.get_args(kind)[0]
            entries = [part.strip() for part in text.split(",") if part.strip()]
            try:
                return tuple(element(entry) for entry in entries)
            except ValueError:
                example = {int: "0,1", float: "0.9,0.95"}.get(element, "a,b")
                raise ConfigError(f"{self.flag} takes comma-separated {element.__name__} values, e.g. {example}; "
                                  f"got {text!r}") from None
        if typing.get_origin(kind) is dict or kind is dict:
            return json_object(text, self.flag)
        return text

    def shown_default(self) -> str:
        """The default as a help text or the README shows it."""
        value = self.default
        if value is dataclasses.MISSING:
            return "required"
        if value is None or value == ():
            return "-"
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, tuple):
            return ",".join(str(v) for v in value)
        return str(value)


def config_knobs(cls: type, names: Sequence[str] | None = None, panel: str = "",
                 sections: Mapping[str, type] | None = None, prefix: tuple[str, ...] = ()) -> tuple[Knob, ...]:
    """The knobs of a config dataclass's fields (only `names`, when given), in field order; a field
    in `sections` is a nested config whose own fields are the knobs. Names are unique (a field
    whose name another section already uses must declare a metadata name) and every field has
    a docstring: both are checked here."""
    hints, docs, knobs = typing.get_type_hints(cls), field_docs(cls), []
    unknown = sorted(set(names or ()) - set(hints))
    if unknown:
        raise ConfigError(f"{cls.__name__} has no field(s) {unknown}; name its fields")
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        if sections and f.name in sections:
            knobs.extend(config_knobs(sections[f.name], panel=panel, prefix=(f.name,)))
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        knobs.append(Knob(prefix + (f.name,), f.metadata.get("name", f.name), hints[f.name], default, docs.get(f.name, ""),
                          panel, f.metadata.get("repeat", False)))
    return check_names(knobs) if not prefix else tuple(knobs)


@functools.cache
def train_knobs() -> tuple[Knob, ...]:
    """Every knob of TrainConfig, in field order."""
    return config_knobs(TrainConfig, sections=SECTIONS)


def check_names(knobs: Sequence[Knob]) -> tuple[Knob, ...]:
    """The knobs of one command, checked: each has its own name and a docstring."""
    seen: dict[str, str] = {}
    for knob in knobs:
        if knob.name in seen:
            raise ConfigError(f"config fields {seen[knob.name]} and {knob.dotted} are both named {knob.name!r}; give one "
                              'field(metadata={"name": ...}) a distinct short name')
        if not knob.doc:
            raise ConfigError(f"config field {knob.dotted} has no docstring; write one under the field")
        seen[knob.name] = knob.dotted
    return tuple(knobs)


def find_knob(key: str) -> Knob | None:
    """The knob a key names: its short name ("loss") or its dotted path ("loss.kind")."""
    return next((k for k in train_knobs() if key in (k.name, k.dotted)), None)


def nested_values(knobs: Sequence[Knob], options: Mapping[str, Any]) -> dict:
    """Nested config values from command-line options {knob name: value, None when not given}."""
    by_name, out = {k.name: k for k in knobs}, {}
    for name, value in options.items():
        if value is not None:
            set_path(out, by_name[name].path, by_name[name].value(value))
    return out


def config_from_values(cls: type, values: Mapping[str, Any]):
    """A config dataclass from nested values (nested_values'); a field whose type is a dataclass
    is built from its own table, so what is not given keeps its default at every level."""
    hints = typing.get_type_hints(cls)
    built = {name: config_from_values(hints[name], value) if dataclasses.is_dataclass(hints[name])
             else tuple(value) if isinstance(value, list) else value  # set_path keeps lists as a config file does
             for name, value in values.items()}
    return cls(**built)


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
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        except (ValueError, RecursionError) as err:  # a 5,000-digit integer, nesting too deep to parse
            first = str(err).split(";")[0][:100] if str(err) else "nested too deeply"
            raise ConfigError(f"--set {key.strip()}=... cannot be read ({first}); pass a smaller value") from None
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


def readme_table() -> str:
    """The README's table of train options, one row per knob."""
    rows = ["| option | config field | default | meaning |", "| --- | --- | --- | --- |"]
    for knob in train_knobs():
        doc, default = (text.replace("|", "\\|") for text in (knob.doc, knob.shown_default()))
        rows.append(f"| `{knob.flag}` | `{knob.dotted}` | {default} | {doc} |")
    return "\n".join(rows)


def readme_with_table(text: str) -> str:
    """README text with the part between the markers replaced by the current table."""
    if README_BEGIN not in text or README_END not in text:
        raise ConfigError(f"the README has no train option table between {README_BEGIN!r} and {README_END!r}; add the markers")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_BEGIN}\n{readme_table()}\n{README_END}{tail}"


if __name__ == "__main__":
    for path in sys.argv[1:] or ["README.md"]:
        readme = Path(path)
        readme.write_text(readme_with_table(readme.read_text()))
        print(f"{path}: train option table rewritten ({len(train_knobs())} options)")
