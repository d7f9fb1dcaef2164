"""Session-wide fixtures: one tiny tokenizer and tiny teachers, built once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import build_teacher, build_tokenizer  # noqa: E402


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
