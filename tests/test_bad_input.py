"""Every bad input is one line: exit 1, the problem, the value and the fix, no traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import qa_rows, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from cli.train import app as train_app

BIN = Path(sys.executable).parent


# Chat templates (put before the teacher's own) that fail for every chat, for one row, or cost too much.
_TEMPLATES = {
    "raising-teacher": "{{ raise_exception('') }}",
    "boom-teacher": "{% if messages[0]['content'] == 'boom' %}{{ raise_exception('') }}{% endif %}",
    "gigabyte-teacher": "{{ 'x' * 10**9 }}",
    "multiplying-teacher": "{% for m in messages %}{{ m['content'] * 100000 }}{% endfor %}",
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, teacher_dir):
    root = tmp_path_factory.mktemp("bad_input")
    teacher = teacher_dir("qwen3")
    data = write_jsonl(root / "chat.jsonl", qa_rows(12, seed=5, prefix="bad-"))
    build = ["build", "--teacher", teacher, "--data", data, "--out", str(root / "cache"), "--dtype", "float32",
             "--layers", "0,2", "--top-k", "4", "--quiet"]
    assert CliRunner().invoke(cache_app, build).exit_code == 0
    run = ["run", "--cache", str(root / "cache"), "--out", str(root / "run"), "--steps", "2", "--num-layers", "1",
           "--block-size", "4", "--eval-sequences", "0", "--heldout-fraction", "0.1", "--quiet"]
    assert CliRunner().invoke(train_app, run).exit_code == 0
    files = {
        "lr_fast.toml": '[optim]\nlr = "fast"\n', "model_3.toml": "model = 3\n", "list.json": "[1, 2]",
        "anchors_true.toml": "[data]\nnum_anchors = true\n", "skip_string.toml": '[data]\nskip_shards = "shard-a"\n',
        "config.yaml": "optim:\n  lr: 0.001\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "plain-file").write_text("x")
    (root / "empty.jsonl").write_text("\n")
    # files that never end, are not text, or hold what Python cannot parse (issue 25)
    import os
    import shutil

    os.symlink("/dev/zero", root / "zero.toml")
    (root / "huge.toml").write_text("# padding\n" * 1_000_000)
    (root / "binary.toml").write_bytes(b"\x00\xff\xfe\x89PNG")
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "digits.toml").write_text("[data]\nnum_anchors = 1" + "0" * 5000 + "\n")
    (root / "surrogate.jsonl").write_text('{"id": "s", "messages": [{"role": "user", "content": "a\\ud800b"}, '
                                          '{"role": "assistant", "content": "ok"}]}\n')
    (root / "prompts-surrogate.jsonl").write_text('{"prompt": "a\\ud800b"}\n')
    (root / "a-folder").mkdir()
    loops = root / "loop-teacher"  # a template of nested loops: 10^10 steps, hours for one row
    shutil.copytree(teacher, loops)
    template = (loops / "chat_template.jinja").read_text()
    (loops / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + template)
    for name, prefix in _TEMPLATES.items():  # teachers whose chat templates fail or cost too much (issue 25)
        shutil.copytree(teacher, root / name)
        (root / name / "chat_template.jinja").write_text(prefix + template)
    (root / "boom.jsonl").write_text(json.dumps({"id": "b", "messages": [{"role": "user", "content": "boom"},
                                                                         {"role": "assistant", "content": "ok"}]}) + "\n")
    os.symlink("/dev/zero", root / "zero-prompts.jsonl")
    (root / "dataset-dict").mkdir()
    os.symlink("/dev/zero", root / "dataset-dict" / "dataset_dict.json")
    (root / "zero-corpus").mkdir()
    os.symlink("/dev/zero", root / "zero-corpus" / "rows.jsonl")
    shutil.copytree(teacher, root / "zero-teacher")
    (root / "zero-teacher" / "config.json").unlink()
    os.symlink("/dev/zero", root / "zero-teacher" / "config.json")
    for damage in ("manifest.json", "teacher/config.json"):
        copy = root / f"cache-zero-{damage.split('/')[0].removesuffix('.json')}"
        shutil.copytree(root / "cache", copy)
        (copy / damage).unlink()
        os.symlink("/dev/zero", copy / damage)
    bad_ckpt = root / "bad-ckpt"
    bad_ckpt.mkdir()
    step = root / "run" / "checkpoints" / "step-000002"
    for name in ("model.safetensors", "config.json", "COMPLETE"):
        (bad_ckpt / name).write_bytes((step / name).read_bytes())
    torch.save([1, 2, 3], bad_ckpt / "trainer.pt")  # a loadable pickle of the wrong structure
    huge_block = root / "huge-block-drafter"  # an edited export: the masks would be allocated by it
    shutil.copytree(root / "run" / "drafter", huge_block)
    config = json.loads((huge_block / "config.json").read_text())
    config["block_size"] = config["dflash_config"]["block_size"] = 10**18
    (huge_block / "config.json").write_text(json.dumps(config))
    return {"root": root, "teacher": teacher, "data": data, "cache": str(root / "cache")}


def _cases(s) -> dict[str, tuple[object, list[str], str]]:
    root, cache, teacher, data = s["root"], s["cache"], s["teacher"], s["data"]
    run = ["run", "--cache", cache, "--steps", "2", "--num-layers", "1", "--block-size", "4", "--eval-sequences", "0",
           "--quiet"]
    fresh = ["--out", str(root / "fresh-run")]
    build = ["build", "--teacher", teacher, "--data", data, "--dtype", "float32", "--top-k", "4", "--quiet"]
    return {
        "storage options not JSON": (cache_app, ["info", cache, "--storage-options", "{bad"], "is not valid JSON"),
        "storage options a list": (cache_app, ["info", cache, "--storage-options", "[1]"], "not an object"),
        "train storage options": (train_app, run + fresh + ["--storage-options", "{"], "is not valid JSON"),
        "device tpu": (cache_app, build + ["--out", str(root / "c-tpu"), "--layers", "0", "--device", "tpu"],
                       "--device 'tpu' is not supported"),
        "device cuda without one": (cache_app, build + ["--out", str(root / "c-cuda"), "--layers", "0", "--device", "cuda"],
                                    "no CUDA GPU"),
        "train device cuda": (train_app, run + fresh + ["--device", "cuda"], "no CUDA GPU"),
        "config lr string": (train_app, run + fresh + ["--config", str(root / "lr_fast.toml")], "optim.lr = 'fast' must be a number"),
        "config model not a table": (train_app, run + fresh + ["--config", str(root / "model_3.toml")], "model section is 3"),
        "config a JSON list": (train_app, run + fresh + ["--config", str(root / "list.json")], "holds a JSON list"),
        "config bool for int": (train_app, run + fresh + ["--config", str(root / "anchors_true.toml")],
                                "data.num_anchors = True must be a whole number"),
        "set bool for int": (train_app, run + fresh + ["--set", "data.num_anchors=true"], "must be a whole number"),
        "lr nan": (train_app, run + fresh + ["--lr", "nan"], "optim.lr = nan must be a finite number"),
        "skip_shards a string": (train_app, run + fresh + ["--config", str(root / "skip_string.toml")],
                                 "data.skip_shards = 'shard-a' must be a list"),
        "yaml config": (train_app, run + fresh + ["--config", str(root / "config.yaml")], "neither .toml nor .json"),
        "steps and epochs": (train_app, run + fresh + ["--epochs", "1"], "both set the run length"),
        "keep checkpoints 0": (train_app, run + fresh + ["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
        "keep checkpoints -1": (train_app, run + fresh + ["--keep-checkpoints", "-1"], "--keep-checkpoints must be at least 1"),
        "eval sequences -1": (train_app, run + fresh + ["--eval-sequences", "-1"], "--eval-sequences must be 0"),
        "warmup -1": (train_app, run + fresh + ["--warmup-steps", "-1"], "--warmup-steps must be 0 or more"),
        "grad clip -1": (train_app, run + fresh + ["--grad-clip", "-1"], "--grad-clip must be 0"),
        "run out a file": (train_app, run + ["--out", str(root / "plain-file")], "is a file, not a folder"),
        "build out a file": (cache_app, build + ["--out", str(root / "plain-file"), "--layers", "0"], "is a file, not a folder"),
        "shard size nan": (cache_app, build + ["--out", str(root / "c-nan"), "--layers", "0", "--shard-size", "nan"],
                           "must be a finite number"),
        "shard size inf": (cache_app, build + ["--out", str(root / "c-inf"), "--layers", "0", "--shard-size", "inf"],
                           "must be a finite number"),
        "shard size 0": (cache_app, build + ["--out", str(root / "c-0"), "--layers", "0", "--shard-size", "0"],
                         "at least one byte"),
        "tapped layers beyond the teacher": (cache_app, build + ["--out", str(root / "c-deep"), "--tapped-layers", "7"],
                                             "--tapped-layers 7 asks for more tapped layers than a 4-layer teacher"),
        "the old --drafter-layers name": (cache_app, build + ["--out", str(root / "c-old"), "--drafter-layers", "7"],
                                          "--tapped-layers 7 asks for more tapped layers than a 4-layer teacher"),
        "max length 0": (cache_app, build + ["--out", str(root / "c-len"), "--layers", "0", "--max-length", "0"],
                         "--max-length 0 must be a positive integer"),
        "eval max sequences 0": (train_app, ["eval", "--checkpoint", str(root / "run" / "drafter"), "--cache", cache,
                                             "--max-sequences", "0", "--quiet"], "--max-sequences 0"),
        "trainer.pt of the wrong structure": (train_app, ["export", str(root / "bad-ckpt"), str(root / "bad-export")],
                                              "trainer.pt lacks 'step'"),
        "export out a file": (train_app, ["export", str(root / "run" / "checkpoints" / "step-000002"),
                                          str(root / "plain-file")], "is a file, not a folder"),
        # issue 25: unbounded reads and unparsable settings files
        "config linked to /dev/zero": (train_app, run + fresh + ["--config", str(root / "zero.toml")],
                                       "zero.toml is not a regular file"),
        "config of 10 MB": (train_app, run + fresh + ["--config", str(root / "huge.toml")],
                            "huge.toml is larger than 8 MiB (or never ends, like a link to /dev/zero), so it was not read"),
        "config binary": (train_app, run + fresh + ["--config", str(root / "binary.toml")], "binary.toml is not UTF-8 text"),
        "config nested 100,000 deep": (train_app, run + fresh + ["--config", str(root / "deep.json")],
                                       "deep.json is nested too deeply to parse"),
        "config with a 5,000-digit integer": (train_app, run + fresh + ["--config", str(root / "digits.toml")],
                                              "digits.toml cannot be parsed (Exceeds the limit (4300 digits)"),
        "manifest linked to /dev/zero": (cache_app, ["info", str(root / "cache-zero-manifest")],
                                         "manifest.json is a symlink to /dev/zero, outside the cache"),
        "teacher config linked to /dev/zero": (train_app, run + ["--cache", str(root / "cache-zero-teacher"), "--out",
                                                                 str(root / "zero-run")],
                                               "teacher/config.json is a symlink to /dev/zero, outside the cache"),
        "a teacher's config.json linked to /dev/zero": (cache_app, ["build", "--teacher", str(root / "zero-teacher"), "--data",
                                                                    data, "--out", str(root / "c-zero"), "--layers", "0",
                                                                    "--dry-run", "--quiet"],
                                                        "zero-teacher/config.json is larger than 8 MiB (or never ends"),
        "template of nested loops": (cache_app, ["build", "--teacher", str(root / "loop-teacher"), "--data", data, "--out",
                                                 str(root / "c-loops"), "--layers", "0", "--dry-run", "--quiet"],
                                     "loop-teacher fails on every chat, a plain user/assistant one too (TemplateTooCostly: "
                                     f"the chat template of {root / 'loop-teacher'} took more than 1,000,000 steps"),
        "template raising an empty error for every chat": (
            cache_app, ["build", "--teacher", str(root / "raising-teacher"), "--data", data, "--out", str(root / "c-raise"),
                        "--layers", "0", "--dry-run", "--quiet", "--on-bad-row", "skip"],
            "raising-teacher fails on every chat, a plain user/assistant one too (TemplateError without a message), so "
            "the template, not the rows, is at fault: fix or replace the template"),
        "template raising an empty error for one row": (
            cache_app, ["build", "--teacher", str(root / "boom-teacher"), "--data", str(root / "boom.jsonl"), "--out",
                        str(root / "c-boom"), "--layers", "0", "--dry-run", "--quiet"],
            "boom.jsonl row 1: chat template failed: TemplateError without a message"),
        "template of a gigabyte string": (
            cache_app, ["build", "--teacher", str(root / "gigabyte-teacher"), "--data", data, "--out", str(root / "c-gb"),
                        "--layers", "0", "--dry-run", "--quiet"],
            "gigabyte-teacher fails on every chat, a plain user/assistant one too (TemplateTooCostly: the chat template "
            "holds a constant '*' expression of 1,000,000,000 characters"),
        "template multiplying each message": (
            cache_app, ["build", "--teacher", str(root / "multiplying-teacher"), "--data", data, "--out",
                        str(root / "c-mul"), "--layers", "0", "--dry-run", "--quiet"],
            f"row 1: chat template failed: the chat template of {root / 'multiplying-teacher'} asked for a '*' "
            "result of "),
        # issue 25: tracebacks
        "seed 10**20": (train_app, run + fresh + ["--seed", str(10**20)],
                        "seed = 100000000000000000000 must be a whole number below 2**63"),
        "set a 5,000-digit integer": (train_app, run + fresh + ["--set", "data.num_anchors=1" + "0" * 5000],
                                      "--set data.num_anchors=... cannot be read (Exceeds the limit (4300 digits)"),
        "betas 2,3": (train_app, run + fresh + ["--betas", "2,3"], "--betas 2,3 must each be in [0, 1)"),
        "block size 100000": (train_app, run + fresh + ["--block-size", "100000"], "--block-size 100000 is larger than 256"),
        "a lone surrogate in a corpus row": (cache_app, ["build", "--teacher", teacher, "--data", str(root / "surrogate.jsonl"),
                                                         "--out", str(root / "c-sur"), "--layers", "0", "--dry-run",
                                                         "--quiet"],
                                             "surrogate.jsonl row 1: messages[0] content holds a lone surrogate '\\ud800'"),
        "a lone surrogate in eval --prompts": (train_app, ["eval", "--checkpoint", str(root / "run" / "drafter"), "--teacher",
                                                           teacher, "--prompts", str(root / "prompts-surrogate.jsonl"),
                                                           "--out", str(root / "sur-eval.json"), "--quiet"],
                                               "prompts-surrogate.jsonl line 1: holds a lone surrogate"),
        # issue 34: the tokenizer raised these as a traceback
        "a lone surrogate in generate --prompt": (train_app, ["generate", "--checkpoint", str(root / "run" / "drafter"),
                                                             "--teacher", teacher, "--prompt", "a\ud800b"],
                                                  "--prompt holds a lone surrogate '\\ud800' at character 1"),
        "bytes not UTF-8 in generate --prompt": (train_app, ["generate", "--checkpoint", str(root / "run" / "drafter"),
                                                            "--teacher", teacher, "--prompt",
                                                            b"caf\xe9".decode("utf-8", "surrogateescape")],
                                                 "--prompt holds a lone surrogate '\\udce9' at character 3"),
        "drafter block_size 10**18": (train_app, ["eval", "--checkpoint", str(root / "huge-block-drafter"), "--cache",
                                                 cache, "--quiet"],
                                     "config.json: drafter config block_size 1000000000000000000 is not a whole number "
                                     "from 2 to 256 (16 is typical); the file is damaged or edited: export the drafter again"),
        "eval --prompts linked to /dev/zero": (train_app, ["eval", "--checkpoint", str(root / "run" / "drafter"), "--teacher",
                                                          teacher, "--prompts", str(root / "zero-prompts.jsonl"), "--out",
                                                          str(root / "zero-eval.json"), "--quiet"],
                                               "zero-prompts.jsonl is a character device, not a regular file; pass a "
                                               "prompts file of JSON Lines"),
        "dataset_dict.json linked to /dev/zero": (cache_app, ["build", "--teacher", teacher, "--data", str(root / "dataset-dict"),
                                                              "--out", str(root / "c-dd"), "--dry-run", "--quiet"],
                                                  "dataset-dict is a datasets DatasetDict with splits ?; point the corpus at "
                                                  "one split folder"),
        "a corpus folder holding a link to /dev/zero": (cache_app, ["build", "--teacher", teacher, "--data",
                                                                    str(root / "zero-corpus"), "--out", str(root / "c-zc"),
                                                                    "--dry-run", "--quiet"],
                                                        "zero-corpus/rows.jsonl is not a regular file or folder; move it "
                                                        "out of the corpus folder"),
        "eval out a folder": (train_app, ["eval", "--checkpoint", str(root / "run" / "drafter"), "--cache", cache,
                                          "--out", str(root / "a-folder"), "--quiet"],
                              "a-folder is a folder; pass the report's file name"),
        "unknown URL scheme": (cache_app, ["info", "foo://bar"], "foo://bar: the URL scheme foo:// is unknown"),
        # issue 25: wrong outcomes and misleading messages
        "verify deep sample -1": (cache_app, ["verify", cache, "--deep", "--sample", "-1"], "--sample -1 must be at least 1"),
        "data /dev/null": (cache_app, ["build", "--teacher", teacher, "--data", "/dev/null", "--out", str(root / "c-null"),
                                       "--quiet"], "corpus path /dev/null is not a regular file or folder"),
        "dry run on an empty corpus": (cache_app, ["build", "--teacher", teacher, "--data", str(root / "empty.jsonl"),
                                                   "--out", str(root / "c-empty"), "--dry-run", "--quiet"], "has no rows"),
        "template kwargs NaN": (cache_app, build + ["--out", str(root / "c-kw"), "--layers", "0", "--chat-template-kwargs",
                                                    '{"a": NaN}'], "not finite (NaN or Infinity)"),
        # issue 26: the vLLM engine's options, refused before a teacher loads or a file is written
        "engine sglang": (cache_app, build + ["--out", str(root / "c-eng"), "--layers", "0", "--engine", "sglang"],
                          "--engine 'sglang' is unknown; use transformers or vllm"),
        "vllm args not JSON": (cache_app, build + ["--out", str(root / "c-va"), "--layers", "0", "--engine", "vllm",
                                                   "--vllm-args", "{tp"], "--vllm-args '{tp' is not valid JSON"),
        # an unknown key is checked against vLLM's own engine arguments, in vLLM's environment:
        # tests/test_vllm_engine_args.py (serving)
        "vllm args memory 2": (cache_app, build + ["--out", str(root / "c-vm"), "--layers", "0", "--engine", "vllm",
                                                   "--vllm-args", '{"gpu_memory_utilization": 2}'],
                               "gpu_memory_utilization=2 must be a share in (0, 1]"),
        "vllm args tp true": (cache_app, build + ["--out", str(root / "c-vt"), "--layers", "0", "--engine", "vllm",
                                                  "--vllm-args", '{"tensor_parallel_size": true}'],
                              "tensor_parallel_size=True must be a whole number >= 1"),
        "vllm python missing": (cache_app, build + ["--out", str(root / "c-vp"), "--layers", "0", "--engine", "vllm",
                                                    "--vllm-python", str(root / "no-python")],
                                "no-python is not an executable file; run `make serving`"),
        "vllm with a device map": (cache_app, build + ["--out", str(root / "c-vd"), "--layers", "0", "--engine", "vllm",
                                                       "--device-map", "auto"], "with --engine vllm pass --vllm-args"),
        "regenerate template kwargs Infinity": (cache_app, ["regenerate", "--teacher", teacher, "--data", data, "--out",
                                                            str(root / "regen.jsonl"), "--chat-template-kwargs",
                                                            '{"a": [Infinity]}'], "not finite (NaN or Infinity)"),
    }


CASE_NAMES = list(_cases({"root": Path("."), "cache": "", "teacher": "", "data": ""}))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_is_one_line(setup, name):
    app, args, expected = _cases(setup)[name]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, (name, result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (name, result.output)
    assert expected in lines[0], (name, lines[0])
    assert "Traceback" not in result.output and not isinstance(result.exception, (AttributeError, KeyError, TypeError))


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# What `export STEP OUT` is pointed at by mistake, and what its refusal names.
_NOT_EXPORTS = {
    "a model folder with notes": "(it holds a config.json that is not an export's, 'NOTES.txt' and ",
    "a model's config.json and model.safetensors": "(it holds a config.json that is not an export's, 'model.safetensors')",
    "a run folder": "(it holds a config.json that is not an export's, 'checkpoints' and ",
    "a cache's teacher folder": "(it holds a config.json that is not an export's, ",
    "an export holding a user's file": "(it holds 'README.md')",
    "weights without a config": "(it holds 'model.safetensors')",
}


@pytest.mark.parametrize("layout", list(_NOT_EXPORTS))
def test_export_refuses_a_folder_that_is_not_an_export(setup, tmp_path, layout):
    """An export replaces its whole folder, so it goes only where an earlier export (or nothing) is."""
    import shutil

    root = setup["root"]
    out = tmp_path / "out"
    if layout == "a model folder with notes":
        shutil.copytree(setup["teacher"], out)
        (out / "NOTES.txt").write_text("my notes")
    elif layout == "a model's config.json and model.safetensors":
        out.mkdir()
        (out / "config.json").write_text('{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}')
        (out / "model.safetensors").write_bytes((root / "run" / "drafter" / "model.safetensors").read_bytes())
    elif layout == "a run folder":
        shutil.copytree(root / "run", out)
    elif layout == "a cache's teacher folder":
        shutil.copytree(Path(setup["cache"]) / "teacher", out)
    elif layout == "an export holding a user's file":
        shutil.copytree(root / "run" / "drafter", out)
        (out / "README.md").write_text("# my drafter")
    else:
        out.mkdir()
        (out / "model.safetensors").write_bytes((root / "run" / "drafter" / "model.safetensors").read_bytes())
    before = _tree(out)
    result = CliRunner().invoke(train_app, ["export", str(root / "run" / "checkpoints" / "step-000002"), str(out)])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {out} is a non-empty folder that is not a drafter export "), \
        result.output
    assert _NOT_EXPORTS[layout] in lines[0] and lines[0].endswith("choose a new or empty folder for the export "
                                                                  "(it replaces the whole folder)"), lines[0]
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder either


def test_run_refuses_a_users_file_in_its_drafter_folder_before_training(setup, tmp_path):
    """Training ends by replacing RUN/drafter: a user's file there stops it at the start, not hours in."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(setup["root"] / "run", run)
    (run / "drafter" / "NOTES.txt").write_text("eval notes")
    before = _tree(run)
    result = CliRunner().invoke(train_app, ["run", "--cache", setup["cache"], "--out", str(run), "--resume", "--steps", "3",
                                            "--num-layers", "1", "--block-size", "4", "--eval-sequences", "0",
                                            "--heldout-fraction", "0.1", "--quiet"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"{run / 'drafter'} is a non-empty folder that is not a drafter export (it holds " \
        "'NOTES.txt')" in lines[0], result.output
    assert _tree(run) == before  # no step taken, no checkpoint written


def test_export_replaces_an_earlier_export_with_readable_files(setup, tmp_path):
    import os
    import shutil
    import stat

    root = setup["root"]
    out = tmp_path / "drafter"
    shutil.copytree(root / "run" / "drafter", out)
    (out / "config.json").write_text((out / "config.json").read_text().replace('"block_size": 4', '"block_size": 5'))
    result = CliRunner().invoke(train_app, ["export", str(root / "run" / "checkpoints" / "step-000002"), str(out)])
    assert result.exit_code == 0, result.output
    assert _tree(out) == _tree(root / "run" / "drafter")  # the same checkpoint, so the same files
    umask = os.umask(0)
    os.umask(umask)
    # a plain file write's mode (safetensors alone makes its file 0o600, unreadable to a server run as another user)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        "config.json": 0o666 & ~umask, "model.safetensors": 0o666 & ~umask}


def test_a_checkpoint_is_readable_like_any_file_written(setup):
    """Checkpoints' model.safetensors were mode 600 (safetensors' own), while every other file
    got 0o666 & ~umask: a serving account could read trainer.pt but not the weights."""
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    step = setup["root"] / "run" / "checkpoints" / "step-000002"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in step.iterdir()}
    assert modes == dict.fromkeys(["model.safetensors", "trainer.pt", "config.json", "COMPLETE"], 0o666 & ~umask), modes


def test_interrupted_run_names_the_command_that_resumes(setup, tmp_path):
    """Ctrl-C during `dflash-train run`: the hint says --resume, and that command does continue."""
    out = tmp_path / "run"
    args = [str(BIN / "dflash-train"), "run", "--cache", setup["cache"], "--out", str(out), "--steps", "100000",
            "--num-layers", "1", "--block-size", "4", "--eval-sequences", "0", "--save-every", "1", "--quiet"]
    # SIGINT as a terminal gives it: a shell's background job (a CI runner's, say) starts with it
    # ignored, and Python then keeps ignoring it
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 300
        while not list((out / "checkpoints").glob("step-*/COMPLETE")) and time.time() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()  # never left training 100,000 steps behind a failed test
    assert proc.returncode == 130, err
    assert "rerun the same command with --resume" in err
    resumed = CliRunner().invoke(train_app, ["run", "--cache", setup["cache"], "--out", str(out), "--resume", "--steps", "3",
                                             "--num-layers", "1", "--block-size", "4", "--eval-sequences", "0",
                                             "--save-every", "1", "--quiet"])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((out / "config.json").read_text())["steps"] == 3


def test_info_counts_sequences_without_totals_and_a_rerun_keeps_last_run(setup, tmp_path):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(setup["cache"], cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    sequences, last_run = manifest["totals"]["sequences"], manifest["last_run"]
    assert sequences == 12 and last_run["tokens"] > 0
    # a rerun of the finished build runs no teacher; it must not replace what the build measured
    build = ["build", "--teacher", setup["teacher"], "--data", setup["data"], "--out", str(cache), "--dtype", "float32",
             "--layers", "0,2", "--top-k", "4", "--quiet"]
    assert CliRunner().invoke(cache_app, build).exit_code == 0
    assert json.loads((cache / "manifest.json").read_text())["last_run"] == last_run
    del manifest["totals"]
    (cache / "manifest.json").write_text(json.dumps(manifest))
    info = CliRunner().invoke(cache_app, ["info", str(cache)])
    assert info.exit_code == 0 and f"sequences    {sequences}" in info.output, info.output


def test_a_damaged_newest_checkpoint_names_resume_from_and_it_works(setup, tmp_path):
    out = tmp_path / "run"
    base = ["run", "--cache", setup["cache"], "--out", str(out), "--num-layers", "1", "--block-size", "4",
            "--eval-sequences", "0", "--save-every", "1", "--quiet"]
    assert CliRunner().invoke(train_app, base + ["--steps", "3"]).exit_code == 0
    newest = out / "checkpoints" / "step-000003" / "trainer.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # a torn write on a flaky disk
    refused = CliRunner().invoke(train_app, base + ["--steps", "4", "--resume"])
    assert refused.exit_code == 1 and "--resume-from" in refused.output, refused.output
    older = out / "checkpoints" / "step-000002"
    resumed = CliRunner().invoke(train_app, base + ["--steps", "4", "--resume-from", str(older)])
    assert resumed.exit_code == 0, resumed.output
    assert (out / "checkpoints" / "step-000004" / "COMPLETE").exists()


@pytest.mark.parametrize("damage", ["a list", "no teacher", "no index", "index without its shard table", "top_k a string",
                                    "top_k a float", "top_k 10**9", "hidden_size 10**9", "hidden_size other than the arrays'"])
def test_a_damaged_manifest_is_one_line_everywhere(setup, tmp_path, damage):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(setup["cache"], cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    if damage == "a list":
        manifest = [manifest]
    elif damage == "no teacher":
        del manifest["teacher"]
    elif damage == "no index":  # format 2 (format 1's shard records: test_untrusted_cache.py)
        del manifest["index"]
    elif damage == "index without its shard table":
        del manifest["index"]["shards"]
    elif damage in ("top_k 10**9", "hidden_size 10**9"):  # an allocation of gigabytes per token before (issue 25)
        manifest[damage.split()[0]] = 10**9
    elif damage == "hidden_size other than the arrays'":
        manifest["hidden_size"] = 32
    else:
        manifest["top_k"] = "4" if damage == "top_k a string" else 4.5
    (cache / "manifest.json").write_text(json.dumps(manifest))
    for app, args in ((cache_app, ["info", str(cache)]), (cache_app, ["verify", str(cache)]),
                      (train_app, ["run", "--cache", str(cache), "--out", str(tmp_path / "run"), "--quiet"]),
                      (train_app, ["eval", "--checkpoint", str(setup["root"] / "run" / "drafter"), "--cache", str(cache),
                                   "--quiet"])):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1, (damage, args, result.output, result.exception)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "manifest.json" in lines[0] and "rebuild" in lines[0], (damage, args, result.output)


@pytest.fixture(scope="module")
def setup_v1(setup, tmp_path_factory) -> Path:
    """The setup's corpus built in format 1, whose manifest holds the shard records."""
    out = tmp_path_factory.mktemp("bad_input_v1") / "cache"
    build = ["build", "--teacher", setup["teacher"], "--data", setup["data"], "--out", str(out), "--dtype", "float32",
             "--layers", "0,2", "--top-k", "4", "--format-version", "1", "--quiet"]
    assert CliRunner().invoke(cache_app, build).exit_code == 0
    return out


# A manifest edited where no checksum reaches: a format-1 manifest's records' counts, or a top_k the
# token tables disagree with (either format). verify refused these while `run` trained on them
# (issue 25); both now apply the reader's one check (integrity.record_problems) and name the shard.
_TOP_K = "tokens.arrow column topk_ids is fixed_size_list<item: int32>[4], not 5 values per token (the manifest's top_k = 5)"
_EDITED_RECORDS = {
    "a shard's sequence count": (1, lambda m: m["shards"][0].update(sequences=0),
                                 "commit record differs from the manifest (sequences)"),
    "a shard's chunk size": (1, lambda m: m["shards"][0].update(chunk_tokens=1),
                             "commit record differs from the manifest (chunk_tokens)"),
    "a top_k the token tables disagree with (format 1)": (1, lambda m: m.update(top_k=5), _TOP_K),
    "a top_k the token tables disagree with (format 2)": (2, lambda m: m.update(top_k=5), _TOP_K),
}


@pytest.mark.parametrize("edit", list(_EDITED_RECORDS))
def test_a_manifest_verify_refuses_does_not_train(setup, setup_v1, tmp_path, edit):
    import shutil

    cache = tmp_path / "cache"
    version, change, problem = _EDITED_RECORDS[edit]
    shutil.copytree(setup_v1 if version == 1 else setup["cache"], cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    change(manifest)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    before = _tree(cache)
    verified = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert verified.exit_code == 1 and problem in verified.output, verified.output
    trained = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(tmp_path / "run"), "--steps", "1",
                                             "--num-layers", "1", "--block-size", "4", "--eval-sequences", "0", "--quiet"])
    assert trained.exit_code == 1, (trained.output, trained.exception)
    lines = trained.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {cache}: "), trained.output
    assert "fail the integrity check: shard-r" in lines[0] and problem in lines[0] and "--skip-shards" in lines[0], lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "drafter").exists()
    assert _tree(cache) == before


def test_a_shard_folder_linked_from_inside_the_cache_is_read_by_verify_and_run_alike(setup, tmp_path):
    import os
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(setup["cache"], cache)
    shard = sorted(p for p in (cache / "shards").iterdir() if p.is_dir())[0]
    (cache / "moved").mkdir()
    shutil.move(str(shard), cache / "moved" / shard.name)
    os.symlink(f"../moved/{shard.name}", shard)
    verified = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert verified.exit_code == 0, verified.output
    trained = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(tmp_path / "run"), "--steps", "1",
                                             "--num-layers", "1", "--block-size", "4", "--eval-sequences", "0", "--quiet"])
    assert trained.exit_code == 0, trained.output


def _real_tree(folder: Path) -> dict[str, bytes | str]:
    """Every entry under `folder` without following links: files by content, links by target."""
    import os

    tree: dict[str, bytes | str] = {}
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(top) / name
            key = str(path.relative_to(folder))
            tree[key] = f"-> {os.readlink(path)}" if path.is_symlink() else (path.read_bytes() if path.is_file() else "dir")
    return tree


# An entry of an output replaced by a symlink to a copy outside it, the command that writes or
# deletes there, and the link it must name. Before, each wrote or deleted through the link (or
# ended in a traceback).
_LINKS = {
    "metrics.jsonl appended on --resume": "run/metrics.jsonl",
    "config.json overwritten": "run/config.json",
    "checkpoints pruned by --keep-checkpoints": "run/checkpoints",
    "an old step folder pruned": "run/checkpoints/step-000001",
    "drafter replaced at the end": "run/drafter",
    "drafter/eval.json overwritten by eval": "run/drafter/eval.json",
    "export OUT replaced": "out",
    "regenerate OUT.parts": "regen/out.parts",
}


@pytest.mark.parametrize("case", list(_LINKS))
def test_a_symlink_in_an_output_is_refused_and_nothing_outside_changes(setup, tmp_path, case):
    import os
    import shutil

    run, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(setup["root"] / "run", run)
    outside.mkdir()
    link = tmp_path / _LINKS[case]
    target = outside / link.name
    if case == "an old step folder pruned":
        shutil.copytree(run / "checkpoints" / "step-000002", target)  # another run's checkpoint
    elif case == "export OUT replaced":
        shutil.copytree(run / "drafter", target)
    elif case == "regenerate OUT.parts":
        target.mkdir()
        (target / "notes.txt").write_text("someone else's folder")
        link.parent.mkdir()
    elif (run / _LINKS[case].removeprefix("run/")).is_dir():
        shutil.move(run / _LINKS[case].removeprefix("run/"), target)
    elif link.exists():
        shutil.move(link, target)
    else:
        target.write_text("someone else's file\n")
    os.symlink(target, link)
    train = ["--cache", setup["cache"], "--out", str(run), "--num-layers", "1", "--block-size", "4", "--eval-sequences",
             "0", "--heldout-fraction", "0.1", "--quiet"]
    app, args = {
        "checkpoints pruned by --keep-checkpoints": (train_app, ["run", *train, "--resume", "--steps", "4", "--save-every",
                                                                 "1", "--keep-checkpoints", "1"]),
        "an old step folder pruned": (train_app, ["run", *train, "--resume", "--steps", "4", "--save-every", "1",
                                                  "--keep-checkpoints", "1"]),
        "drafter/eval.json overwritten by eval": (train_app, ["eval", "--checkpoint", str(run / "drafter"), "--cache",
                                                              setup["cache"], "--quiet"]),
        "export OUT replaced": (train_app, ["export", str(run / "checkpoints" / "step-000002"), str(link)]),
        "regenerate OUT.parts": (cache_app, ["regenerate", "--teacher", setup["teacher"], "--data", setup["data"], "--out",
                                             str(tmp_path / "regen" / "out.jsonl"), "--quiet"]),
    }.get(case, (train_app, ["run", *train, "--resume", "--steps", "3"]))
    before, outside_before = _real_tree(tmp_path / "run"), _real_tree(outside)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, (case, result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {link} is a symlink (to {target}); dflash writes and deletes "
                                                   "only real files and folders in its output"), result.output
    assert "replace the link with a real" in lines[0]
    assert _real_tree(outside) == outside_before and _real_tree(tmp_path / "run") == before


@pytest.mark.parametrize("writer", ["regenerate", "sweep"])
def test_a_second_regenerate_or_sweep_on_one_output_names_the_first(setup, tmp_path, writer):
    """regenerate's OUT.parts and a sweep folder took no lock: two writers mixed their parts and
    runs. The first writer's lock is held here (flock: a second open of the file conflicts even in
    one process), and the command must stop at once naming it, writing nothing."""
    import os

    from dflash_common.files import one_writer

    if writer == "regenerate":
        folder, what = tmp_path / "out.parts", "dflash-cache regenerate"
        app, args = cache_app, ["regenerate", "--teacher", setup["teacher"], "--data", setup["data"], "--out",
                                str(tmp_path / "out.jsonl"), "--quiet"]
    else:
        folder, what = tmp_path / "sweep", "dflash-train sweep"
        app, args = train_app, ["sweep", "--cache", setup["cache"], "--out", str(folder), "--grid", "loss=ce,kl", "--steps",
                                "1", "--quiet"]
    with one_writer(folder, "test", "none"):
        before = _real_tree(tmp_path)
        result = CliRunner().invoke(app, args)
        assert _real_tree(tmp_path) == before
    assert result.exit_code == 1, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {folder} is being written by another {what} (pid "
                                                   f"{os.getpid()} on "), result.output
    assert lines[0].endswith("two writers would mix their files: wait for it to end (or stop it), or choose another "
                             f"--out than {tmp_path / ('out.jsonl' if writer == 'regenerate' else 'sweep')}"), lines[0]


def test_a_10_mb_prompt_is_skipped_as_too_long_not_too_short(setup, tmp_path):
    """A row whose 10 MB prompt fills max_length keeps no answer token: it was counted as
    `too_short`, which sends a user looking for short rows."""
    rows = qa_rows(3, seed=1, prefix="big-")
    rows[1]["messages"][0]["content"] = "word " * 2_000_000
    data = write_jsonl(tmp_path / "big.jsonl", rows)
    result = CliRunner().invoke(cache_app, ["build", "--teacher", setup["teacher"], "--data", data, "--out",
                                            str(tmp_path / "cache"), "--layers", "0", "--dry-run", "--quiet"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "sequences 2 " in result.output and "skipped {'too_long': 1}" in result.output, result.output
    assert not (tmp_path / "cache").exists()


def test_debug_tracebacks_hide_url_credentials(setup):
    """--debug printed the traceback as Python writes it: the message quoting the URL, password
    and all, above the redacted one-line error."""
    result = CliRunner().invoke(cache_app, ["info", "http://alice:s3cretpw@127.0.0.1:9/cache", "--debug"])
    assert result.exit_code == 1, (result.output, result.exception)
    assert "Traceback (most recent call last)" in result.output and "CacheError: http://***@127.0.0.1:9/cache" in result.output
    assert "s3cretpw" not in result.output, result.output
    assert result.output.strip().splitlines()[-1].startswith("error: http://***@127.0.0.1:9/cache: no manifest.json")


def test_an_unexpected_error_prints_its_traceback_with_secrets_hidden(capsys):
    """An exception that is not one of ours (a bug) went out through Python's own traceback, the
    key and URL password quoted in it: it is printed redacted, with one line saying it is a bug."""
    import typer

    from cli.common import run

    def action():
        raise ValueError("request to http://alice:s3cretpw@127.0.0.1:9/v1 with key sk-live-123 failed")

    for debug in (False, True):
        with pytest.raises(typer.Exit) as stopped:
            run(action, debug, secrets=["sk-live-123"])
        printed = capsys.readouterr().err
        assert stopped.value.exit_code == 1
        assert "Traceback (most recent call last)" in printed and "ValueError: request to http://***@127.0.0.1:9/v1" in printed
        assert "s3cretpw" not in printed and "sk-live-123" not in printed, printed
        assert printed.strip().splitlines()[-1] == ("error: unexpected ValueError, a bug in dflash; please report it "
                                                    "with the traceback above")
    # typer's own exits pass through untouched
    with pytest.raises(typer.Exit) as stopped:
        run(lambda: (_ for _ in ()).throw(typer.Exit(3)), False)
    assert stopped.value.exit_code == 3


def test_a_diverged_run_stops_naming_the_step_and_exports_nothing(setup, tmp_path):
    """--lr 1e30 made the loss NaN, yet the run exited 0 and exported NaN weights."""
    import math

    from safetensors.torch import load_file

    out = tmp_path / "run"
    result = CliRunner().invoke(train_app, ["run", "--cache", setup["cache"], "--out", str(out), "--steps", "8", "--num-layers",
                                            "1", "--block-size", "4", "--eval-sequences", "0", "--save-every", "1",
                                            "--log-every", "1", "--warmup-steps", "0", "--lr", "1e30", "--quiet"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: training diverged: "), result.output
    assert "the run stopped without saving or exporting those weights" in lines[0] and "lower --lr" in lines[0]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stopped = records[-1]
    assert stopped["kind"] == "stopped"
    assert f"step {stopped['step']}" in lines[0]
    trained = [r for r in records if r["kind"] == "train"]
    assert all(math.isfinite(r["loss"]) for r in trained) and len(trained) < 8
    assert not (out / "drafter").exists()
    for step in (out / "checkpoints").glob("step-*"):  # whatever was saved is finite
        assert all(bool(t.isfinite().all()) for t in load_file(step / "model.safetensors").values()), step


def test_a_vllm_python_named_bare_or_answering_garbage_is_one_line(setup, tmp_path, monkeypatch):
    """`--vllm-python NAME` for a file here ran NAME from PATH (FileNotFoundError); a python whose
    result is not JSON was a traceback."""
    fake = tmp_path / "fakepython"
    fake.write_text('#!/bin/sh\necho "garbage"\nprintf "not json {" > "$3"\n')  # the worker's argv: WORKER REQUEST RESULT
    fake.chmod(0o755)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(train_app, ["eval", "--checkpoint", str(setup["root"] / "run" / "drafter"), "--teacher",
                                            setup["teacher"], "--prompts", "prompts.jsonl", "--engine", "vllm",
                                            "--vllm-python", "fakepython", "--max-new-tokens", "2", "--out", "r.json",
                                            "--quiet"])
    assert result.exit_code == 1, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: the result of vLLM python {fake} is not valid JSON"), lines
    assert not (tmp_path / "r.json").exists()
