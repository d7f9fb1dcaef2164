"""A teacher folder that ships its own Python code never runs it unless the user says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_jsonl

BIN = Path(sys.executable).parent


def custom_code_teacher(root: Path, marker: Path) -> Path:
    """A folder whose config names an unknown model type served by its own modules (auto_map);
    importing either module creates `marker`, as a hostile one would run anything."""
    folder = root / "custom-teacher"
    folder.mkdir()
    payload = f"open({str(marker)!r}, 'w').write('ran')\n"
    (folder / "configuration_custom.py").write_text(
        payload + "from transformers import PretrainedConfig\n\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'dflash_custom'\n")
    (folder / "modeling_custom.py").write_text(payload)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "dflash_custom", "architectures": ["CustomModel"],
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                     "AutoModelForCausalLM": "modeling_custom.CustomModel"}}))
    return folder


@pytest.mark.parametrize("command", ["build", "regenerate", "eval"])
@pytest.mark.fast_cases(1)
def test_yes_on_stdin_never_runs_a_teachers_code(tmp_path, command):
    marker = tmp_path / "code-ran"
    teacher = custom_code_teacher(tmp_path, marker)
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "hello"}]}])
    args = {
        "build": [BIN / "dflash-cache", "build", "--teacher", teacher, "--data", data, "--out", tmp_path / "cache",
                  "--layers", "0", "--quiet"],
        "regenerate": [BIN / "dflash-cache", "regenerate", "--teacher", teacher, "--data", data,
                       "--out", tmp_path / "regen.jsonl", "--quiet"],
        "eval": [BIN / "dflash-train", "eval", "--checkpoint", tmp_path / "drafter", "--teacher", teacher,
                 "--prompts", data, "--quiet"],
    }[command]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    # transformers asks "Do you wish to run the custom code? [y/N]" when trust_remote_code is left unset
    proc = subprocess.run([str(a) for a in args], input="y\n" * 50, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--trust-remote-code" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not marker.exists()


def test_trust_remote_code_is_passed_when_asked(tmp_path):
    """With the flag the folder's code does run (so the refusal above is the flag's doing)."""
    from dflash_common.errors import TeacherError
    from dflash_teacher.teacher import TeacherConfig, load_config

    marker = tmp_path / "code-ran"
    teacher = custom_code_teacher(tmp_path, marker)
    with pytest.raises(TeacherError, match="--trust-remote-code"):
        load_config(TeacherConfig(name_or_path=str(teacher)))
    assert not marker.exists()
    load_config(TeacherConfig(name_or_path=str(teacher), trust_remote_code=True))
    assert marker.exists()


# ---------------------------------------------------------------------------------------------
# We delete only what we made


def _build_args(teacher, data, out, *extra):
    return ["build", "--teacher", teacher, "--data", data, "--out", str(out), "--dtype", "float32", "--layers", "0,2",
            "--top-k", "4", "--quiet", *extra]


def test_overwrite_deletes_only_a_dflash_cache(tmp_path, teacher_dir):
    from helpers import qa_rows
    from typer.testing import CliRunner

    from cli.cache import app

    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(6, seed=3, prefix="ow-"))
    # another tool's folder that happens to hold a manifest.json, shards/ and teacher/
    other = tmp_path / "other"
    for name, text in (("manifest.json", '{"tool": "not dflash"}'), ("shards/mine.txt", "user data"),
                       ("teacher/notes.md", "user notes")):
        (other / name).parent.mkdir(parents=True, exist_ok=True)
        (other / name).write_text(text)
    result = CliRunner().invoke(app, _build_args(teacher, data, other, "--overwrite"))
    assert result.exit_code == 1 and "not a dflash cache's" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert (other / "shards" / "mine.txt").read_text() == "user data" and (other / "teacher" / "notes.md").exists()
    assert (other / "manifest.json").read_text() == '{"tool": "not dflash"}'

    # a real cache with a user's file put inside shards/: nothing is deleted
    cache = tmp_path / "cache"
    assert CliRunner().invoke(app, _build_args(teacher, data, cache)).exit_code == 0
    (cache / "shards" / "README.txt").write_text("mine")
    before = sorted(p.name for p in (cache / "shards").iterdir())
    result = CliRunner().invoke(app, _build_args(teacher, data, cache, "--overwrite"))
    assert result.exit_code == 1 and "shards/README.txt is not a file dflash writes" in result.output, result.output
    assert sorted(p.name for p in (cache / "shards").iterdir()) == before
    # nor a user's file inside a rank's folder of shards (format 2)
    (cache / "shards" / "README.txt").unlink()
    (cache / "shards" / "r00000" / "notes.txt").write_text("mine")
    result = CliRunner().invoke(app, _build_args(teacher, data, cache, "--overwrite"))
    assert result.exit_code == 1 and "shards/r00000/notes.txt is not a file dflash writes" in result.output, result.output
    assert (cache / "shards" / "r00000" / "notes.txt").read_text() == "mine"
    # without it, --overwrite rebuilds the cache
    (cache / "shards" / "r00000" / "notes.txt").unlink()
    assert CliRunner().invoke(app, _build_args(teacher, data, cache, "--overwrite")).exit_code == 0


@pytest.mark.parametrize("layout", ["teacher copy", "plain file", "foreign config"])
def test_run_out_refuses_what_is_not_a_run(tmp_path, teacher_dir, layout):
    import shutil

    from helpers import qa_rows
    from typer.testing import CliRunner

    from cli.cache import app as cache_app
    from cli.train import app

    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(8, seed=4, prefix="ro-"))
    assert CliRunner().invoke(cache_app, _build_args(teacher, data, tmp_path / "cache")).exit_code == 0
    out = tmp_path / "out"
    if layout == "teacher copy":  # --out pointed at a model folder: its config.json and files must survive
        shutil.copytree(teacher, out)
    elif layout == "plain file":
        out.write_text("not a folder")
    else:
        out.mkdir()
        (out / "config.json").write_text('{"model_type": "qwen3"}')
    before = {p.name: p.read_bytes() for p in out.iterdir()} if out.is_dir() else out.read_bytes()
    result = CliRunner().invoke(app, ["run", "--cache", str(tmp_path / "cache"), "--out", str(out), "--steps", "1",
                                      "--num-layers", "1", "--block-size", "4", "--eval-sequences", "0", "--quiet"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--out" in lines[0] and "choose a new or empty folder" in lines[0], result.output
    after = {p.name: p.read_bytes() for p in out.iterdir()} if out.is_dir() else out.read_bytes()
    assert after == before
