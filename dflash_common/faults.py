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

``DFLASH_FAULT_SLEEP=POINT:S`` (same form, ``@R`` too) makes the process sleep S seconds each time
it reaches POINT instead: a slow disk, e.g. a checkpoint whose write and fsync outlast a timeout.

Counts are per process and start at 1 (``during_manifest_write:1`` is the first manifest a build
writes). ``POINT:N@R`` fires only in the process whose ``RANK`` is R (read as the build reads it,
unset meaning 0), so one rank of a ``torchrun`` launch can die while the others carry on until the
launcher tears them down; a point without ``@R`` fires in every rank.

With ``DFLASH_FAULT_GATE=PATH`` a process that reaches its fault waits there until PATH exists
(at most ``GATE_TIMEOUT_S``, so a gate never opened cannot leave an orphan running) and only then
dies. ``{rank}`` in PATH stands for the process's rank, so a test can hold every rank at its own
fault and open one gate at a time: which rank dies first, and where the others stand when the
launcher tears them down, is then fixed by the test instead of by the scheduler. The tests in
``tests/test_reliability.py`` and ``tests/test_distributed_build.py`` use it; production never
sets the variable, and then ``maybe_fault`` costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from dflash_common.errors import ConfigError

ENV = "DFLASH_FAULT"
SLEEP_ENV = "DFLASH_FAULT_SLEEP"
RANK_ENV = "RANK"
GATE_ENV = "DFLASH_FAULT_GATE"
GATE_TIMEOUT_S = 120.0
POINTS = ("after_shard_files", "after_commit_record", "during_manifest_write",
          "checkpoint_after_files", "checkpoint_before_rename")

_lock = threading.Lock()  # shards are written on a background thread
_plan: dict[str, int] | None = None
_sleeps: dict[str, int] | None = None
_hits: dict[str, int] = {}


def parse_faults(text: str, rank: int = 0, env: str = ENV) -> dict[str, int]:
    """'after_shard_files:3,during_manifest_write:1@1' -> {point: hit count to die at (seconds to
    sleep, for SLEEP_ENV)}, keeping only the items meant for ``rank`` (those without ``@R`` are
    meant for every rank)."""
    plan: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        spec, at, target = item.partition("@")
        point, _, count = spec.partition(":")
        if (point not in POINTS or not count.isdigit() or int(count) < 1
                or (at and not target.isdigit())):
            raise ConfigError(f"{env}={text!r}: cannot read {item!r}; write POINT:N or POINT:N@RANK with N >= 1, "
                              f"RANK >= 0 and POINT one of {', '.join(POINTS)}")
        if not at or int(target) == rank:
            plan[point] = int(count)
    return plan


def _own_rank() -> int:
    text = os.environ.get(RANK_ENV, "0")
    if not text.isdigit():
        raise ConfigError(f"{RANK_ENV}={text!r} is not a rank; set it to an integer >= 0 or unset it")
    return int(text)


def _wait_for_gate() -> None:
    gate = os.environ.get(GATE_ENV)
    if not gate:
        return
    gate = gate.replace("{rank}", str(_own_rank()))
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)


def maybe_fault(point: str) -> None:
    """SIGKILL this process if ``DFLASH_FAULT`` asks for it at this hit of ``point``; first sleep
    if ``DFLASH_FAULT_SLEEP`` asks for that at ``point``."""
    global _plan, _sleeps
    if _sleeps is None:
        text = os.environ.get(SLEEP_ENV, "")
        _sleeps = parse_faults(text, _own_rank(), SLEEP_ENV) if text else {}
    if point in _sleeps:
        time.sleep(_sleeps[point])
    if _plan is None:
        text = os.environ.get(ENV, "")
        _plan = parse_faults(text, _own_rank()) if text else {}
    if point not in _plan:
        return
    with _lock:
        _hits[point] = _hits.get(point, 0) + 1
        if _hits[point] == _plan[point]:
            _wait_for_gate()  # under the lock: no other thread of this process gets past a fault meanwhile
            os.kill(os.getpid(), signal.SIGKILL)
