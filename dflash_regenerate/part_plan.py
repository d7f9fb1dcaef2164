"""How the work is cut and checked: parts of source rows, each rank's parts, the turns to answer, each answer's
random stream, and the settings a resume must match."""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from dflash_common.errors import ConfigError
from dflash_common.resume_check import first_difference
from dflash_regenerate.outputs import RESUME_KEYS, SETTINGS_DEFAULTS
from dflash_regenerate.settings.regenerate_config import KEEP_TURNS


def part_name(index: int) -> str:
    return f"part-{index:06d}.jsonl"


def record_name(index: int) -> str:
    return f".part-{index:06d}.json"


def part_rows(index: int, rows_per_part: int, total_rows: int) -> tuple[int, int]:
    """Source rows [start, end) of part `index`."""
    return index * rows_per_part, min((index + 1) * rows_per_part, total_rows)


def rank_parts(num_parts: int, rank: int, world_size: int) -> list[int]:
    """The parts rank `rank` owns: fixed row ranges dealt round-robin, so every world size cuts
    the corpus the same way and the merged output is the same."""
    return list(range(rank, num_parts, world_size))


def plan_turns(messages: list[dict], keep_turns: str) -> list[list[dict]]:
    """The prompt messages that precede each answer to generate.

    Group j holds the system and user messages between answer j-1 and answer j. Assistant
    messages are dropped (they are what is regenerated); an answer is due after each run of
    messages that holds a user turn, including a trailing user turn with no answer in the
    source. 'first' keeps only the first group. Raises ValueError(problem) when there is no
    user turn, or when a tool message would have to follow a regenerated answer (its result
    answers a call the teacher may not make).
    """
    if keep_turns not in KEEP_TURNS:
        raise ConfigError(f"keep_turns={keep_turns!r} is unknown; use 'first' or 'all'")
    groups: list[list[dict]] = []
    current: list[dict] = []
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "assistant":
            # An answer with no new user turn before it (a greeting, a second reply) has no
            # prompt of its own: it is dropped with the rest of the source answers.
            if any(m["role"] == "user" for m in current):
                groups.append(current)
                current = []
                if keep_turns == "first":
                    return groups
        elif role == "tool":
            raise ValueError(f"messages[{i}] is a tool turn, which cannot follow a regenerated answer; "
                             f"drop such rows or regenerate them outside dflash")
        else:
            current.append({"role": role, "content": message["content"]})
    if any(m["role"] == "user" for m in current):
        groups.append(current)  # a trailing user turn still gets an answer
    if not groups:
        raise ValueError("conversation has no user turn to regenerate")
    return groups[:1] if keep_turns == "first" else groups


def sample_seed(seed: int, row: str, turn: int) -> int:
    """The random stream of one answer: a pure function of (seed, row id, turn), so batching,
    ranks and resuming do not change which numbers a row draws."""
    return xxhash.xxh64_intdigest(f"{seed}\0{row}\0{turn}".encode()) & ((1 << 63) - 1)


def settings_mismatch(existing: dict, current: dict, keys: Iterable[str] = RESUME_KEYS) -> str | None:
    """The first of `keys` whose value differs, said for a user, or None."""
    return first_difference(existing, current, keys, defaults=SETTINGS_DEFAULTS)


