"""Config fields: the one declaration of everything a command may be given.

The words: a *field* is a leaf field of a config dataclass (``teacher.top_k``, ``loss.kind``,
``steps``), the one concept in code, docs and errors; its *option* is how a command line spells it
(``--top-k``); a ``Knob`` is the code's description of one field (its path, short name, type,
default and doc). The field says everything else needs: the type, the default, the docstring below it and, in the
field's metadata,
- ``name``: a short name where the field name alone would be ambiguous or unclear (``loss.kind`` is
  ``loss``, ``teacher.name_or_path`` is ``teacher``);
- ``aliases``: older names the command line still takes (``drafter_layers``);
- ``parse`` and ``show``: for a field the command line writes as text of its own, the function
  reading that text and the one writing a value the same way (sizes: ``512MB``);
- ``repeat``: a list field the command line gives by repeating the option (``--endpoint A
  --endpoint B``) rather than as comma-separated text.
From that come the command-line option (``--top-k``), the config built from the options, the
``--set`` paths and sweep keys of a train run, and the option tables in docs/options.md (``make docs``
rewrites them; a test fails when one is stale). Torch-free, so every command line can use it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dflash_common.errors import ConfigError
from dflash_common.field_docs import field_docs
from dflash_common.values import json_object


@dataclass(frozen=True)
class Knob:
    """The description of one leaf field of a config, as the command line, sweeps and the docs see it."""

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

    aliases: tuple[str, ...] = ()
    """Older short names the command line still takes."""

    reader: Callable[[str], Any] | None = None
    """Reads the command line's text of the value (metadata "parse"), when the field has its own."""

    writer: Callable[[Any], str] | None = None
    """Writes a value as the command line would (metadata "show"), for the default shown."""

    repeat: bool = False
    """A list given by repeating the option, not as comma-separated text."""

    optional_section: bool = False
    """It sits in a section that may be None (then even a field without a default is not required)."""

    @property
    def dotted(self) -> str:
        """The path as --set and config files write it: "loss.kind"."""
        return ".".join(self.path)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        """The option's flag and its older names."""
        return (self.flag,) + tuple("--" + alias.replace("_", "-") for alias in self.aliases)

    @property
    def section(self) -> str | None:
        return self.path[0] if len(self.path) > 1 else None

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING and not self.optional_section

    @property
    def value_type(self) -> Any:
        """The annotation without its None alternative: int, float, str, bool, a tuple or dict."""
        return _without_none(self.hint)

    @property
    def is_text(self) -> bool:
        """Whether the command line passes it as text to parse (lists, tables, sizes) rather than a plain value."""
        kind = self.value_type
        return self.reader is not None or (not self.repeat and (typing.get_origin(kind) in (tuple, dict) or kind is dict))

    def value(self, given: Any) -> Any:
        """A command-line option's value as the field takes it (text of lists and tables parsed)."""
        if self.repeat:
            return tuple(given)
        return self.parse(given) if isinstance(given, str) and self.is_text else given

    def parse(self, text: str) -> Any:
        """A command-line value: the field's own reader's, comma-separated entries for a list field,
        a JSON object for a table field, anything else as given (the command line converted it)."""
        if self.reader is not None:
            return self.reader(text)
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
            return "required" if self.required else "-"
        if value is None or value == ():
            return "-"
        if self.writer is not None:
            return self.writer(value)
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, tuple):
            return ",".join(str(v) for v in value)
        return str(value)


def _without_none(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return args[0] if union and len(args) == 1 else hint


def _allows_none(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def section_class(hint: Any) -> type | None:
    """The config dataclass a field's annotation names (a section of its config), else None."""
    kind = _without_none(hint)
    return kind if isinstance(kind, type) and dataclasses.is_dataclass(kind) else None


def config_knobs(cls: type, names: Sequence[str] | None = None, panel: str = "",
                 sections: Mapping[str, type] | None = None, prefix: tuple[str, ...] = (),
                 exclude: Sequence[str] = (), optional: bool = False) -> tuple[Knob, ...]:
    """The knobs of a config dataclass's fields (only `names`, when given; never the dotted paths
    in `exclude`), in field order; a field whose type is a config dataclass (or one named in
    `sections`) is a section whose own fields are the knobs. Names are unique (a field whose name
    another section already uses must declare a metadata name) and every field has a docstring:
    both are checked here."""
    hints, docs, knobs = typing.get_type_hints(cls), field_docs(cls), []
    unknown = sorted(set(names or ()) - set(hints))
    if unknown:
        raise ConfigError(f"{cls.__name__} has no field(s) {unknown}; name its fields")
    for f in dataclasses.fields(cls):
        path = prefix + (f.name,)
        if (names is not None and f.name not in names) or ".".join(path) in exclude:
            continue
        # a section unless the field reads its own text (a table given as one JSON option)
        own_text = "parse" in f.metadata
        section = (sections or {}).get(f.name) or (section_class(hints[f.name]) if sections is None and not own_text else None)
        if section is not None:
            knobs.extend(config_knobs(section, panel=panel, prefix=path, exclude=exclude,
                                      optional=optional or _allows_none(hints[f.name])))
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        meta = f.metadata
        knobs.append(Knob(path, meta.get("name", f.name), hints[f.name], default, docs.get(f.name, ""), panel,
                          aliases=tuple(meta.get("aliases", ())), reader=meta.get("parse"), writer=meta.get("show"),
                          repeat=bool(meta.get("repeat")), optional_section=optional))
    if not prefix:
        check_names(knobs)
    return tuple(knobs)


def check_names(knobs: Sequence[Knob]) -> tuple[Knob, ...]:
    """The knobs of one command, checked: each has its own name (older names included) and a docstring."""
    seen: dict[str, str] = {}
    for knob in knobs:
        for name in (knob.name,) + knob.aliases:
            if name in seen:
                raise ConfigError(f"config fields {seen[name]} and {knob.dotted} are both named {name!r}; give one "
                                  'field(metadata={"name": ...}) a distinct short name')
            seen[name] = knob.dotted
        if not knob.doc:
            raise ConfigError(f"config field {knob.dotted} has no docstring; write one under the field")
    return tuple(knobs)


def set_path(values: dict, path: Sequence[str], value: Any) -> None:
    """Put `value` at a dotted path of nested config values, making the sections on the way (a
    tuple goes in as a list, as a config file would hold it)."""
    *sections, last = path
    for section in sections:
        values = values.setdefault(section, {})
    values[last] = list(value) if isinstance(value, tuple) else value


def nested_values(knobs: Sequence[Knob], options: Mapping[str, Any]) -> dict:
    """Nested config values from command-line options {knob name: value, None when not given}."""
    by_name, out = {k.name: k for k in knobs}, {}
    for name, value in options.items():
        if value is not None:
            set_path(out, by_name[name].path, by_name[name].value(value))
    return out


def type_problem(value: Any, hint: Any) -> str | None:
    """What is wrong with a plain config value for a field annotation, or None when it fits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        problems = [type_problem(value, arg) for arg in args]
        return None if any(p is None for p in problems) else next(p for p in problems if p)
    if hint is type(None):
        return None if value is None else "must be empty (null)"
    if hint is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            return "must be a whole number"
        # torch (seeds, sizes, steps) holds 64-bit integers; a larger one was an OverflowError deep in a run
        return None if -2**63 <= value < 2**63 else "must be a whole number below 2**63"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        return None if math.isfinite(value) else "must be a finite number"
    if hint is str:
        return None if isinstance(value, str) else "must be a string"
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return "must be a list"
        element_hints = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(element_hints) != len(value):
            return f"must be a list of {len(element_hints)}"
        for element, element_hint in zip(value, element_hints):
            problem = type_problem(element, element_hint)
            if problem:
                return f"must be a list whose entries {problem.removeprefix('must be ')}"
        return None
    if origin is dict or hint is dict:
        return None if isinstance(value, dict) else "must be a table (a JSON object)"
    return None  # Any and other annotations are the dataclass's own business


def make_config(cls: type, values: Mapping[str, Any], *, where: str = "", fix: str = "fix {path}", **fixed: Any) -> Any:
    """A config from nested plain values (a config file's, nested_values'), checked: no unknown
    field, every value of its field's type (lists become tuples); a section (a field whose type is
    a config dataclass) is built from its own table, an empty one (null) from its defaults; a field
    left out keeps its default. `where` is the section's dotted path in the messages, `fix` how a
    user corrects a value ({path}: the field's dotted path). `fixed` fields (not options: a rank
    from the environment) are added as given."""
    if not isinstance(values, Mapping):
        example = f"{where}.{dataclasses.fields(cls)[0].name}=..."
        raise ConfigError(f"the {where} section is {values!r}, not a table of fields; write them as [{where}] in "
                          f"TOML or an object in JSON, e.g. {example}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {where or cls.__name__.removesuffix('Config').lower()} field(s) {unknown}; known: {sorted(known)}")
    hints, given = typing.get_type_hints(cls), {}
    for name, value in values.items():
        path = f"{where}.{name}" if where else name
        section = section_class(hints[name])
        if section is not None and not isinstance(value, section) and not (value is None and _allows_none(hints[name])):
            given[name] = make_config(section, value or {}, where=path, fix=fix)
            continue
        problem = type_problem(value, hints[name])
        if problem:
            shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:40]}...({len(repr(value))} characters)"
            raise ConfigError(f"{path} = {shown} {problem}; {fix.format(path=path)}")
        given[name] = tuple(value) if isinstance(value, list) else value
    return cls(**given, **fixed)


def readme_table(knobs: Sequence[Knob]) -> str:
    """A README table of options, one row per knob."""
    rows = ["| option | config field | default | meaning |", "| --- | --- | --- | --- |"]
    for knob in knobs:
        doc, default = (" ".join(text.split()).replace("|", "\\|") for text in (knob.doc, knob.shown_default()))
        rows.append(f"| `{'` / `'.join(knob.flags)}` | `{knob.dotted}` | {default} | {doc} |")
    return "\n".join(rows)


def with_table(text: str, begin: str, end: str, table: str) -> str:
    """Text with the part between the markers `begin` and `end` replaced by `table`."""
    if begin not in text or end not in text:
        raise ConfigError(f"the README has no option table between {begin!r} and {end!r}; add the markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{table}\n{end}{tail}"
