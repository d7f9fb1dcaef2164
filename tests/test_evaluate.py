"""Offline evaluation: streaks, assistant spans, greedy replay and the eval command's report."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cli.train import app
from dflash_train.measuring.replay import assistant_spans
from dflash_train.training.heldout import streak_lengths


def test_streak_lengths_count_leading_hits():
    hits = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert streak_lengths(hits).tolist() == [2, 0, 4, 1]


def test_assistant_spans_are_runs_of_the_loss_mask():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1], dtype=torch.bool)
    assert assistant_spans(mask, 11) == [(2, 5), (7, 9), (10, 11)]
    assert assistant_spans(mask, 8) == [(2, 5), (7, 8)]
    assert assistant_spans(torch.zeros(4, dtype=torch.bool), 4) == []


def test_assistant_spans_stay_on_the_masks_device():
    """A batch on the GPU (eval --device cuda) must not meet a tensor made on the CPU. A meta-device
    mask shows that without a GPU: the spans are computed on its device up to the first read of a
    value (which a meta tensor cannot give: NotImplementedError), where a CPU tensor in the way
    stops it first with a device mismatch (RuntimeError)."""
    mask = torch.tensor([0, 1, 1, 0], dtype=torch.bool).to("meta")
    with pytest.raises(NotImplementedError):
        assistant_spans(mask, 4)


def test_eval_command_writes_report_and_plot(tmp_path, cache_url):  # noqa: F811
    run_dir = tmp_path / "run"
    args = ["run", "--cache", cache_url, "--out", str(run_dir), "--steps", "4", "--num-layers", "1",
            "--block-size", "4", "--eval-sequences", "0", "--heldout-fraction", "0.2", "--quiet"]
    assert CliRunner().invoke(app, args).exit_code == 0
    out = tmp_path / "eval" / "report.json"
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(run_dir / "checkpoints" / "step-000004"),
                                      "--cache", cache_url, "--heldout-fraction", "0.2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    offline = report["offline"]
    assert len(offline["alpha"]) == 3 and len(offline["greedy"]) == 3
    assert 1.0 <= offline["tau"] <= 4.0 and 1.0 <= offline["tau_greedy"] <= 4.0
    assert abs(offline["tau_greedy"] - (1 + offline["greedy_streak"])) < 1e-9
    replay = report["greedy_replay"]
    assert replay["rounds"] > 0 and 1.0 <= replay["accepted_length"] <= 4.0
    assert sum(replay["accepted_histogram"]) == replay["rounds"]
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "tau (sampling estimate)" in result.output
    # the exported drafter evaluates to the same numbers (bf16 export: close, not equal)
    again = CliRunner().invoke(app, ["eval", "--checkpoint", str(run_dir / "drafter"), "--cache", cache_url,
                                     "--heldout-fraction", "0.2", "--out", str(tmp_path / "e2.json")])
    assert again.exit_code == 0, again.output
    assert abs(json.loads((tmp_path / "e2.json").read_text())["offline"]["tau"] - offline["tau"]) < 0.05
    # without --heldout-fraction the run's own (0.2, from its config.json) is evaluated, not the default
    for name, extra in (("run.json", []), ("default.json", ["--heldout-fraction", "0.02"])):
        done = CliRunner().invoke(app, ["eval", "--checkpoint", str(run_dir / "checkpoints" / "step-000004"),
                                        "--cache", cache_url, "--out", str(tmp_path / name), *extra])
        assert done.exit_code == 0, done.output
    positions = {name: json.loads((tmp_path / name).read_text())["offline"]["positions"]
                 for name in ("run.json", "default.json")}
    assert positions["run.json"] == offline["positions"] != positions["default.json"]
