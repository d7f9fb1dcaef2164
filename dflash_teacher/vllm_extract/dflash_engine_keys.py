"""The check of a build's engine arguments against vLLM's own list, run in vLLM's environment by
extract_worker.py before the engine starts. Imports nothing of dflash: the list is the fields of
the EngineArgs dataclass of the vLLM installed there (LLM(...) passes every keyword it does not
name itself into EngineArgs), so a key is accepted exactly when that vLLM accepts it."""

from __future__ import annotations

import dataclasses
import difflib


def vllm_engine_arg_names() -> frozenset[str]:
    """The keyword arguments vLLM's EngineArgs takes (the installed vLLM's own dataclass)."""
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs) if f.init)


def unknown_engine_arg(given: list[str], known: frozenset[str], version: str) -> str | None:
    """One line naming the first key of `given` that is not in `known` (vLLM `version`'s engine
    arguments) and the closest one it has; None when vLLM knows them all."""
    for key in sorted(given):
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            return (f"--vllm-args key {key!r} is not an engine argument of vLLM {version} (vllm.engine.arg_utils."
                    f"EngineArgs); {hint}use the names `vllm serve --help` lists, dashes as underscores")
    return None
