"""What counts as a whole number and as a real number in a config, for every component's
validation (a bool is neither, although Python counts it as an int)."""

from __future__ import annotations

import json
import math

import numpy as np

from dflash_common.errors import ConfigError


def is_int(value: object) -> bool:
    """A whole number: a Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: object, finite: bool = False) -> bool:
    """A number that is not NaN (nor infinite, with `finite`): int or float, not a bool."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    return math.isfinite(value) if finite else not math.isnan(value)


def check_choice(name: str, value: object, choices) -> None:
    """Refuse a value that is not one of a field's choices, naming the field and the choices."""
    if value not in choices:
        raise ConfigError(f"{name} {value!r} is unknown; use one of {', '.join(map(str, choices))}")


def text_problem(text: str) -> str | None:
    """Why a string is not text (a lone surrogate such as \\ud800, which a JSON escape can make and
    no tokenizer or UTF-8 file can hold), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"holds a lone surrogate {text[err.start]!r} at character {err.start}, which is not text"
    return None


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is beyond a float's range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not finite (NaN or Infinity), which JSON cannot hold")


MAX_OPTION_DEPTH = 32
"""Deepest nesting of lists and objects a JSON option may hold (options are flat settings; the
code walking a value recurses)."""


def nesting_depth(value) -> int:
    """How deeply a plain value nests lists and dicts (a flat list is 1), walked without recursion and
    no further than MAX_OPTION_DEPTH + 1 levels."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if depth <= MAX_OPTION_DEPTH:
                stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_json(text: str, option: str):
    """JSON text given in an option (--vllm-args, --storage-options, --grid and --set values): the
    one parser they share. Text that is not JSON raises json.JSONDecodeError (a caller may take it
    as a plain string); JSON Python cannot hold as values (a number of over 4,300 digits, one
    beyond a float's range, NaN, nesting too deep to parse) is a one-line ConfigError naming the
    option."""
    try:
        value = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise ConfigError(f"{option} is nested too deeply to parse ({len(text):,} characters); pass a flatter "
                          "value") from None
    except ValueError as err:  # a 5,000-digit integer, 1e999, NaN
        first = str(err).split(";")[0].splitlines()[0][:120] if str(err) else "a number Python cannot hold"
        raise ConfigError(f"{option} cannot be read ({first}); pass a smaller, finite number") from None
    if nesting_depth(value) > MAX_OPTION_DEPTH:
        raise ConfigError(f"{option} is nested more than {MAX_OPTION_DEPTH} levels deep; pass a flatter value")
    return value


def json_object(text: str | None, option: str) -> dict | None:
    """A JSON-object option such as --storage-options, or None when not given."""
    if not text:
        return None
    try:
        value = parse_json(text, option)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{option} {text[:200]!r} is not valid JSON ({err.msg} at character {err.pos}); "
                          f"pass an object, e.g. {option} '{{\"endpoint_url\": \"http://127.0.0.1:9000\"}}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{option} {text[:200]!r} is a JSON {type(value).__name__}, not an object; pass {{\"key\": value, ...}}")
    return value
