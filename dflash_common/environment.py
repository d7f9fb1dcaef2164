"""Integers read from the environment (torchrun's RANK, WORLD_SIZE and LOCAL_RANK, vLLM's CPU KV
cache size): one reader, so a value that is not a number is one line naming it, never a traceback."""

from __future__ import annotations

import os

from dflash_common.errors import ConfigError

_MAX_DIGITS = 18


def int_from_env(name: str, default: int, minimum: int = 0, meaning: str = "") -> int:
    """$name as an integer >= minimum, `default` when unset or empty; ConfigError otherwise."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    stripped = text.strip()
    digits = stripped[1:] if stripped[:1] in "+-" else stripped
    value = int(stripped) if digits.isdecimal() and digits.isascii() and len(digits) <= _MAX_DIGITS else None
    if value is None or value < minimum:
        what = f" ({meaning})" if meaning else ""
        raise ConfigError(f"{name}={text[:40]!r} is not an integer >= {minimum}{what}; set it to one or unset it")
    return value


def rank_and_world() -> tuple[int, int]:
    """This process's (RANK, WORLD_SIZE) as torchrun sets them, (0, 1) when unset; the one reader of
    both for the build, regenerate and training: a value that is not a whole number, or a rank
    outside the world, is one ConfigError line naming the variable, its value and the fix."""
    world = int_from_env("WORLD_SIZE", 1, minimum=1, meaning="the number of processes, set by torchrun")
    rank = int_from_env("RANK", 0, meaning="this process's rank, set by torchrun")
    if rank >= world:
        raise ConfigError(f"RANK={rank} is outside a world of WORLD_SIZE={world} processes; set RANK in 0..WORLD_SIZE-1 "
                          "(torchrun sets both), or unset them to run in one process")
    return rank, world
