"""Test hook: SIGKILL this process at a named moment, to prove crash safety with real processes.

Set ``DFLASH_FAULT=POINT:N`` (several as ``POINT:N,POINT:M``) in the environment of a real
``dflash-cache build`` or ``dflash-train run`` process and it kills itself with SIGKILL (no
cleanup, no ``finally``, like a power cut or the OOM killer) the N-th time it reaches POINT:

| point                       | where                                                           |
|-----------------------------|-----------------------------------------------------------------|
| ``after_shard_files``       | a shard's data files are written and in place; no commit record  |
| ``after_commit_record``     | the shard's commit record is written; manifest not yet rewritten |
| ``during_manifest_write``   | a temporary manifest is written (local storage); not yet renamed |
| ``checkpoint_after_files``  | checkpoint weights, trainer state, config written; no COMPLETE   |
| ``checkpoint_before_rename``| the temporary checkpoint folder is complete; not yet renamed     |

Counts are per process and start at 1 (``during_manifest_write:1`` is the first manifest a build
writes). The tests in ``tests/test_reliability.py`` use it; production never sets the variable,
and then ``maybe_fault`` costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading

from dflash_cache.errors import ConfigError

ENV = "DFLASH_FAULT"
POINTS = ("after_shard_files", "after_commit_record", "during_manifest_write",
          "checkpoint_after_files", "checkpoint_before_rename")

_lock = threading.Lock()  # shards are written on a background thread
_plan: dict[str, int] | None = None
_hits: dict[str, int] = {}


def parse_faults(text: str) -> dict[str, int]:
    """'after_shard_files:3,during_manifest_write:1' -> {point: hit count to die at}."""
    plan: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        point, _, count = item.partition(":")
        if point not in POINTS or not count.isdigit() or int(count) < 1:
            raise ConfigError(f"{ENV}={text!r}: cannot read {item!r}; write POINT:N with N >= 1 and POINT one of {', '.join(POINTS)}")
        plan[point] = int(count)
    return plan


def maybe_fault(point: str) -> None:
    """SIGKILL this process if ``DFLASH_FAULT`` asks for it at this hit of ``point``."""
    global _plan
    if _plan is None:
        _plan = parse_faults(os.environ.get(ENV, ""))
    if point not in _plan:
        return
    with _lock:
        _hits[point] = _hits.get(point, 0) + 1
        if _hits[point] == _plan[point]:
            os.kill(os.getpid(), signal.SIGKILL)
