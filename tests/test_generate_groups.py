"""Generate groups: a vLLM build sends `shards_per_generate` consecutive shards in one generate
(--vllm-args generate_tokens, a rule of token counts alone), records the group in the cache, and
a build killed inside a group resumes by cutting again from the group's first row, its committed
shards sent once more as context and not rewritten. The serving tests run the real vLLM engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_same_content, cache_content, chat_rows, write_jsonl
from test_build_vllm import ARGS, corpus, dtype_args, teacher_dir  # noqa: F401  (module fixtures)

from dflash_build import BuildConfig, build_cache
from dflash_build.shard_cut import group_start, shard_tokens, shards_per_generate
from dflash_cache import format as fmt
from dflash_cache import open_cache
from dflash_cache.settings.storage_config import StorageConfig
from dflash_common.errors import ConfigError
from dflash_corpus import CorpusConfig
from dflash_teacher.settings.vllm_args import VllmArgs
from dflash_teacher.teacher import TeacherConfig

ROOT = Path(__file__).resolve().parents[1]
GROUP = 3


def test_groups_are_whole_shards_and_a_resume_cuts_again_from_its_groups_first_shard():
    assert shards_per_generate(None, 500) == 1 and shards_per_generate(100, 500) == 1
    assert shards_per_generate(65536, 10_000) == 6
    records = [{"rows": [r, r + 5]} for r in range(0, 25, 5)]  # 5 committed shards of rows [0, 25)
    assert group_start(records[:4], 3, 100) == (3, 15)  # inside group 1: from its first shard
    assert group_start(records[:3], 3, 100) == (3, 15)  # at a group's boundary: where the records end
    assert group_start([], 3, 100) == (0, 0)
    assert group_start(records, 3, 25) == (5, 25)  # the corpus's end reached: nothing is cut again
    with pytest.raises(ConfigError, match="generate_tokens=0 must be a whole number >= 1"):
        VllmArgs(generate_tokens=0)


def test_a_resume_with_another_generate_group_is_refused_in_one_line_before_any_engine(tmp_path, teacher_dir):  # noqa: F811
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))

    def config(engine: str, vllm: VllmArgs = VllmArgs()) -> BuildConfig:
        return BuildConfig(out=str(tmp_path / "cache"), corpus=CorpusConfig(data=data),
                           teacher=TeacherConfig(name_or_path=teacher_dir("qwen3"), dtype="float32", layers=(0, 2),
                                                 top_k=6), storage=StorageConfig(shard_bytes=20_000), engine=engine,
                           vllm=vllm, vllm_python="/nonexistent/python")

    manifest = build_cache(config("transformers"))
    assert "shards_per_generate" not in manifest["content_options"]  # one shard per generate: as before groups
    assert set(manifest["last_run"]["seconds_by_part"]) == {"health", "hidden", "tables", "commit"}  # the writer's parts
    with pytest.raises(ConfigError) as refused:  # refused before the engine's python is even looked for
        build_cache(config("vllm"))
    message = str(refused.value)
    assert "\n" not in message and "built with 1 shard(s) per vLLM generate, this build would send" in message
    assert "--vllm-args '{\"generate_tokens\": 1}'" in message and "--overwrite" in message


def _build(teacher: str, corpus: str, out: Path, vllm_python: str, generate_tokens: int, env=None):  # noqa: F811
    command = [sys.executable, "-m", "cli.cache", "build", "--teacher", teacher, "--data", corpus, "--out", str(out),
               "--engine", "vllm", "--vllm-python", vllm_python, "--vllm-args",
               json.dumps({"generate_tokens": generate_tokens}), *ARGS, *dtype_args("qwen3")]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def one_per_generate(corpus, teacher_dir, vllm_python, tmp_path_factory) -> Path:  # noqa: F811
    """The corpus built by vLLM one shard per generate (as before groups)."""
    out = tmp_path_factory.mktemp("one_per_generate") / "cache"
    done = _build(teacher_dir("qwen3"), corpus, out, vllm_python, 1)
    assert done.returncode == 0, done.stderr
    return out


def _shard_tokens(out: Path) -> int:
    """The cut's token budget of a shard (shard_cut.shard_tokens) of the cache at ``out``."""
    manifest = json.loads((out / "manifest.json").read_text())
    per_token = fmt.hidden_bytes_per_token(len(manifest["layer_ids"]), manifest["hidden_size"], manifest["hidden_dtype"])
    return shard_tokens(manifest["content_options"]["shard_bytes"], per_token)


@pytest.mark.serving
def test_a_grouped_build_killed_inside_a_group_resumes_to_the_uninterrupted_grouped_build(
        corpus, teacher_dir, vllm_python, one_per_generate, tmp_path):  # noqa: F811
    teacher = teacher_dir("qwen3")
    generate_tokens = GROUP * _shard_tokens(one_per_generate)
    clean = tmp_path / "clean"
    done = _build(teacher, corpus, clean, vllm_python, generate_tokens)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((clean / "manifest.json").read_text())
    shards = [s.record for s in open_cache(str(clean)).shards]
    assert manifest["content_options"]["shards_per_generate"] == GROUP and len(shards) >= 2 * GROUP
    # SIGKILL at the 4th commit: group 0 (shards 0-2) and shard 3 of group 1 are committed
    killed = tmp_path / "killed"
    proc = _build(teacher, corpus, killed, vllm_python, generate_tokens, {"DFLASH_FAULT": "after_commit_record:4"})
    assert proc.returncode == -9, proc.stderr
    rerun = _build(teacher, corpus, killed, vllm_python, generate_tokens)
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming: 4 committed shard(s) kept" in rerun.stderr
    resumed = json.loads((killed / "manifest.json").read_text())
    # the engine ran group 1 again from its first shard (shard 3, context) and nothing of group 0
    assert resumed["last_run"]["tokens"] == sum(s["tokens"] for s in shards[GROUP:])
    assert open_cache(str(killed)).complete
    assert_same_content(cache_content(clean), cache_content(killed))
    refused = _build(teacher, corpus, killed, vllm_python, 1)
    assert refused.returncode != 0 and f"was built with {GROUP} shard(s) per vLLM generate, this build would send 1" \
        in refused.stderr and f"'{{\"generate_tokens\": {generate_tokens}}}'" in refused.stderr


@pytest.mark.serving
def test_a_grouped_vllm_build_equals_one_shard_per_generate(corpus, teacher_dir, vllm_python, one_per_generate,  # noqa: F811
                                                            tmp_path):
    """vLLM's CPU kernels give a sequence the same states whatever shares its engine steps: the
    grouped build (whole corpus in one generate) is byte for byte the build a shard at a time."""
    grouped = tmp_path / "grouped"
    done = _build(teacher_dir("qwen3"), corpus, grouped, vllm_python, 1 << 20)
    assert done.returncode == 0, done.stderr
    assert json.loads((grouped / "manifest.json").read_text())["content_options"]["shards_per_generate"] > 4
    assert_same_content(cache_content(one_per_generate), cache_content(grouped))
