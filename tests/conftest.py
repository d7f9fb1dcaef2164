"""Session-wide fixtures: one tiny tokenizer and tiny teachers, built once per test session."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import build_teacher, build_tokenizer, qa_rows, write_jsonl  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before the -m selection, which then sees the slow marks
def pytest_collection_modifyitems(items):
    """``@pytest.mark.fast_cases(n)``: the first n cases of a parametrized test run in `make test`,
    the others are marked slow (`make test-slow`). For families whose every case costs a process
    of its own: the fast suite keeps one of each kind, CI runs them all."""
    seen: dict[str, int] = {}
    for item in items:
        marker = item.get_closest_marker("fast_cases")
        if marker is None or not hasattr(item, "callspec") or item.get_closest_marker("slow"):
            continue
        name = item.nodeid.split("[", 1)[0]
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > marker.args[0]:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """Folder holding the tiny ChatML byte-level BPE tokenizer (see helpers.build_tokenizer)."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def teacher_dir(tmp_path_factory, tokenizer_dir):
    """Factory `teacher_dir(arch, dtype=torch.float32) -> folder`, building each teacher once."""
    from transformers import AutoTokenizer

    built: dict[tuple[str, torch.dtype], str] = {}

    def get(arch: str, dtype: torch.dtype = torch.float32) -> str:
        key = (arch, dtype)
        if key not in built:
            dtype_name = str(dtype).removeprefix("torch.")
            path = tmp_path_factory.mktemp(f"teacher_{arch}_{dtype_name}")
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            built[key] = build_teacher(path, arch, tokenizer, dtype=dtype)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory, teacher_dir):
    """Factory `tiny_cache(**overrides) -> cache URL`: a cache written by the real build, once per
    session for each set of overrides. Defaults: 60 question/answer rows (helpers.qa_rows, seed 3),
    the float32 qwen3 teacher, tapped layers (0, 2), top-k 6, 20 kB shards, cache format 1 (the
    tests that read a cache's files by hand were written for it, and the trainer's tests so prove
    that a format-1 cache still trains; builds default to format 2, which the build, data and CLI
    tests cover). Overrides: `rows` (the corpus rows), `arch`, `dtype`, `layers`, `top_k`,
    `shard_bytes`, `chunk_bytes`, `compression`, `format_version`.
    Tests only read it; a test that damages or extends a cache copies it first."""
    from dflash_build import BuildConfig, build_cache
    from dflash_cache.settings.storage_config import StorageConfig
    from dflash_corpus import CorpusConfig
    from dflash_teacher.teacher import TeacherConfig

    built: dict[str, str] = {}

    def get(rows: list[dict] | None = None, arch: str = "qwen3", dtype: str = "float32", layers=(0, 2), top_k: int = 6,
            shard_bytes: int = 20_000, chunk_bytes: int | None = None, compression: str = "none",
            format_version: int = 1) -> str:
        rows = qa_rows(60, seed=3, prefix="s3-") if rows is None else rows
        key = json.dumps([rows, arch, dtype, list(layers), top_k, shard_bytes, chunk_bytes, compression, format_version],
                         sort_keys=True)
        if key not in built:
            root = tmp_path_factory.mktemp("tiny_cache")
            sizes = {"shard_bytes": shard_bytes, **({"chunk_bytes": chunk_bytes} if chunk_bytes else {})}
            build_cache(BuildConfig(out=str(root / "cache"), corpus=CorpusConfig(data=write_jsonl(root / "chat.jsonl", rows)),
                                    teacher=TeacherConfig(name_or_path=teacher_dir(arch), dtype=dtype, layers=tuple(layers),
                                                          top_k=top_k),
                                    storage=StorageConfig(compression=compression, format_version=format_version, **sizes)))
            built[key] = str(root / "cache")
        return built[key]

    return get


@pytest.fixture(scope="session")
def cache_url(tiny_cache) -> str:
    """The training tests' cache: 100 question/answer rows (seed 1) on the tiny qwen3 teacher."""
    return tiny_cache(rows=qa_rows(100, seed=1, prefix="t1-"))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of the vLLM environment the serving tests run (DFLASH_VLLM_PYTHON or .venv-vllm)."""
    from dflash_common.vllm_env import find_vllm_python

    try:
        return str(find_vllm_python())
    except Exception as err:  # the serving suite must not pass without the engine it tests
        pytest.fail(f"{err}")
