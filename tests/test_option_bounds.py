"""JSON in options and a drafter's config.json are bounded and typed before anything is built from
them (issue 36, "also"): a 5,000-digit or deeply nested number in --vllm-args, --storage-options,
--grid or --set, and an export whose num_hidden_layers is "abc" or 10**9, whose layer_types or
target_layer_ids is an int, or whose rope_theta is a string, are each one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
DIGITS = "1" + "0" * 5000
DEEP = "[" * 50_000 + "]" * 50_000  # one argument may be at most 128 KiB


def _one_line(args: list[str]) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("option, value, message", [
    ("--vllm-args", '{"max_num_seqs": ' + DIGITS + "}", "--vllm-args cannot be read (Exceeds the limit (4300 digits)"),
    ("--vllm-args", '{"a": ' + DEEP + "}", "--vllm-args is nested too deeply to parse"),
    ("--vllm-args", '{"a": ' + "[" * 100 + "]" * 100 + "}", "--vllm-args is nested more than 32 levels deep"),
    ("--storage-options", '{"a": ' + DIGITS + "}", "--storage-options cannot be read (Exceeds the limit (4300 digits)"),
    ("--storage-options", '{"a": 1e999}', "--storage-options cannot be read (1e999 is beyond a float's range)"),
])
@pytest.mark.fast_cases(2)
def test_a_json_option_holding_what_python_cannot_is_one_line(tmp_path, option, value, message):
    (tmp_path / "chat.jsonl").write_text("")
    line = _one_line([str(BIN / "dflash-cache"), "build", "--teacher", str(tmp_path), "--data", str(tmp_path / "chat.jsonl"),
                      "--out", str(tmp_path / "cache"), "--engine", "vllm", "--quiet", option, value])
    assert message in line, line


@pytest.mark.parametrize("grid, message", [
    ("loss=ce," + DIGITS, "--grid value '1000000000000000000000000000000000000000'... cannot be read (Exceeds the limit"),
    ("loss=ce," + DEEP, "is nested too deeply to parse"),
    ("loss=ce,1e999", "--grid value '1e999' cannot be read (1e999 is beyond a float's range)"),
])
def test_a_grid_value_holding_what_python_cannot_is_one_line(tmp_path, grid, message):
    line = _one_line([str(BIN / "dflash-train"), "sweep", "--cache", str(tmp_path), "--out", str(tmp_path / "sw"),
                      "--grid", grid, "--quiet"])
    assert message in line, line


# --------------------------------------------------------------------------- drafter config.json

_WORKER = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from dflash_common.errors import ConfigError
from dflash_train.settings.drafter_config import DrafterConfig, drafter_config_from_export, export_config
good = export_config(DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   intermediate_size=64, vocab_size=100, rms_norm_eps=1e-6, rope_theta=10000.0,
                                   max_position_embeddings=128, mask_token_id=5, target_layer_ids=(0, 2),
                                   num_target_layers=4, num_hidden_layers=2, block_size=4))
for edit in json.loads(sys.stdin.read()):
    config = json.loads(json.dumps(good))
    for path, value in edit.items():
        *parents, last = path.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[last] = value
    try:
        drafter_config_from_export(config)
        print("accepted")
    except ConfigError as err:
        print(f"ConfigError: {err}")
    except BaseException as err:
        print(f"{type(err).__name__}: {err}".splitlines()[0][:300])
"""

_DRAFTER = {
    "num_hidden_layers 'abc'": ({"num_hidden_layers": "abc"}, "drafter config num_hidden_layers 'abc' is not a whole number"),
    "num_hidden_layers 10**9": ({"num_hidden_layers": 10**9}, "num_hidden_layers 1000000000 is not a whole number from 0 "
                                                              "to 1,024"),
    "layer_types an int": ({"layer_types": 7}, "drafter config layer_types 7 is not a list of layer type names"),
    "target_layer_ids an int": ({"dflash_config.target_layer_ids": 3}, "dflash_config.target_layer_ids 3 is not a list"),
    "rope_theta a string": ({"rope_theta": "big"}, "drafter config rope_theta 'big' is not a finite number"),
    "rope_parameters.rope_theta a string": ({"rope_theta": None, "rope_parameters.rope_theta": "x"},
                                            "rope_parameters.rope_theta 'x' is not a finite number"),
    "vocab_size 10**12": ({"vocab_size": 10**12}, "vocab_size 1000000000000 is not a whole number from 0 to 16,777,216"),
    "mask_token_id a float": ({"dflash_config.mask_token_id": 5.5}, "mask_token_id 5.5 is not a whole number"),
}


@pytest.fixture(scope="module")
def drafter_outcomes() -> dict[str, str]:
    edits = [edit for edit, _ in _DRAFTER.values()] + [{}]
    result = subprocess.run([sys.executable, "-c", _WORKER], input=json.dumps(edits), capture_output=True, text=True,
                            timeout=120)
    lines = result.stdout.splitlines()
    assert len(lines) == len(edits), result.stderr[-2000:]
    return dict(zip(list(_DRAFTER) + ["unedited"], lines))


@pytest.mark.parametrize("case", list(_DRAFTER))
def test_a_drafter_config_of_wrong_types_is_one_line_before_anything_is_built(drafter_outcomes, case):
    outcome = drafter_outcomes[case]
    assert outcome.startswith("ConfigError: ") and _DRAFTER[case][1] in outcome, outcome
    assert outcome.endswith("the file is damaged or edited: export the drafter again"), outcome


def test_an_unedited_export_config_still_reads(drafter_outcomes):
    assert drafter_outcomes["unedited"] == "accepted"


# --------------------------------------------------------------------------- knobs that train nothing


@pytest.mark.parametrize("option, value, message", [
    ("--kl-temperature", "1e-30", "kl_temperature 1e-30 is outside [0.1, 100]: the T^2 factor would leave the kl term "
                                  "almost no gradient, so the run would train nothing; pass a temperature in that range"),
    ("--kl-temperature", "0.05", "kl_temperature 0.05 is outside [0.1, 100]"),
    ("--kl-temperature", "1e6", "kl_temperature 1e+06 is outside [0.1, 100]: the tempered distributions would be within "
                                "fp32 rounding of uniform"),
    ("--lr", "1e-30", "--lr 1e-30 is below 1e-08: AdamW's steps of about lr would round away in the fp32 weights and the "
                      "run would train nothing; pass e.g. 6e-4"),
    ("--noise-start", "1e30", "--noise-start 1e+30 is above 1e+06, the largest RMS a model's hidden states have"),
])
def test_a_knob_value_that_would_train_nothing_is_refused_naming_the_bound(tmp_path, option, value, message):
    """A positive value that trains nothing (--kl-temperature 1e-30 trained at loss 0.0000) is
    refused when the config is built, before the cache is opened, with the bound and why."""
    from typer.testing import CliRunner

    from cli.train import app

    extra = ["--noise", "constant"] if option == "--noise-start" else []
    result = CliRunner().invoke(app, ["run", "--cache", str(tmp_path / "no-cache"), "--out", str(tmp_path / "run"),
                                      "--quiet", option, value, *extra])
    lines = [line for line in result.output.strip().splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(lines) == 1 and "Traceback" not in result.output, result.output
    assert message in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_the_bounds_keep_the_values_runs_use():
    from dflash_train.settings.loss_config import LossConfig
    from dflash_train.settings.noise_config import NoiseConfig
    from dflash_train.settings.optim_config import OptimConfig

    for temperature in (0.1, 0.5, 1.0, 2.0, 20.0, 100.0):
        LossConfig(temperature=temperature)
    for lr in (1e-8, 1e-5, 6e-4, 1e-2):
        OptimConfig(lr=lr)
    NoiseConfig(schedule="constant", start=1e6)
