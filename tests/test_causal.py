"""Causal attention inside the block (model.causal, JetSpec's drafter): a later block token cannot
change an earlier position's logits, the drafter trains, exports with dflash_config.causal = true
(what vLLM reads) and decodes losslessly; export says SGLang cannot serve it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import write_jsonl
from test_speculative import (
    RUN_MASK,
    copy_drafter,
    hf_greedy,
    one_thread,  # noqa: F401 (the fixture: one thread for tiny models)
    random_drafter,
    run_teacher,
)
from typer.testing import CliRunner

from cli.train import app
from dflash_common.errors import ConfigError
from dflash_train.config import config_from_dict
from dflash_train.measuring.serving import SGLANG_NO_CAUSAL, serve_commands
from dflash_train.measuring.speculative import mean_accepted_length, speculative_generate
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.training.export import read_export_config
from dflash_train.training.model import DFlashDrafter


def causal_drafter(cfg: DrafterConfig, embed: torch.Tensor, lm_head: torch.Tensor) -> DFlashDrafter:
    """DFlashDrafter of `cfg` made causal (a `cls` for the test_speculative drafter builders)."""
    return DFlashDrafter(dataclasses.replace(cfg, causal=True), embed, lm_head)


@pytest.mark.parametrize("causal", [True, False])
def test_a_later_block_token_changes_an_earlier_positions_logits_only_without_causal(causal):
    teacher = run_teacher("qwen3", 0.14)
    drafter = random_drafter(teacher, 6, RUN_MASK, seed=2, cls=causal_drafter if causal else DFlashDrafter)
    assert drafter.cfg.causal == causal and drafter.cfg.layer_types == ("full_attention",) * 2
    context = torch.randn(1, 9, 2, drafter.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    block = torch.tensor([[5, RUN_MASK, RUN_MASK, RUN_MASK, RUN_MASK, RUN_MASK]])
    later = block.clone()
    later[0, 3:] = torch.tensor([7, 8, 9])  # block positions 3.. hold other tokens
    with torch.no_grad():
        base, other = (drafter.logits(drafter.forward_block(context, b)) for b in (block, later))
    assert torch.equal(base[:, :3], other[:, :3]) == causal
    assert not torch.equal(base[:, 3:], other[:, 3:])


def test_causal_greedy_decoding_equals_the_teacher_with_high_acceptance():
    """A causal copy drafter (every position copies the anchor, which each position may still see):
    the output is the teacher's own, and blocks are accepted in part and in full."""
    teacher = run_teacher("qwen3", 0.14)
    drafter = copy_drafter(teacher, 4, cls=causal_drafter)
    assert drafter.cfg.causal
    results = []
    for prompt, max_new in (([3, 7, 3, 9, 12], 30), ([5, 5, 1], 31), ([20, 2, 17, 4, 4, 9, 0], 29)):
        result = speculative_generate(teacher, drafter, prompt, SpecConfig(max_new_tokens=max_new))
        assert result.tokens == hf_greedy(teacher, prompt, max_new), prompt
        results.append(result)
    assert mean_accepted_length(results) > 1.4  # a random drafter gets 1.0: acceptance really happened
    assert 4 in {n for r in results for n in r.accepted_lengths}  # a whole block plus the bonus


def test_causal_is_a_bool_and_only_true_is_exported():
    assert config_from_dict({"cache": "c", "out": "o", "model": {"causal": True}}).model.causal is True
    with pytest.raises(ConfigError, match="must be true or false"):
        config_from_dict({"cache": "c", "out": "o", "model": {"causal": "yes"}})
    teacher = run_teacher("qwen3", 0.14)
    plain = random_drafter(teacher, 4, RUN_MASK).cfg
    # vLLM reads an explicit false as "no layer is causal", sliding ones included: it is never written
    assert "causal" not in plain.to_hf_config()["dflash_config"]
    config = dataclasses.replace(plain, causal=True).to_hf_config()
    assert config["dflash_config"]["causal"] is True and DrafterConfig.from_hf_config(config).causal is True
    config["dflash_config"]["causal"] = "true"
    with pytest.raises(ConfigError, match="dflash_config.causal 'true' is not true or false"):
        DrafterConfig.from_hf_config(config)


def test_causal_drafter_trains_exports_and_decodes_losslessly(tmp_path, cache_url, teacher_dir):
    """`run --causal`: the export carries dflash_config.causal = true, its serve commands give vLLM's
    and say in one line that SGLang cannot serve it; decoding with the teacher equals the teacher alone."""
    runner = CliRunner()
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", "--cache", cache_url, "--out", str(out), "--causal", "--steps", "6",
                                 "--save-every", "3", "--num-layers", "1", "--block-size", "4", "--eval-sequences", "0",
                                 "--batch-tokens", "600", "--log-every", "3", "--quiet"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["causal"] is True
    assert read_export_config(out / "drafter").causal is True
    assert "vllm serve TEACHER --speculative-config" in result.output
    assert f"SGLang: {SGLANG_NO_CAUSAL}" in result.output and "\n" not in SGLANG_NO_CAUSAL

    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hello there"}, {"prompt": "what is a cat"}])
    report = tmp_path / "eval.json"
    evaluated = runner.invoke(app, ["eval", "--checkpoint", str(out / "drafter"), "--teacher", teacher_dir("qwen3"),
                                    "--prompts", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "16",
                                    "--out", str(report), "--quiet"])
    assert evaluated.exit_code == 0, evaluated.output
    decoding = json.loads(report.read_text())["decoding"]
    assert decoding["matched_teacher"] is True and decoding["accepted_length"] >= 1.0


def test_serve_commands_of_a_causal_drafter():
    cfg = dataclasses.replace(random_drafter(run_teacher("qwen3", 0.14), 4, RUN_MASK).cfg, causal=True)
    commands = serve_commands("exp", cfg)
    assert commands["vllm"].startswith("vllm serve TEACHER") and '"method": "dflash"' in commands["vllm"]
    assert commands["sglang"] == SGLANG_NO_CAUSAL and commands["sglang"].startswith("not available")
