"""What the parts of the GPU check (benchmarks/gpu_check.py) share: the device, the sizes, the
dflash commands from this checkout, the shipped teacher and its data."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing
sys.path.insert(0, str(HERE))

from bench_gpu import PRODUCTION, TINY, drafter_config, peak_memory, sync  # noqa: E402, F401 (re-exported to the parts)

from dflash_train.training.model import DFlashDrafter  # noqa: E402

TEACHER = ROOT / "examples" / "teacher"
CORPUS = ROOT / "examples" / "data" / "chat.jsonl"
PROMPTS = ROOT / "examples" / "data" / "heldout_prompts.jsonl"
BF16_CACHE = "cache-dev-bf16"
"""The capture part's bf16 device cache, which the ddp, eval and walks parts train and evaluate on."""
RUN = ["--num-layers", "1", "--block-size", "8", "--batch-tokens", "2048", "--heldout-fraction", "0.05",
       "--log-every", "5", "--quiet"]
"""The tiny drafter runs' shared options."""


def device() -> torch.device:
    return torch.device(os.environ.get("GPU_CHECK_DEVICE") or "cuda")


def on_cpu() -> bool:
    return device().type == "cpu"


def sizes():
    return TINY if on_cpu() else PRODUCTION


def autocast(dev: torch.device):
    """The trainer's autocast: bf16 on CUDA, none elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)


def build_drafter(s, dev: torch.device, backend: str = "sdpa", cfg=None, seed: int = 0) -> DFlashDrafter:
    """A random drafter of sizes `s` (or `cfg`) on the device, with a bf16 embedding and an fp32
    head as training holds them; `seed` changes its trained weights, never the frozen teacher's."""
    cfg = cfg or drafter_config(s)
    torch.manual_seed(0)
    with torch.device(dev):
        embed = (torch.randn(s.vocab, s.hidden) * 0.02).bfloat16()
        head = torch.randn(s.vocab, s.hidden) * 0.02
    torch.manual_seed(seed)
    return DFlashDrafter.build(cfg, embed, head, dev, backend)


def timed_step(model: DFlashDrafter, batch, train_cfg, optimizer, dev: torch.device) -> tuple[float, float]:
    """One optimizer step of one micro-batch, synced: (seconds, loss)."""
    from dflash_train.training.distributed import DistInfo
    from dflash_train.training.train_step import micro_step

    t = time.perf_counter()
    result = micro_step(model, model, batch, train_cfg, DistInfo(), dev, autocast(dev))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(dev)
    return time.perf_counter() - t, float(result.loss.detach())


def mixed_config(s):
    """The production drafter with sliding layers 0 and 2 (window 2,048; 32 on the CPU) among full
    ones: each window is its own compiled block mask, so this is the recompile-heaviest layout trained."""
    cfg = drafter_config(s)
    types = tuple("sliding_attention" if i in (0, 2) else "full_attention" for i in range(cfg.num_hidden_layers))
    return dataclasses.replace(cfg, layer_types=types, sliding_window=32 if on_cpu() else 2048)


def cli(*args: str, env: dict | None = None, torchrun: int = 0) -> str:
    """A dflash command from this checkout (no install needed), under torchrun with `torchrun`
    processes when given; its output, or an error with its tail."""
    module = "cli.cache" if args[0] == "cache" else "cli.train"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun), "-m"]
                if torchrun else [sys.executable, "-m"])
    full_env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
                "PYTHONPATH": str(ROOT), **(env or {})}
    done = subprocess.run([*launcher, module, *args[1:]], cwd=ROOT, env=full_env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args[:2])} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done.stdout


def corpus(out: Path, rows: int) -> Path:
    """The first `rows` conversations of the shipped corpus."""
    path = out / "corpus.jsonl"
    with open(CORPUS) as f, open(path, "w") as g:
        for _, line in zip(range(rows), f):
            g.write(line)
    return path


def markdown(header: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *["| " + " | ".join(str(v) for v in row) + " |" for row in rows]])


def vllm_python() -> str | None:
    """The vLLM environment's python a part serves with, None on the CPU or without one."""
    return None if on_cpu() else os.environ.get("DFLASH_VLLM_PYTHON") or None
