"""One chat-template setting end to end: regenerate, build, eval and generate render with it.

The template here reads `enable_thinking`, as Qwen3's does: with thinking on, the assistant turn
opens with an empty think block; with it off, it does not. A drafter trained on one rendering
and served with the other accepts far less (z-lab/dflash #60), so the cache records the setting
and eval/generate use it by default and refuse another unless told.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import qa_rows, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from cli.train import app as train_app
from dflash_cache import open_cache

BIN = Path(sys.executable).parent
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' and enable_thinking is not false %}{{- 'think: ' }}"
    "{%- if message.get('reasoning_content') %}{{- message['reasoning_content'] + ' / ' }}{%- endif %}{%- endif %}"
    "{{- message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is not false %}{{- 'think: ' }}{%- endif %}{%- endif %}"
)
OFF = json.dumps({"enable_thinking": False})


@pytest.fixture(scope="module")
def thinking_teacher(tmp_path_factory, teacher_dir) -> str:
    folder = tmp_path_factory.mktemp("thinking") / "teacher"
    shutil.copytree(teacher_dir("qwen3"), folder)
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def _template_hash(teacher: str) -> str:
    """The hash of the chat template file itself, as eval and the build compute it (xxh64 of its text)."""
    import xxhash

    return xxhash.xxh64((Path(teacher) / "chat_template.jinja").read_text().encode()).hexdigest()


def _build(teacher, data, out, *extra):
    result = CliRunner().invoke(cache_app, ["build", "--teacher", teacher, "--data", data, "--out", str(out),
                                            "--dtype", "float32", "--layers", "0,2", "--top-k", "4", "--quiet", *extra])
    assert result.exit_code == 0, result.output
    return open_cache(str(out))


def test_build_records_and_renders_with_the_kwargs(tmp_path, thinking_teacher):
    data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(6, seed=7, prefix="tk-"))
    on, off = _build(thinking_teacher, data, tmp_path / "on"), _build(thinking_teacher, data, tmp_path / "off",
                                                                     "--chat-template-kwargs", OFF)
    assert on.chat_template_kwargs is None and off.chat_template_kwargs == {"enable_thinking": False}
    assert off.manifest["content_options"]["chat_template_kwargs"] == {"enable_thinking": False}
    # the template's hash beside the kwargs: what eval compares its teacher's template with
    assert off.manifest["tokenizer"]["chat_template_hash"] == _template_hash(thinking_teacher)
    record_on, record_off = next(iter(on.sequences())), next(iter(off.sequences()))
    assert record_on.id == record_off.id
    assert len(record_on.input_ids) > len(record_off.input_ids)  # "think: " tokens only with thinking on
    refused = CliRunner().invoke(cache_app, ["build", "--teacher", thinking_teacher, "--data", data, "--out",
                                             str(tmp_path / "off"), "--dtype", "float32", "--layers", "0,2",
                                             "--top-k", "4", "--quiet"])
    assert refused.exit_code == 1 and "chat_template_kwargs" in refused.output, refused.output


def test_regenerate_renders_with_the_kwargs_and_records_them(tmp_path, thinking_teacher):
    data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(3, seed=8, prefix="rg-"))
    outs = {}
    for name, extra in (("on", []), ("off", ["--chat-template-kwargs", OFF])):
        outs[name] = tmp_path / f"{name}.jsonl"
        result = CliRunner().invoke(cache_app, ["regenerate", "--teacher", thinking_teacher, "--data", data,
                                                "--out", str(outs[name]), "--max-new-tokens", "6", "--dtype", "float32",
                                                "--quiet", *extra])
        assert result.exit_code == 0, result.output
    settings = json.loads((tmp_path / "off.parts" / ".settings.json").read_text())
    assert settings["chat_template_kwargs"] == {"enable_thinking": False}
    assert settings["tokenizer"]["chat_template_hash"] == _template_hash(thinking_teacher)
    # the teacher saw other prompts, so it wrote other answers
    assert outs["on"].read_text() != outs["off"].read_text()
    refused = CliRunner().invoke(cache_app, ["regenerate", "--teacher", thinking_teacher, "--data", data,
                                             "--out", str(outs["off"]), "--max-new-tokens", "6", "--dtype", "float32",
                                             "--quiet"])
    assert refused.exit_code == 1 and "chat_template_kwargs differs" in refused.output


@pytest.mark.slow
def test_eval_and_generate_use_the_caches_kwargs_and_refuse_others(tmp_path, thinking_teacher):
    data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(10, seed=9, prefix="ev-"))
    cache = tmp_path / "cache"
    _build(thinking_teacher, data, cache, "--chat-template-kwargs", OFF)
    run = tmp_path / "run"
    trained = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(run), "--steps", "2",
                                             "--num-layers", "1", "--block-size", "4", "--eval-sequences", "0",
                                             "--heldout-fraction", "0.1", "--quiet"])
    assert trained.exit_code == 0, trained.output
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "what is the river"}])
    base = ["eval", "--checkpoint", str(run / "drafter"), "--teacher", thinking_teacher, "--prompts", prompts,
            "--max-new-tokens", "4", "--quiet"]

    def report(*extra):
        out = tmp_path / "eval.json"
        result = CliRunner().invoke(train_app, base + ["--out", str(out), *extra])
        return result, (json.loads(out.read_text()) if result.exit_code == 0 else None)

    result, default = report()  # no option: the cache's setting, found through the run's config.json
    assert result.exit_code == 0, result.output
    assert default["chat_template_kwargs"] == {"enable_thinking": False}
    refused, _ = report("--chat-template-kwargs", json.dumps({"enable_thinking": True}))
    assert refused.exit_code == 1 and "--allow-template-mismatch" in refused.output
    assert len(refused.output.strip().splitlines()) == 1
    result, mismatched = report("--chat-template-kwargs", json.dumps({"enable_thinking": True}), "--allow-template-mismatch")
    assert result.exit_code == 0, result.output
    assert mismatched["decoding"]["per_prompt"][0]["prompt_tokens"] > default["decoding"]["per_prompt"][0]["prompt_tokens"]

    def generate(*extra):
        proc = subprocess.run([str(BIN / "dflash-train"), "generate", "--checkpoint", str(run / "drafter"),
                               "--teacher", thinking_teacher, "--prompt", "what is the river", "--max-new-tokens", "4",
                               *extra], capture_output=True, text=True, timeout=300)
        return proc

    plain, thinking = generate(), generate("--chat-template-kwargs", json.dumps({"enable_thinking": True}),
                                           "--allow-template-mismatch")
    assert plain.returncode == 0 and thinking.returncode == 0, plain.stderr + thinking.stderr
    count = [int(p.stderr.split("[", 1)[1].split(" prompt tokens")[0]) for p in (plain, thinking)]
    assert count[1] > count[0]
    no = generate("--chat-template-kwargs", json.dumps({"enable_thinking": True}))
    assert no.returncode == 1 and "--allow-template-mismatch" in no.stderr


def test_kept_reasoning_is_rendered_by_the_template_and_learned(tmp_path, thinking_teacher):
    """regenerate --reasoning keep writes reasoning_content; the build renders it inside the answer."""
    from transformers import AutoTokenizer

    row = {"id": "think-1", "messages": [{"role": "user", "content": "why"},
                                         {"role": "assistant", "content": "because", "reasoning_content": "the river runs"}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [row])
    cache = _build(thinking_teacher, data, tmp_path / "cache")
    record = next(iter(cache.sequences()))
    tokenizer = AutoTokenizer.from_pretrained(thinking_teacher)
    learned = tokenizer.decode(record.input_ids[record.loss_mask.astype(bool)])
    assert "the river runs" in learned and "because" in learned


# --- issue 60: kwargs transformers reads as its own parameters, and kwargs a cache records -------

# A template doing 9,000,000 steps: the guarded render refuses it at 1,000,000; rendered unguarded it
# takes seconds (not hours, so a test of the old behaviour ends).
HEAVY = "{% for a in range(3000) %}{% for b in range(3000) %}{% endfor %}{% endfor %}"
RESERVED_CASES = {
    "chat_template": ({"chat_template": HEAVY}, "the template to render"),
    "continue_final_message": ({"continue_final_message": True}, "moves where a prompt ends"),
    "add_generation_prompt": ({"add_generation_prompt": False}, "moves where a prompt ends"),
    "tools": ({"tools": [{"name": "f"}]}, "tool_use template"),
    "messages": ({"messages": []}, "the chat itself"),
    "tokenize": ({"tokenize": True}, "changes what the render returns"),
    "range": ({"range": [1, 2]}, "shadow a function"),
}


@pytest.mark.parametrize("key", list(RESERVED_CASES))
def test_kwargs_transformers_takes_as_its_own_are_refused_in_one_line(tmp_path, teacher_dir, key):
    kwargs, why = RESERVED_CASES[key]
    data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(2, seed=1, prefix="rk-"))
    result = CliRunner().invoke(cache_app, ["build", "--teacher", teacher_dir("qwen3"), "--data", data, "--out",
                                            str(tmp_path / "cache"), "--layers", "0", "--dry-run", "--quiet",
                                            "--chat-template-kwargs", json.dumps(kwargs)])
    assert result.exit_code == 1, result.output
    line = result.output.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert f"--chat-template-kwargs holds {key!r} (" in line and why in line and "drop the key" in line, line
    assert not (tmp_path / "cache").exists()


def test_render_chat_refuses_a_template_given_by_kwargs(tokenizer_dir):
    """Any caller of the one rendering, not only the configs: the kwargs' template never renders."""
    from transformers import AutoTokenizer

    from dflash_common.errors import ConfigError
    from dflash_teacher.chat_template import render_chat

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(ConfigError, match="holds 'chat_template' \\(a string\\)"):
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], True, {"chat_template": HEAVY})


def test_the_guarded_render_sees_the_chat_the_real_render_sees(tokenizer_dir):
    """transformers drops None-valued message keys before rendering: a guarded render that kept them
    took the cheap branch of this template while the real render took the costly one."""
    from transformers import AutoTokenizer

    from dflash_teacher.chat_template import guarded_render, render_chat
    from dflash_teacher.render_budget import TemplateTooCostly

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = ("{% if messages[0].reasoning_content is not defined %}" + HEAVY + "{% endif %}"
                               + tokenizer.chat_template)
    chat = [{"role": "user", "content": "hi", "reasoning_content": None}]
    with pytest.raises(TemplateTooCostly, match="took more than 1,000,000 steps"):
        render_chat(tokenizer, chat, True)
    # and what it renders is what the tokenizer renders, kwargs, special tokens and aliases included
    tokenizer.chat_template = ("{% for m in messages %}{{ m.role }}{% if m.reasoning_content is defined %}"
                               "[{{ m.reasoning_content }}]{% endif %}{{ m.content }}{{ eos_token }}{% endfor %}"
                               "{{ flag }}{{ add_generation_prompt }}")
    chat = [{"role": "user", "content": "hi", "reasoning_content": None},
            {"role": "assistant", "content": "yo", "reasoning": "because"}]
    kwargs = {"flag": [1, {"a": None}], "eos_token": "<eos>"}
    ours = guarded_render(tokenizer, chat, True, kwargs)
    assert ours == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours == "userhi<eos>assistant[because]yo<eos>[1, {'a': None}]True"


@pytest.mark.parametrize("recorded, problem", [
    ("enable_thinking", "is a string 'enable_thinking', not a JSON object"),
    ([{"enable_thinking": False}], "is a list [{'enable_thinking': False}], not a JSON object"),
    ({"messages": [{"role": "user", "content": "x"}]}, "holds 'messages' (a list)"),
    ({"tokenize": True}, "holds 'tokenize' (a boolean)"),
    ({"chat_template": HEAVY}, "holds 'chat_template' (a string)"),
], ids=["a string", "a list", "messages", "tokenize", "a template"])
def test_a_caches_recorded_kwargs_are_checked_where_eval_and_generate_read_them(tmp_path, tiny_cache, recorded,
                                                                                 problem):
    from dflash_common.errors import CacheError
    from dflash_train.measuring.decode_report import cache_template, resolve_template_kwargs

    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache(), cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["content_options"]["chat_template_kwargs"] = recorded
    (cache / "manifest.json").write_text(json.dumps(manifest))
    field = "manifest.json's content_options.chat_template_kwargs"
    for read in (lambda: cache_template(str(tmp_path / "drafter"), str(cache)),  # eval
                 lambda: resolve_template_kwargs(str(tmp_path / "drafter"), str(cache), None, False)):  # generate
        with pytest.raises(CacheError) as refused:
            read()
        line = str(refused.value)
        assert "\n" not in line and field in line and problem in line, line
        assert line.endswith("rebuild the cache, or restore its manifest"), line


def test_every_parameter_transformers_renders_with_is_a_reserved_key():
    """The reserved keys follow the installed transformers: a new parameter of apply_chat_template
    (or of the render under it) fails here until it is named."""
    import inspect

    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    from dflash_common.template_kwargs import RESERVED_TEMPLATE_KWARGS

    parameters = {name for func in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template)
                  for name, p in inspect.signature(func).parameters.items()
                  if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert parameters - set(RESERVED_TEMPLATE_KWARGS) == set()
