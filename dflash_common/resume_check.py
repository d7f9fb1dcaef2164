"""Whether a resumed job asks for what the earlier one did: one comparison, one way of saying it,
for the build, stage 0 and the trainer."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def shown(value: Any, limit: int = 160) -> str:
    """A setting's value for a one-line message: a string as it is, anything else as JSON; clipped."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_difference(earlier: Mapping, now: Mapping, keys: Iterable[str], defaults: Mapping | None = None,
                     view: Callable[[Mapping, str], Any] | None = None, earlier_name: str = "earlier run",
                     now_name: str = "this run") -> str | None:
    """The first of `keys` whose value differs between an earlier record and this job's, said as
    "KEY differs (earlier run: A, this run: B)", or None. A key the earlier record lacks counts as
    `defaults[key]` (records written before the key existed); `view` picks what is compared of a
    value (e.g. a teacher's hashes, not its path)."""
    defaults = defaults or {}
    view = view or (lambda record, key: record.get(key, defaults.get(key)))
    for key in keys:
        if view(earlier, key) != view(now, key):
            return (f"{key} differs ({earlier_name}: {shown(earlier.get(key, defaults.get(key)))}, "
                    f"{now_name}: {shown(now.get(key))})")
    return None
