"""A sweep's grid: --grid keys and values, their combinations, the run names and the config each
combination sets."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from typing import Any, Iterable, Sequence

from dflash_common.errors import ConfigError
from dflash_common.knobs import set_path
from dflash_common.values import parse_json
from dflash_train.config import with_run_length
from dflash_train.options import find_knob, train_knobs
from dflash_train.settings.sweep_config import GridAxis, value_label

# Fields every run of a sweep must share: the cache and folders are the sweep's own, and the
# held-out sequences must be the same for the results to be comparable.
SHARED_FIELDS: dict[tuple[str, ...], str] = {
    ("cache",): "the sweep trains every run on one cache",
    ("out",): "run folders are named by the sweep",
    ("storage_options",): "the sweep reads one cache",
    ("eval_sequences",): "every run is evaluated on the same held-out sequences",
    ("data", "heldout_fraction"): "every run is evaluated on the same held-out split",
}

MAX_NAME_CHARS = 120
_SAFE_TOKEN = re.compile(r"[A-Za-z0-9._+-]+")


# The order grid keys are listed in an error: the sections a loss experiment varies first.
_LISTING_ORDER = ("loss", "noise", "optim", "model", "dspark", "dflash2", "data", None)


def resolve_grid_key(key: str) -> tuple[str, tuple[str, ...]]:
    """(canonical key, config path) of a grid key: a knob's short name or its dotted config path;
    the canonical key is the short name, so run names do not depend on the spelling."""
    knob = find_knob(key.strip())
    if knob is None:
        swept = sorted((k for k in train_knobs() if k.path not in SHARED_FIELDS),
                       key=lambda k: _LISTING_ORDER.index(k.section) if k.section in _LISTING_ORDER else len(_LISTING_ORDER))
        raise ConfigError(f"unknown grid key {key.strip()!r}; use a short key ({', '.join(k.name for k in swept)}) "
                          f"or a config field ({', '.join(k.dotted for k in swept)})")
    if knob.path in SHARED_FIELDS:
        raise ConfigError(f"grid key {key.strip()!r} cannot vary in a sweep ({SHARED_FIELDS[knob.path]}); "
                          "set it once with --set or the config file")
    return knob.name, knob.path


def split_values(text: str) -> list[str]:
    """Split "a,b,[1,2]" at the commas outside brackets, braces and double quotes."""
    parts, current, depth, quoted = [], [], 0, False
    for i, ch in enumerate(text):
        if ch == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and ch in "[{":
            depth += 1
        elif not quoted and ch in "]}":
            depth -= 1
        if ch == "," and depth == 0 and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts]


def parse_value(text: str) -> Any:
    """A grid value: JSON when it parses (0.3, 7, true, null, [0, 1]), else the plain string."""
    try:
        value = parse_json(text, f"--grid value {text[:40]!r}{'...' if len(text) > 40 else ''}")
    except json.JSONDecodeError:
        return text
    return _tuples(value)


def _tuples(value: Any) -> Any:
    # Config tuples (betas, sliding_layers, noise layers) arrive as JSON lists; tuples keep the
    # frozen configs hashable and compare equal to what config_from_dict builds.
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def parse_grid_item(text: str) -> GridAxis:
    """One --grid option, "key=v1,v2,...", as a GridAxis."""
    key, sep, values = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--grid takes key=value1,value2,..., got {text!r}; e.g. --grid loss=ce,kl")
    canonical, path = resolve_grid_key(key)
    raw = split_values(values)
    if any(not v for v in raw):
        raise ConfigError(f"--grid {text!r} has an empty value; separate values with single commas, e.g. {canonical}=a,b")
    return GridAxis(canonical, path, tuple(parse_value(v) for v in raw))


def parse_grid(items: Iterable[str]) -> tuple[GridAxis, ...]:
    """All --grid options; each config field may be swept by one option only."""
    axes = tuple(parse_grid_item(item) for item in items)
    seen: dict[tuple[str, ...], str] = {}
    for axis in axes:
        if axis.path in seen:
            raise ConfigError(f"grid key {axis.key!r} is given twice ({'.'.join(axis.path)}); "
                              f"put all its values in one --grid {axis.key}=a,b,...")
        seen[axis.path] = axis.key
    return axes


# ----------------------------------------------------------------------------- expansion and names


def expand_grid(axes: Sequence[GridAxis]) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination as ((key, value), ...) in grid order; the first key varies slowest."""
    return [tuple(zip((a.key for a in axes), combo)) for combo in itertools.product(*(a.values for a in axes))]


def _safe_token(text: str) -> str:
    if _SAFE_TOKEN.fullmatch(text):
        return text
    # Keep what is readable and add a hash of the original, so distinct values stay distinct.
    slug = re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-") or "value"
    return f"{slug}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"


def run_name(assignment: Sequence[tuple[str, Any]]) -> str:
    """Folder name of one combination: (("loss", "kl"), ("noise", "cosine")) -> "loss-kl_noise-cosine".

    Only letters, digits and ``._+-`` appear, so the name is safe on every filesystem and object
    store; it depends on the values alone, so rerunning the same sweep finds the same folders.
    Other characters become "-" plus a hash of the value, so distinct values keep distinct names.
    """
    name = "_".join(f"{_safe_token(key)}-{_safe_token(value_label(value))}" for key, value in assignment)
    if len(name) > MAX_NAME_CHARS:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[:MAX_NAME_CHARS - 11]}-{digest}"
    return name


def run_overrides(axes: Sequence[GridAxis], assignment: Sequence[tuple[str, Any]]) -> dict:
    """Nested config values that one combination sets."""
    out: dict = {}
    for axis, (_, value) in zip(axes, assignment):
        if axis.path:
            set_path(out, axis.path, value)
        if axis.extras:
            for dotted, extra in axis.extras[axis.values.index(value)]:
                set_path(out, dotted.split("."), extra)
    return with_run_length(out)
