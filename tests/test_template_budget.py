"""Chat templates are bounded by the work they do and the text they build (issue 36, items 2 and 3).

Each hostile template renders in a child process held to 3 GiB of address space and a time
limit, so a template the budget misses fails its case (MemoryError, a timeout) instead of
stalling the suite or the machine. A refusal must be TemplateTooCostly naming the template, in
bounded time and memory; a real template must render exactly as the tokenizer renders it.
"""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import peak_rss_kib
from typer.testing import CliRunner

from cli.cache import app as cache_app

S = "'" + "x" * 100_000 + "'"  # a 100,000-character string, as a template literal
NS = "{% set ns = namespace(s='x') %}"
HOSTILE = {
    # work without range(): loops over any iterable, recursion, macro calls, lipsum (item 2)
    "nested loops over a string": "{% set s = " + S + " %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "nested loops whose test is false": "{% set s = " + S + " %}{% for a in s %}{% for b in s if false %}{% endfor %}"
                                        "{% endfor %}",
    "a macro calling itself twice to depth 40": "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                                                "{% endmacro %}{{ f(40) }}",
    "a recursive loop over 12,500,000 leaves": "{% set t = [[[[[1, 2] * 50] * 50] * 50] * 50] %}{% for x in t recursive %}"
                                               "{% if x is iterable %}{{ loop(x) }}{% endif %}{% endfor %}",
    "lipsum(1000000)": "{{ lipsum(1000000) }}",
    # strings measured before they are built (item 3)
    "a 30-step doubling with ~": NS + "{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "a 30-step doubling with |replace": NS + "{% for i in range(30) %}{% set ns.s = ns.s|replace('x', 'xx') %}"
                                            "{% endfor %}{{ ns.s|length }}",
    "a 30-step doubling with |join": NS + "{% for i in range(30) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}",
    "a 30-step doubling with .replace": NS + "{% for i in range(30) %}{% set ns.s = ns.s.replace('x', 'xx') %}"
                                             "{% endfor %}",
    "a 30-step doubling with .join": NS + "{% for i in range(30) %}{% set ns.s = ''.join([ns.s, ns.s]) %}{% endfor %}",
    "|center(10**9)": "{{ messages[0]['content']|center(10**9) }}",
    "'%1000000000d'|format": "{{ '%1000000000d'|format(messages|length) }}",
    "'%1000000000d' % n": "{% set f = '%1000000000d' %}{{ f % (messages|length) }}",
    ".ljust(10**9)": "{{ messages[0]['content'].ljust(10**9)|length }}",
    ".rjust(10**9)": "{{ messages[0]['content'].rjust(10**9)|length }}",
    ".center(10**9)": "{{ messages[0]['content'].center(10**9)|length }}",
    "'{:>N}'.format": "{{ '{:>1000000000}'.format(messages[0]['content'])|length }}",
    "'{:>{}}'.format with the width an argument": "{{ '{:>{}}'.format('x', 10**9)|length }}",
    "|indent(10**9)": "{{ (messages[0]['content'] ~ '\n')|indent(10**9)|length }}",
    "|indent of many lines": "{% set s = '\n' * (messages|length * 1000000) %}{{ s|indent(1000)|length }}",
    "|tojson(indent=...)": "{{ (range(100000)|list)|tojson(indent=100000)|length }}",
    "a list of a megabyte string written out": "{% set s = 'x' * 1000000 %}{{ [s] * 100000 }}",
    "a list of a megabyte string joined": "{% set s = 'x' * 1000000 %}{{ ([s] * 100000)|join|length }}",
    "a thousand megabyte strings kept": "{% set ns = namespace(a=[]) %}{% set s = 'x' * 1000000 %}"
                                        "{% for i in range(2000) %}{% set ns.a = [ns.a, s ~ i] %}{% endfor %}",
    ".to_bytes(10**9)": "{{ (1).to_bytes(10**9, 'big')|length }}",
    "|batch(10**9) filled": "{{ [1]|batch(10**9, 'x')|list|length }}",
    "a list shared 40 times over, written": "{% set ns = namespace(a=[1]) %}{% for i in range(40) %}"
                                            "{% set ns.a = [ns.a, ns.a] %}{% endfor %}{{ ns.a }}",
    # containers counted as well as text (issue 60): millions of lists, and no text
    "40 lists of a million one-item lists (|batch(1)|list)": "{% set ns = namespace(a=[]) %}{% set s = 'x' * 1000000 %}"
                                                             "{% for i in range(40) %}{% set ns.a = [ns.a, s|batch(1)|list] %}"
                                                             "{% endfor %}",
    "a megabyte split 40 times, kept": "{% set ns = namespace(a=[]) %}{% set s = 'xy ' * 333333 %}"
                                       "{% for i in range(40) %}{% set ns.a = [ns.a, s.split()] %}{% endfor %}",
}

_WORKER = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from transformers import AutoTokenizer
from dflash_teacher.chat_template import render_chat
folder, cases = sys.argv[1], json.loads(sys.stdin.read())
tokenizer = AutoTokenizer.from_pretrained(folder)
own = tokenizer.chat_template
chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
results = {}
for name, prefix in cases.items():
    tokenizer.chat_template = prefix + own
    start = time.monotonic()
    try:
        render_chat(tokenizer, chat, False)
        outcome = "rendered"
    except BaseException as err:
        outcome = f"{type(err).__name__}: {err}"
    results[name] = {"outcome": outcome, "seconds": time.monotonic() - start,
                     "peak_mb": peak_rss_kib() // 1024}
    print(json.dumps({name: results[name]}), flush=True)
tokenizer.chat_template = own
ours = render_chat(tokenizer, chat, False)
theirs = tokenizer.apply_chat_template(chat, tokenize=False)
print(json.dumps({"own template": {"same": ours == theirs}}), flush=True)
"""
_WORKER = inspect.getsource(peak_rss_kib) + _WORKER


@pytest.fixture(scope="module")
def outcomes(teacher_dir) -> dict:
    """Every hostile template rendered once in one limited child process."""
    proc = subprocess.run([sys.executable, "-c", _WORKER, teacher_dir("qwen3")], input=json.dumps(HOSTILE),
                          capture_output=True, text=True, timeout=300)
    results: dict = {}
    for line in proc.stdout.splitlines():
        results.update(json.loads(line))
    results["_stderr"] = proc.stderr[-2000:]
    return results


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_costly_template_is_refused_in_bounded_time_and_memory(outcomes, name):
    assert name in outcomes, f"the child died before this case: {outcomes['_stderr']}"
    result = outcomes[name]
    assert result["outcome"].startswith("TemplateTooCostly: the chat template of "), result
    assert "fix or replace the template" in result["outcome"] and "\n" not in result["outcome"], result
    assert result["seconds"] < 60 and result["peak_mb"] < 1500, result


def test_a_real_template_renders_as_the_tokenizer_does(outcomes):
    assert outcomes.get("own template") == {"same": True}, outcomes["_stderr"]


@pytest.mark.parametrize("source", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_dry_run_refuses_a_hanging_template_from_either_file_in_one_line(tmp_path, teacher_dir, source):
    teacher = tmp_path / "teacher"
    shutil.copytree(teacher_dir("qwen3"), teacher)
    hostile = HOSTILE["nested loops over a string"] + (teacher / "chat_template.jinja").read_text()
    if source == "chat_template.jinja":
        (teacher / "chat_template.jinja").write_text(hostile)
    else:
        (teacher / "chat_template.jinja").unlink()
        config = json.loads((teacher / "tokenizer_config.json").read_text())
        config["chat_template"] = hostile
        (teacher / "tokenizer_config.json").write_text(json.dumps(config))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    result = CliRunner().invoke(cache_app, ["build", "--teacher", str(teacher), "--data", str(data), "--out",
                                            str(tmp_path / "cache"), "--layers", "0", "--dry-run", "--quiet"])
    assert result.exit_code == 1, result.output
    assert "teacher fails on every chat" in result.output and "took more than 1,000,000 steps" in result.output, \
        result.output
    assert not Path(tmp_path / "cache").exists()
