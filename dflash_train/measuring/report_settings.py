"""The settings block every eval report records: what two accepted lengths must share to be compared.

Drafter cards pin the engine and its version (vLLM 0.27.1 -> 0.28.0 alone moved one drafter from
3.19 to 2.66 tokens a step), the dtype, the sampling settings, the block size and speculative
tokens, the chat-template kwargs (thinking on or off changes what a drafter sees), the prompts and
the models. A report without them cannot be compared with another, so eval writes them beside
its numbers: the prompt files by hash (a file edited in place is another benchmark), the teacher
by its identity (dflash_teacher.teacher.teacher_identity: the hashes a cache's manifest records)
and the drafter by a hash of its trained weights.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import xxhash

HASH_CHUNK = 1 << 20
"""Prompt files are hashed a MiB at a time (a SPEED-Bench parquet is tens of MiB)."""


def file_record(path: str) -> dict:
    """A prompt file's path, size and xxh64 of its bytes."""
    digest, size = xxhash.xxh64(), 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"path": str(path), "bytes": size, "xxh64": digest.hexdigest()}


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def decoder_engine() -> dict:
    """The built-in decoder as an engine: dflash's version and the libraries that compute it."""
    return {"engine": "dflash", "version": _version("dflash"), "torch": _version("torch"),
            "transformers": _version("transformers")}


def drafter_identity(drafter, checkpoint: str) -> dict:
    """Where the drafter came from, its kind and shape, and xxh64 over its trained weights as
    loaded (names, shapes and float32 bytes; the teacher's frozen embedding and head are not its
    own and are not in its state_dict)."""
    digest = xxhash.xxh64()
    for name, tensor in sorted(drafter.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    cfg = drafter.cfg
    return {"checkpoint": str(Path(checkpoint)), "architecture": cfg.to_hf_config()["architectures"][0],
            "num_hidden_layers": cfg.num_hidden_layers, "target_layer_ids": list(cfg.target_layer_ids),
            "causal": bool(cfg.causal), "weights_hash": digest.hexdigest()}


def settings_block(cfg, *, dtype: str, device: str, teacher: dict, drafter: dict, block_size: int,
                   speculative_tokens: int, template_kwargs: dict | None, template_hash: str | None,
                   vllm_version: str | None = None) -> dict[str, Any]:
    """The report's ``settings`` for an EvalConfig ``cfg`` decoding in real mode: engines, dtype,
    sampling, block, template, prompt files and the two models' identities."""
    spec = cfg.decoding.spec
    engines = [decoder_engine()] if cfg.engine in ("dflash", "both") else []
    if cfg.engine in ("vllm", "both"):
        engines.append({"engine": "vllm", "version": vllm_version})
    return {
        "engines": engines, "dtype": dtype, "device": device,
        # top-k filtering: neither engine applies one here (vLLM's request leaves it off), so None
        "temperatures": list(cfg.decoding.temperatures), "top_p": spec.top_p, "top_k": None, "seed": spec.seed,
        "max_new_tokens": spec.max_new_tokens, "block_size": block_size, "num_speculative_tokens": speculative_tokens,
        "confidence_threshold": spec.confidence_threshold,
        "chat_template_kwargs": template_kwargs, "chat_template_hash": template_hash,
        "prompt_files": [file_record(p) for p in cfg.prompts], "max_prompts": cfg.max_prompts,
        "teacher": teacher, "drafter": drafter,
    }


def settings_lines(settings: dict) -> list[tuple[str, str]]:
    """The settings block as the printout's (what, value) lines."""
    engines = ", ".join(f"{e['engine']} {e.get('version') or '?'}" for e in settings["engines"])
    teacher, drafter = settings["teacher"], settings["drafter"]
    files = ", ".join(f"{Path(f['path']).name} ({f['xxh64']})" for f in settings["prompt_files"])
    return [("engines", engines), ("dtype, device", f"{settings['dtype']}, {settings['device']}"),
            ("temperature, top-p, top-k", f"{', '.join(f'{t:g}' for t in settings['temperatures'])}; "
                                          f"{settings['top_p']:g}; {settings['top_k'] or 'off'}"),
            ("block size, speculative tokens", f"{settings['block_size']}, {settings['num_speculative_tokens']}"),
            ("chat-template kwargs", f"{settings['chat_template_kwargs']} (template {settings['chat_template_hash']})"),
            ("prompt files", files),
            ("teacher", f"{teacher.get('name')} (weights {teacher.get('weights_hash')})"),
            ("drafter", f"{drafter['checkpoint']} ({drafter['architecture']}, weights {drafter['weights_hash']})")]
