"""Reading the small JSON and TOML files dflash is given or finds (a --config, a manifest, a
teacher's or drafter's config.json): the one reader they all go through, so a file that never
ends (a link to /dev/zero), a huge one, one that is not UTF-8, nested too deep to parse, or
holding numbers Python refuses (a 5,000-digit integer) is one line naming the file, not a memory
blow-up or a traceback."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any, Callable

from dflash_common.errors import ConfigError, DFlashError

# Far above any settings file or manifest dflash writes (a 100,000-shard manifest is ~50 MB, so
# a manifest gets its own, larger bound), far below what a process can hold.
SETTINGS_BYTES = 8 << 20
MANIFEST_BYTES = 64 << 20


# A JSON string (the unrolled form of "(?:[^"\\]|\\.)*", linear and fast), and every byte but
# brackets: what is left of a line without them is its nesting structure.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(line: bytes) -> int:
    """How deeply the JSON text `line` nests arrays and objects (`{}` is 1, `{"a": [1]}` is 2).

    Counted on the raw bytes without parsing (strings removed, then a running count of the
    brackets left), so it is linear and safe on any input; for invalid JSON it is a best guess.
    """
    brackets = _JSON_STRING.sub(b"", line).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    import numpy as np

    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), np.int32(1), np.int32(-1))
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def read_bounded(open_binary: Callable[[], Any], what: str, limit: int = SETTINGS_BYTES,
                 error: type[DFlashError] = ConfigError, fix: str = "check the path") -> bytes:
    """At most `limit` bytes of a file opened by `open_binary()`; a longer one is refused unread."""
    with open_binary() as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{what} is larger than {limit >> 20} MiB (or never ends, like a link to /dev/zero), so it was "
                    f"not read; {fix}")
    return data


def parse_settings(data: bytes, what: str, kind: str = "json", error: type[DFlashError] = ConfigError,
                   fix: str = "fix or replace the file") -> Any:
    """JSON or TOML text as plain values; anything unparsable is `error` naming `what`."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{what} is not UTF-8 text (byte {err.start} is 0x{data[err.start]:02x}; a binary file?); {fix}") from None
    try:
        if kind == "toml":
            return tomllib.loads(text)
        # NaN and Infinity are not JSON: Python accepts them, every other reader refuses them
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise error(f"{what} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); {fix}") from None
    except tomllib.TOMLDecodeError as err:
        raise error(f"{what} is not valid TOML ({err}); {fix}") from None
    except RecursionError:
        raise error(f"{what} is nested too deeply to parse; {fix}") from None
    except ValueError as err:  # a number Python will not convert (over 4,300 digits), NaN
        raise error(f"{what} cannot be parsed ({str(err).splitlines()[0][:160]}); {fix}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def load_settings_file(path: str, what: str | None = None, kind: str | None = None, limit: int = SETTINGS_BYTES,
                       error: type[DFlashError] = ConfigError, fix: str = "fix or replace the file", fs=None) -> Any:
    """A local (or, with `fs`, fsspec) JSON or TOML file (kind from the suffix unless given), read
    through read_bounded and parse_settings."""
    what = what or f"{path}"
    kind = kind or ("toml" if str(path).endswith(".toml") else "json")
    opener = (lambda: fs.open(path, "rb")) if fs is not None else (lambda: open(path, "rb"))
    return parse_settings(read_bounded(opener, what, limit, error, fix), what, kind, error, fix)
