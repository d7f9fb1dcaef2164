"""Issue 45, the training side: checkpoints, drafter exports, sizes and decoding lengths from
someone else. Every file a command opens in a checkpoint or export folder is a regular file inside
it (no link out, no FIFO or device), a pickle payload is refused in our words, sizes that multiply
memory or time are refused when the config is built, and weights that are not their config's
drafter are never exported or loaded. Each case: one line, exit 1, at once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from cli.train import app

BIN = Path(sys.executable).parent
SMALL = ["--num-layers", "1", "--block-size", "4", "--eval-sequences", "0", "--heldout-fraction", "0.05", "--quiet"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_url):
    """A DFlash run and a DFlash2 run (selector rank 16) of two steps, each with checkpoints at
    steps 1 and 2 and an export."""
    root = tmp_path_factory.mktemp("checkpoint_input")
    made = {}
    for name, extra in (("dflash", []), ("dflash2", ["--model-kind", "dflash2", "--selector-rank", "16",
                                                      "--selector-top-k", "4"])):
        args = ["run", "--cache", cache_url, "--out", str(root / name), "--steps", "2", "--save-every", "1", *SMALL, *extra]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        made[name] = root / name
    return {"root": root, "cache": cache_url, **made}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _one_line(args: list[str], expected: str | list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, (args, result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for part in [expected] if isinstance(expected, str) else expected:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def _edit_drafter(step: Path, edit) -> None:
    """Rewrite the drafter config recorded in a checkpoint's trainer.pt."""
    state = torch.load(step / "trainer.pt", weights_only=True)
    edit(state["drafter"])
    torch.save(state, step / "trainer.pt")


# ---------------------------------------------------------------------------------------------
# 1. Files of a checkpoint or an export: regular files inside the folder


def _step(runs, run="dflash", step=2) -> Path:
    return runs[run] / "checkpoints" / f"step-{step:06d}"


def test_a_checkpoint_file_linked_out_of_its_folder_is_refused_unread(runs, tmp_path):
    """config.json as a link to /dev/zero took 6.3 GB (read whole); model.safetensors as a link to
    another checkpoint's weights was read. export, eval and --init-from refuse both unread."""
    zero = _copy(_step(runs), tmp_path / "zero")
    (zero / "config.json").unlink()
    os.symlink("/dev/zero", zero / "config.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outside = _copy(_step(runs), tmp_path / "outside")
    shutil.move(outside / "model.safetensors", elsewhere / "model.safetensors")
    os.symlink(elsewhere / "model.safetensors", outside / "model.safetensors")
    inside = _copy(_step(runs), tmp_path / "inside")  # a link to a file of the folder itself is fine
    shutil.move(inside / "config.json", inside / "config-real.json")
    os.symlink("config-real.json", inside / "config.json")
    for step in (zero, outside):
        name = "config.json" if step == zero else "model.safetensors"
        why = [f"checkpoint {step}: {name} is a symlink to ", "outside the folder; dflash reads only the folder's own files"]
        _one_line(["export", str(step), str(tmp_path / f"exp-{step.name}")], why)
        _one_line(["eval", "--checkpoint", str(step), "--cache", runs["cache"], "--out", str(tmp_path / "e.json"),
                   "--quiet"], why)
        _one_line(["run", "--cache", runs["cache"], "--out", str(tmp_path / f"init-{step.name}"), "--steps", "1",
                   "--init-from", str(step), *SMALL], why)
    assert not (tmp_path / "exp-zero").exists() and not (tmp_path / "exp-outside").exists()
    result = CliRunner().invoke(app, ["export", str(inside), str(tmp_path / "exp-inside")])
    assert result.exit_code == 0, result.output


def test_an_export_file_linked_to_dev_zero_is_refused(runs, tmp_path):
    export = _copy(runs["dflash"] / "drafter", tmp_path / "drafter")
    (export / "config.json").unlink()
    os.symlink("/dev/zero", export / "config.json")
    _one_line(["eval", "--checkpoint", str(export), "--cache", runs["cache"], "--out", str(tmp_path / "e.json"),
               "--quiet"], [f"drafter export {export}: config.json is a symlink to /dev/zero, outside the folder"])
    _one_line(["run", "--cache", runs["cache"], "--out", str(tmp_path / "init"), "--steps", "1", "--init-from",
               str(export), *SMALL], "config.json is a symlink to /dev/zero, outside")


@pytest.mark.parametrize("name", ["trainer.pt", "config.json", "model.safetensors"])
@pytest.mark.fast_cases(1)  # a process each: the others run in make test-slow
def test_a_fifo_in_a_checkpoint_ends_at_once(runs, tmp_path, name):
    """A FIFO in place of a checkpoint's file blocked its reader forever (waiting for a writer):
    a real `dflash-train export` process now ends in one line within seconds."""
    step = _copy(_step(runs), tmp_path / "fifo")
    (step / name).unlink()
    os.mkfifo(step / name)
    start = time.monotonic()
    try:
        proc = subprocess.run([str(BIN / "dflash-train"), "export", str(step), str(tmp_path / "exp")],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"export blocked on the FIFO {name} for 120 s")
    lines = proc.stderr.strip().splitlines() + proc.stdout.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, (proc.stdout, proc.stderr)
    assert (f"checkpoint {step}: {name} is a FIFO (reading it would wait for a writer forever), not a regular file, so "
            "it was not read" in lines[0])
    assert time.monotonic() - start < 60


def test_a_fifo_in_an_export_or_as_the_runs_saved_config_is_refused(runs, tmp_path):
    export = _copy(runs["dflash"] / "drafter", tmp_path / "drafter")
    (export / "model.safetensors").unlink()
    os.mkfifo(export / "model.safetensors")
    _one_line(["eval", "--checkpoint", str(export), "--cache", runs["cache"], "--out", str(tmp_path / "e.json"),
               "--quiet"], "model.safetensors is a FIFO")
    run = _copy(runs["dflash"], tmp_path / "run")
    (run / "config.json").unlink()
    os.mkfifo(run / "config.json")
    _one_line(["run", "--cache", runs["cache"], "--out", str(run), "--resume", "--steps", "3"],
              f"--resume: run {run}: config.json is a FIFO")


# ---------------------------------------------------------------------------------------------
# 2. A pickle payload in trainer.pt, refused in our words


class _System:
    """Unpickling this runs a shell command: the payload torch refused with its own advice."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_payload_is_refused_in_our_words_naming_a_real_checkpoint(runs, tmp_path):
    marker = tmp_path / "pwned"
    run = _copy(runs["dflash"], tmp_path / "run")
    step = run / "checkpoints" / "step-000002"
    state = torch.load(step / "trainer.pt", weights_only=True)
    torch.save({**state, "extra": _System(marker)}, step / "trainer.pt")
    lone = _copy(step, tmp_path / "shared" / "step-000002")  # a checkpoint sent alone: nothing beside it
    common = ["trainer.pt holds Python objects other than tensors and plain values (it names posix.system), which "
              "dflash never loads since loading them could run code; it was not written by dflash-train or was "
              "tampered with, so it was not loaded"]
    for line in (
        _one_line(["export", str(step), str(tmp_path / "exp")],
                  common + [f"use another checkpoint of that run (with --resume: --resume-from "
                            f"{run}/checkpoints/step-000001) or delete {step}"]),
        _one_line(["run", "--cache", runs["cache"], "--out", str(run), "--resume", "--steps", "3", *SMALL], common),
        _one_line(["eval", "--checkpoint", str(lone), "--cache", runs["cache"], "--out", str(tmp_path / "e.json"),
                   "--quiet"], common + [f"there is no other complete checkpoint beside it in {lone.parent}: use a "
                                         f"checkpoint dflash-train wrote, or delete {lone}"]),
    ):
        for wrong in ("weights_only", "damaged", "--resume-from " + str(lone.parent)):
            assert wrong not in line, line
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# 3. Sizes that multiply memory or time, refused when the config is built


SIZES = {
    "num layers 10**6": (["--num-layers", "1000000"],
                         "--num-layers 1,000,000 is more than 256, twice the deepest known teacher"),
    "block 256 x anchors 1000": (["--block-size", "256", "--anchors", "random", "--num-anchors", "1000"],
                                 "--block-size 256 x --num-anchors 1,000 is 256,000 block tokens per sequence in one "
                                 "forward, more than 65,536"),
    "selector rank 10**9": (["--model-kind", "dflash2", "--selector-rank", "1000000000"],
                            "dflash2.selector_rank 1,000,000,000 is more than 4,096"),
    "intermediate size 10**9": (["--intermediate-size", "1000000000"],
                                "--intermediate-size 1,000,000,000 is more than 262,144"),
    "heads 10**6": (["--num-attention-heads", "1000000"], "--num-attention-heads 1,000,000 is more than 1,024"),
    "head dim 10**6": (["--head-dim", "1000000"], "--head-dim 1,000,000 is more than 1,024"),
    "markov rank 10**9": (["--model-kind", "dspark", "--markov-rank", "1000000000"],
                          "dspark.markov_rank 1,000,000,000 is more than 4,096"),
    "anchors 10**6": (["--anchors", "random", "--num-anchors", "1000000"], "--num-anchors 1,000,000 is more than 32,768"),
    "batch tokens 10**9": (["--batch-tokens", "1000000000"], "--batch-tokens 1,000,000,000 is more than 1,048,576"),
    "workers 10**5": (["--num-workers", "100000"], "--num-workers 100,000 is more than 256"),
    "conv taps 10**6": (["--model-kind", "dflash2", "--conv-kernel-size", "1000000"],
                        "dflash2.conv_kernel_size 1,000,000 is more than 256"),
}


@pytest.mark.parametrize("name", list(SIZES))
def test_sizes_that_multiply_memory_or_time_are_refused_with_the_limit(runs, tmp_path, name):
    args, expected = SIZES[name]
    start = time.monotonic()
    base = ["run", "--cache", runs["cache"], "--out", str(tmp_path / "run"), "--steps", "1", "--eval-sequences", "0",
            "--quiet"]
    _one_line(base + args, expected)
    assert time.monotonic() - start < 30 and not (tmp_path / "run").exists()


def test_a_drafter_too_large_for_any_node_is_refused_from_its_sizes():
    from dflash_common.errors import ConfigError
    from dflash_train.settings.drafter_config import DrafterConfig

    with pytest.raises(ConfigError, match=r"the drafter would have [\d,]+ weights .* more than 32,000,000,000"):
        DrafterConfig(hidden_size=16384, num_attention_heads=128, num_key_value_heads=128, head_dim=128,
                      intermediate_size=200_000, vocab_size=1000, mask_token_id=0, target_layer_ids=(1,),
                      num_target_layers=126, num_hidden_layers=256)


def test_max_new_tokens_past_the_teachers_context_is_refused(runs, teacher_dir, tmp_path):
    """--max-new-tokens 10**9 decoded on past the teacher's 4,096 positions (for days)."""
    teacher = teacher_dir("qwen3")
    drafter = str(runs["dflash"] / "drafter")
    expected = ["--max-new-tokens 1,000,000,000 after a prompt of ", "runs past the teacher's context of 4,096 "
                "positions (max_position_embeddings); pass --max-new-tokens "]
    _one_line(["generate", "--checkpoint", drafter, "--teacher", teacher, "--prompt", "hello",
               "--max-new-tokens", "1000000000"], expected)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    _one_line(["eval", "--checkpoint", drafter, "--teacher", teacher, "--prompts", str(prompts), "--out",
               str(tmp_path / "e.json"), "--max-new-tokens", "1000000000", "--quiet"], expected)


# ---------------------------------------------------------------------------------------------
# 4. Weights checked against their config: export, eval, --init-from


def _dflash2(drafter: dict) -> None:
    drafter["architectures"] = ["DFlash2DraftModel"]
    drafter["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=4)


def _dspark(drafter: dict) -> None:
    drafter["architectures"] = ["DSparkDraftModel"]
    drafter.update(markov_rank=16, enable_confidence_head=True)


MISMATCHES = {
    # a DFlash2 checkpoint whose recorded selector rank is not its codebooks'
    "selector rank 32 over rank-16 weights": (
        "dflash2", lambda d: d["dflash_config"].update(selector_rank=32),
        "tensor 'candidate_selector.hidden_projection.weight' has shape (16, 64), the config implies (32, 64)"),
    "a DFlash2 config over DFlash weights": ("dflash", _dflash2, "it lacks tensor "
                                             "'candidate_selector.hidden_projection.weight' of shape (16, 64) (7 missing)"),
    "a DSpark config over DFlash2 weights": ("dflash2", _dspark, "it lacks tensor 'confidence_head.proj.bias'"),
    "a DFlash config over DFlash2 weights": (
        "dflash2", lambda d: d.update(architectures=["DFlashDraftModel"]),
        "it has tensor 'candidate_selector.hidden_projection.weight', which a drafter of that config lacks"),
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_weights_that_disagree_with_their_config_are_never_exported_or_loaded(runs, tmp_path, name):
    run, edit, mismatch = MISMATCHES[name]
    step = _copy(_step(runs, run), tmp_path / "step-000002")
    _edit_drafter(step, edit)
    expected = [f"checkpoint {step}: model.safetensors does not match the drafter config in trainer.pt: {mismatch}"]
    _one_line(["export", str(step), str(tmp_path / "exp")], expected)
    assert not (tmp_path / "exp").exists()
    _one_line(["eval", "--checkpoint", str(step), "--cache", runs["cache"], "--out", str(tmp_path / "e.json"),
               "--quiet"], expected)
    _one_line(["run", "--cache", runs["cache"], "--out", str(tmp_path / "init"), "--steps", "1", "--init-from",
               str(step), *SMALL], expected)


def test_an_export_whose_weights_disagree_with_config_json_is_refused(runs, tmp_path):
    """The export side of the same check (read_export): a DFlash2 export's config.json edited to a
    DSpark drafter."""
    export = _copy(runs["dflash2"] / "drafter", tmp_path / "drafter")
    config = json.loads((export / "config.json").read_text())
    config["architectures"] = ["DSparkDraftModel"]
    (export / "config.json").write_text(json.dumps(config))
    _one_line(["eval", "--checkpoint", str(export), "--cache", runs["cache"], "--out", str(tmp_path / "e.json"),
               "--quiet"], f"{export}/model.safetensors does not match config.json beside it: it lacks tensor")


def test_export_writes_nothing_from_weights_its_config_does_not_describe(runs, tmp_path):
    """export_weights itself (every export goes through it) refuses a state of another shape."""
    from dflash_train.settings.drafter_config import DrafterConfig
    from dflash_train.training.export import ExportError, export_weights

    step = _step(runs, "dflash2")
    drafter = torch.load(step / "trainer.pt", weights_only=True)["drafter"]
    weights = safetensors.torch.load_file(str(step / "model.safetensors"))
    drafter["dflash_config"]["selector_rank"] = 4096
    with pytest.raises(ExportError, match="nothing was exported .* the config implies"):
        export_weights(DrafterConfig.from_hf_config(drafter), weights, tmp_path / "exp")
    assert not (tmp_path / "exp").exists()


# 5. --init-from says what it kept; a run folder or an incomplete checkpoint is named as one


def test_init_from_names_a_run_folder_a_checkpoints_folder_and_an_incomplete_checkpoint(runs, tmp_path):
    """They were read as exports: `drafter config has no 'hidden_size'` (the train config.json)."""
    run = runs["dflash"]
    init = ["run", "--cache", runs["cache"], "--out", str(tmp_path / "init"), "--steps", "1", *SMALL, "--init-from"]
    _one_line([*init, str(run)], [f"--init-from {run} is a training run's folder, not a drafter; pass its newest "
                                  f"checkpoint, {run / 'checkpoints' / 'step-000002'} or its export, {run / 'drafter'}"])
    _one_line([*init, str(run / "checkpoints")], f"is a run's checkpoints folder, not a checkpoint; pass one of its "
                                                 f"step folders, e.g. {run / 'checkpoints' / 'step-000002'}")
    unfinished = _copy(_step(runs), tmp_path / "checkpoints" / "step-000002")
    (unfinished / "COMPLETE").unlink()
    (unfinished / "model.safetensors").unlink()
    _one_line([*init, str(unfinished)], f"--init-from {unfinished} is an incomplete checkpoint: it lacks "
                                        "model.safetensors, COMPLETE (its save did not finish")
    no_trainer = _copy(_step(runs), tmp_path / "whole" / "step-000002")
    (no_trainer / "trainer.pt").unlink()  # COMPLETE there: the checkpoint's own reader names the file
    _one_line([*init, str(no_trainer)], "trainer.pt is missing")
    assert not (tmp_path / "init").exists() or not (tmp_path / "init" / "checkpoints").exists()


def test_init_from_a_causal_drafter_into_a_non_causal_run_says_so(runs, tmp_path):
    """The causal export trained on as a non-causal drafter without a word."""
    causal = tmp_path / "causal"
    made = CliRunner().invoke(app, ["run", "--cache", runs["cache"], "--out", str(causal), "--steps", "1", "--causal", *SMALL])
    assert made.exit_code == 0, made.output
    result = CliRunner().invoke(app, ["run", "--cache", runs["cache"], "--out", str(tmp_path / "plain"), "--steps", "1",
                                      *SMALL, "--init-from", str(causal / "drafter")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    said = [line for line in lines if line.startswith("starting from the drafter weights")]
    assert said == [f"starting from the drafter weights of {causal / 'drafter'}: kept its 14 tensors (optimizer and "
                    "schedule fresh); not kept from the drafter config it was trained with (this run's options apply): "
                    "causal true -> false"], result.output
    assert (f"warning: --init-from {causal / 'drafter'} was trained with causal blocks and this run trains non-causal "
            "ones, so its drafter will be served with attention its weights did not learn; pass --causal to keep "
            "causal blocks") in lines
    same = CliRunner().invoke(app, ["run", "--cache", runs["cache"], "--out", str(tmp_path / "same"), "--steps", "1",
                                    *SMALL, "--causal", "--init-from", str(causal / "drafter")])
    assert same.exit_code == 0 and "its drafter config equals this run's" in same.output and "warning" not in same.output


def test_config_changes_lists_nested_fields_by_dotted_name():
    from dflash_train.settings.drafter_config import DrafterConfig
    from dflash_train.settings.dspark_config import DSparkConfig
    from dflash_train.training.session import config_changes

    base = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                         vocab_size=100, mask_token_id=0, target_layer_ids=(0, 2), num_target_layers=4,
                         dspark=DSparkConfig())
    other = DrafterConfig(**{**base.__dict__, "causal": True, "block_size": 8,
                             "dspark": DSparkConfig(sample_from_anchor=False)})
    assert config_changes(base, base) == []
    assert config_changes(base, other) == ["block_size 16 -> 8", "dspark.sample_from_anchor true -> false",
                                           "causal false -> true"]
