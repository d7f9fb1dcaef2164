"""Stage 0 through the real vLLM OpenAI server on 127.0.0.1: the same answers as the local teacher.

Marked `serving` (make test-serving). The server is vLLM's own (`python -m
vllm.entrypoints.openai.api_server`, what `vllm serve` runs) from the .venv-vllm of `make serving`.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import write_jsonl

from dflash_common.vllm_env import find_vllm_python
from dflash_train.measuring.serving import VllmServer
from dflash_train.settings.vllm_config import VllmConfig

pytestmark = pytest.mark.serving

ROOT = Path(__file__).resolve().parents[1]
TEACHER = str(ROOT / "examples" / "teacher")
BIN = Path(sys.executable).parent
MAX_NEW = "40"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        python = str(find_vllm_python())
    except Exception as err:  # the serving suite must not pass without the engine it tests
        pytest.fail(f"{err}")
    s = VllmServer(TEACHER, "tiny", VllmConfig(python=python), tmp_path_factory.mktemp("vllm") / "server.log")
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    with open(ROOT / "examples" / "data" / "chat.jsonl") as f:
        rows = [json.loads(line) for line in itertools.islice(f, 24)]
    return Path(write_jsonl(tmp_path_factory.mktemp("corpus") / "chat.jsonl", rows))


def regenerate(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([str(BIN / "dflash-cache"), "regenerate", "--max-new-tokens", MAX_NEW, "--quiet", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def local(corpus, tmp_path_factory) -> dict[str, Path]:
    """The transformers backend's greedy answers in float32, for both turn modes."""
    root = tmp_path_factory.mktemp("local")
    out = {}
    for turns in ("first", "all"):
        out[turns] = root / f"{turns}.jsonl"
        done = regenerate("--teacher", TEACHER, "--dtype", "float32", "--data", corpus, "--out", out[turns],
                          "--keep-turns", turns)
        assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("turns", ["first", "all"])
def test_vllm_server_answers_equal_the_local_teacher(server, corpus, local, tmp_path, turns):
    out = tmp_path / "served.jsonl"
    done = regenerate("--endpoint", server.url, "--served-model", "tiny", "--data", corpus, "--out", out,
                      "--keep-turns", turns, "--concurrency", "4")
    assert done.returncode == 0, done.stderr
    served, reference = out.read_text().splitlines(), local[turns].read_text().splitlines()
    assert len(served) == 24
    for ours, theirs in zip(served, reference):
        assert json.loads(ours) == json.loads(theirs)
    if turns == "all":  # multi-turn rows were answered turn by turn
        assert any(sum(m["role"] == "assistant" for m in json.loads(r)["messages"]) > 1 for r in served)


def test_sigkill_mid_run_then_rerun_equals_an_uninterrupted_run(server, corpus, local, tmp_path):
    out = tmp_path / "served.jsonl"
    args = [str(BIN / "dflash-cache"), "regenerate", "--endpoint", server.url, "--served-model", "tiny", "--data",
            str(corpus), "--out", str(out), "--max-new-tokens", MAX_NEW, "--rows-per-part", "3", "--concurrency", "1",
            "--quiet"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = tmp_path / "served.parts"
    deadline = time.time() + 300
    while not list(parts.glob(".part-*.json")) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = len(list(parts.glob(".part-*.json")))
    assert 1 <= committed < 8 and not out.exists(), committed
    done = regenerate("--endpoint", server.url, "--served-model", "tiny", "--data", corpus, "--out", out,
                      "--rows-per-part", "3")
    assert done.returncode == 0, done.stderr
    assert "resuming" in done.stderr or committed == 8
    assert out.read_text() == local["first"].read_text()


def test_server_stopped_mid_run_is_one_line_and_a_restarted_server_completes_it(server, corpus, local, tmp_path):
    """Last in this file: it stops the module's server and starts it again."""
    out = tmp_path / "served.jsonl"
    args = [str(BIN / "dflash-cache"), "regenerate", "--endpoint", server.url, "--served-model", "tiny", "--data",
            str(corpus), "--out", str(out), "--max-new-tokens", MAX_NEW, "--rows-per-part", "3", "--concurrency", "1",
            "--max-retries", "2", "--quiet"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    parts = tmp_path / "served.parts"
    deadline = time.time() + 300
    while not list(parts.glob(".part-*.json")) and time.time() < deadline:
        time.sleep(0.05)
    server.stop()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and server.url in last and "rerun the same command to resume" in last, err
    assert "Traceback" not in err and not out.exists()
    server.start()
    done = regenerate("--endpoint", server.url, "--served-model", "tiny", "--data", corpus, "--out", out,
                      "--rows-per-part", "3")
    assert done.returncode == 0, done.stderr
    assert out.read_text() == local["first"].read_text()
