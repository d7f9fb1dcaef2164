"""`dflash-train eval` and `generate` take their options from EvalConfig, GenerateConfig and the
DecodingConfig both share (SpecConfig's and DataConfig's fields reused), each declared once."""

from __future__ import annotations

import json

import pytest
import typer.main

from cli.train import app
from dflash_common.errors import ConfigError
from dflash_common.field_docs import field_docs
from dflash_common.knobs import make_config, nested_values
from dflash_train.options import decoding_knobs, eval_knobs, generate_knobs
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.eval_config import DecodingConfig, EvalConfig, GenerateConfig
from dflash_train.settings.spec_config import SpecConfig


def _command(name: str):
    return typer.main.get_command(app).commands[name]


def _options(name: str) -> dict[str, object]:
    return {decl: p for p in _command(name).params for decl in p.opts}


def _parsed(name: str, args: list[str], knobs) -> dict:
    """Nested config values of `dflash-train NAME ARGS`, as the command builds its config from them."""
    params = _command(name).make_context(name, args).params
    given = {k.name: params[k.name] for k in knobs}
    return nested_values(knobs, {n: v if v not in ([], ()) else None for n, v in given.items()})


def test_eval_and_generate_options_come_from_the_config_fields():
    evaluate, generate = _options("eval"), _options("generate")
    for knob in eval_knobs():
        assert knob.flag in evaluate and evaluate[knob.flag].help.startswith(knob.doc[:30]), knob.flag
    # generate's options are its prompt and the decoding settings it shares with eval, nothing else
    shared = {k.flag for k in decoding_knobs()}
    assert {k.flag for k in generate_knobs()} == shared | {"--prompt"}
    assert shared <= set(evaluate) and "--prompt" not in evaluate
    assert {p.name for p in _command("generate").params} - {k.name for k in generate_knobs()} == {"debug"}
    assert {p.name for p in _command("eval").params} - {k.name for k in eval_knobs()} == {"quiet", "debug"}
    # the offline options are DataConfig's fields, not declared again
    docs = field_docs(DataConfig)
    for name in ("batch_tokens", "num_anchors", "skip_shards"):
        assert evaluate[f"--{name.replace('_', '-')}"].help.startswith(docs[name][:30]), name
    assert "the training run's" in evaluate["--heldout-fraction"].help
    # one default for the length of an answer: SpecConfig's, which both commands show
    assert SpecConfig().max_new_tokens == 256
    assert "default 256" in evaluate["--max-new-tokens"].help and "default 256" in generate["--max-new-tokens"].help
    assert evaluate["--temperature"].multiple and generate["--temperature"].multiple


def test_options_reach_the_nested_config():
    values = _parsed("eval", ["--checkpoint", "ckpt", "--cache", "c", "--max-new-tokens", "12", "--temperature", "0",
                              "--temperature", "0.7", "--skip-shards", "a,b", "--batch-tokens", "64",
                              "--heldout-fraction", "0.1", "--storage-options", '{"anon": true}', "--top-p", "0.9",
                              "--chat-template-kwargs", '{"enable_thinking": false}'], eval_knobs())
    cfg = make_config(EvalConfig, values)
    assert cfg.decoding.checkpoint == "ckpt" and cfg.cache == "c" and cfg.storage_options == {"anon": True}
    assert cfg.decoding.temperatures == (0.0, 0.7) and cfg.decoding.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.decoding.spec == SpecConfig(max_new_tokens=12, top_p=0.9)
    assert cfg.data == DataConfig(batch_tokens=64, skip_shards=("a", "b"), heldout_fraction=0.1)
    specs = cfg.decoding.specs((7,))
    assert [(s.temperature, s.max_new_tokens, s.stop_token_ids) for s in specs] == [(0.0, 12, (7,)), (0.7, 12, (7,))]

    bare = make_config(GenerateConfig, _parsed("generate", ["--checkpoint", "d", "--teacher", "t", "--prompt", "hi"],
                                                      generate_knobs()))
    assert bare.decoding == DecodingConfig(checkpoint="d", teacher="t") and bare.decoding.temperatures == (0.0,)
    assert bare.decoding.dtype("cuda") == "bfloat16" and bare.decoding.dtype("cpu") == "float32"


def test_the_run_held_out_fraction_is_the_default(tmp_path):
    from dflash_train.measuring.commands import eval_config

    (tmp_path / "run" / "drafter").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text(json.dumps({"optim": {}, "data": {"heldout_fraction": 0.25}}))
    checkpoint = str(tmp_path / "run" / "drafter")
    assert eval_config({"decoding": {"checkpoint": checkpoint}, "cache": "c"}).data.heldout_fraction == 0.25
    given = {"decoding": {"checkpoint": checkpoint}, "cache": "c", "data": {"heldout_fraction": 0.5}}
    assert eval_config(given).data.heldout_fraction == 0.5


@pytest.mark.parametrize("changes, message", [
    ({}, "give --cache (offline) and/or --teacher with --prompts"),
    ({"cache": "c", "decoding": {"confidence_threshold": 0.3}}, "is a field of the built-in decoder"),
    ({"prompts": "p", "decoding": {"teacher": "t", "confidence_threshold": 0.3}, "engine": "vllm"}, "built-in decoder"),
    ({"cache": "c", "split": "train"}, "--split 'train' is not supported"),
    ({"cache": "c", "max_sequences": 0}, "--max-sequences 0"),
    ({"prompts": "p", "decoding": {"teacher": "t"}, "engine": "sglang"}, "--engine 'sglang' is unknown"),
    ({"prompts": "p", "decoding": {"teacher": "t", "temperatures": (1.0,)}, "engine": "both"},
     "--engine both measures greedy decoding; add --temperature 0"),
    ({"cache": "c", "decoding": {"teacher_dtype": "float16"}}, "--teacher-dtype 'float16' is unknown"),
    ({"cache": "c", "decoding": {"temperatures": (-1.0,)}}, "temperature=-1.0 must be a finite number >= 0"),
    ({"cache": "c", "decoding": {"temperatures": ()}}, "give at least one --temperature"),
])
def test_eval_settings_refuse_in_one_line_before_any_work(changes, message):
    decoding = {"checkpoint": "d", **changes.pop("decoding", {})}
    threshold = decoding.pop("confidence_threshold", 0.0)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EvalConfig(decoding=DecodingConfig(**decoding, spec=SpecConfig(confidence_threshold=threshold)), **changes)


def test_generate_needs_a_teacher():
    with pytest.raises(ConfigError, match="give --teacher"):
        GenerateConfig(decoding=DecodingConfig(checkpoint="d"), prompt="hi")
