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


def json_object(text: str | None, option: str) -> dict | None:
    """A JSON-object option such as --storage-options, or None when not given."""
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
