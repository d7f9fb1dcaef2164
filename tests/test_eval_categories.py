"""Evaluation per benchmark category (issue 47): the per-category numbers from per-prompt rows
(pure), the sweep summary's per-category columns, and `dflash-train eval` with two prompt files
of different kinds at T=0 and T=1 on the tiny teacher: the table, the JSON, the plot, and the
one-line warnings when prompts are rendered otherwise than the cache's chats were."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from helpers import write_jsonl
from typer.testing import CliRunner

from cli.train import app
from dflash_train.measuring.categories import OVERALL, by_category, category_table, plot_categories
from dflash_train.sweep.recipe import RunOutcome, summarize, summary_csv, summary_markdown


def _prompt(category: str, accepted: float, seconds: float = 1.0, matched: bool = True) -> dict:
    """A prompt's row with two draft steps that give it the accepted length ``accepted``."""
    return {"category": category, "accepted_length": accepted, "verify_forwards": 2, "accepted_drafts": round(2 * (accepted - 1)),
            "new_tokens": 10, "seconds": seconds, "teacher_new_tokens": 10, "teacher_seconds": 2.0, "matched_teacher": matched}


def test_per_category_intervals_speedup_and_output_equality():
    greedy = {"temperature": 0.0, "num_speculative_tokens": 3,
              "per_prompt": [_prompt("math", 2.0), _prompt("code", 3.0, 2.0), _prompt("math", 4.0),
                             _prompt("code", 3.0, 2.0, matched=False)]}
    sampled = {"temperature": 1.0, "num_speculative_tokens": 3,
               "per_prompt": [_prompt("math", 1.5), _prompt("code", 2.0), _prompt("math", 2.5), _prompt("code", 2.0)]}
    rows = {r["category"]: r for r in by_category([greedy, sampled])}
    assert list(rows) == ["math", "code", OVERALL]
    math_greedy = rows["math"]["decodings"][0]
    # mean 3, s = sqrt(2), t_{0.975,1} = 12.7062: half-width 12.7062 * sqrt(2) / sqrt(2)
    assert math_greedy["accepted_length"]["mean"] == pytest.approx(3.0)
    assert math_greedy["accepted_length"]["high"] - 3.0 == pytest.approx(12.7062)
    assert math_greedy["speedup"] == pytest.approx(2.0) and rows["code"]["decodings"][0]["speedup"] == pytest.approx(1.0)
    assert math_greedy["matched_teacher"] is True and rows["code"]["decodings"][0]["matched_teacher"] is False
    assert rows["code"]["decodings"][0]["accepted_length"]["high"] == pytest.approx(3.0)  # no spread: no width
    assert rows[OVERALL]["prompts"] == 4 and rows[OVERALL]["decodings"][1]["matched_teacher"] is None
    assert rows[OVERALL]["decodings"][1]["accepted_length"]["mean"] == pytest.approx(2.0)
    table = category_table(list(rows.values())).splitlines()
    assert table[0].split() == ["category", "prompts", "T=0", "accepted", "T=0", "speedup", "T=1", "accepted", "T=1",
                                "speedup", "output", "=", "teacher"]
    assert table[1].split()[:5] == ["math", "2", "3.00", "±", "12.71"] and table[2].split()[-1] == "NO"
    assert table[3].split()[0] == OVERALL


def test_vllm_columns_and_plot(tmp_path):
    from dflash_train.measuring.acceptance import RequestCounts, acceptance_summary

    greedy = {"temperature": 0.0, "num_speculative_tokens": 3, "per_prompt": [_prompt("a", 2.0), _prompt("b", 3.0)]}
    vllm = {"a": {"prompts": 1, "accepted_length": 2.5, "speedup": 1.5, "matched_teacher": True,
                  "acceptance": acceptance_summary([RequestCounts(2, 3)], 4)},
            "b": {"prompts": 1, "accepted_length": None, "speedup": None, "matched_teacher": True, "acceptance": None},
            OVERALL: {"prompts": 2, "accepted_length": 2.5, "speedup": 1.2, "matched_teacher": True,
                      "acceptance": acceptance_summary([RequestCounts(2, 3), RequestCounts(0, 0)], 4)}}
    rows = by_category([greedy], vllm)
    table = category_table(rows).splitlines()
    assert "vLLM T=0 accepted" in table[0] and table[1].split()[-3:] == ["2.50", "1.50x", "yes"]
    assert table[2].split()[-3:] == ["-", "-", "yes"]  # no draft step in b: no number, not a zero
    only_vllm = by_category([], vllm)  # --engine vllm: no built-in decodings
    assert [r["category"] for r in only_vllm] == ["a", "b", OVERALL] and only_vllm[0]["prompts"] == 1
    plot_categories(rows, tmp_path / "c.png", "title")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_summary_has_a_column_per_category():
    def outcome(config, seed, math_length, code_length):
        return RunOutcome(config, seed, {"tau": 2.0, "tau_greedy": 1.5, "loss": 1.0},
                          {"curve": [], "decoding": {"accepted_length": 2.0, "matched_teacher": True,
                                                     "categories": {"math": math_length, "code": code_length}}})

    summary = summarize([outcome("loss=kl", 0, 2.0, 3.0), outcome("loss=kl", 1, 2.4, 3.0)], "loss=kl")
    row = summary.rows[0]
    assert summary.categories == ("math", "code")
    assert row["accepted_length[math]"].mean == pytest.approx(2.2)
    assert row["accepted_length[math]"].half_width == pytest.approx(12.7062 * math.sqrt(0.08) / math.sqrt(2))
    text = summary_markdown(summary)
    assert "| configuration | math, T=0 | code, T=0 |" in text and "| loss=kl | 2.200 ± 2.541 | 3.000 ± 0.000 |" in text
    header = summary_csv(summary).splitlines()[0].split(",")
    assert "accepted_length[math]_mean" in header and "accepted_length_sampled[code]_high" in header
    one_file = summarize([RunOutcome("loss=kl", 0, {"tau": 2.0}, {"decoding": {"accepted_length": 2.0, "matched_teacher": True,
                                                                               "categories": {"p": 2.0}}})], "loss=kl")
    assert one_file.categories == () and "per prompt category" not in summary_markdown(one_file)


# ----------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_url):
    run = tmp_path_factory.mktemp("categories") / "run"
    result = CliRunner().invoke(app, ["run", "--cache", cache_url, "--out", str(run), "--steps", "4", "--num-layers", "1",
                                      "--block-size", "4", "--eval-sequences", "0", "--heldout-fraction", "0.2", "--quiet"])
    assert result.exit_code == 0, result.output
    return run / "drafter"


def _prompt_files(folder: Path) -> list[str]:
    mt = write_jsonl(folder / "question.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["the river runs past the stone", "and then?"]},
        {"question_id": 2, "category": "writing", "turns": ["a garden by the window"]},
        {"question_id": 3, "category": "facts", "turns": ["what is the candle"]}])
    gsm = write_jsonl(folder / "gsm8k.jsonl", [{"question": "what is the apple", "answer": "#### 1"},
                                              {"question": "the forest and the mirror", "answer": "#### 2"}])
    return [mt, gsm]


def _by_hand(rows: list[dict]) -> dict:
    """The three accepted lengths of per-prompt rows, written out: per-request mean, pooled,
    token-weighted (tokens of a request: its steps plus its accepted drafts)."""
    drafted = [(r["verify_forwards"], r["accepted_drafts"]) for r in rows if r["verify_forwards"]]
    means = [1 + s / n for n, s in drafted]
    return {"per_request_mean": sum(means) / len(means),
            "pooled": 1 + sum(s for _, s in drafted) / sum(n for n, _ in drafted),
            "token_weighted": sum((n + s) * m for (n, s), m in zip(drafted, means)) / sum(n + s for n, s in drafted)}


def test_eval_reports_per_category_at_both_temperatures(tmp_path, trained, teacher_dir, cache_url):
    import xxhash

    from dflash_cache import open_cache

    files = _prompt_files(tmp_path)
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(trained), "--teacher", teacher_dir("qwen3"),
                                      "--prompts", files[0], "--prompts", files[1], "--max-new-tokens", "6",
                                      "--temperature", "0", "--temperature", "1", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {r["category"]: r for r in report["categories"]}
    assert list(rows) == ["writing", "facts", "gsm8k", OVERALL]
    assert [rows[c]["prompts"] for c in rows] == [2, 1, 2, 5]
    assert [d["temperature"] for d in rows[OVERALL]["decodings"]] == [0.0, 1.0]
    assert rows[OVERALL]["decodings"][0]["matched_teacher"] is True
    assert report["chat_template_hash"] and report["warnings"] == []
    lines = result.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("category"))
    assert "T=0 accepted" in lines[header] and "T=1 accepted" in lines[header] and "output = teacher" in lines[header]
    assert [line.split()[0] for line in lines[header + 1:header + 5]] == ["writing", "facts", "gsm8k", OVERALL]
    assert out.with_suffix(".categories.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the three definitions per category at both temperatures, each as computed by hand from the prompts' rows
    for i, decoding in enumerate(report["decodings"]):
        for name, row in rows.items():
            mine = [p for p in decoding["per_prompt"] if name == OVERALL or p["category"] == name]
            acceptance = row["decodings"][i]["acceptance"]
            for definition, value in _by_hand(mine).items():
                assert acceptance[definition] == pytest.approx(value), (name, i, definition)
            # the per-request histogram holds every prompt that drafted, in bins of 0.5 from 1 to P + 1 = 4
            assert acceptance["histogram"]["edges"] == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
            assert sum(acceptance["histogram"]["counts"]) == sum(p["verify_forwards"] > 0 for p in mine)
            below = sum(p["verify_forwards"] > 0 and p["accepted_length"] < 2.0 for p in mine)
            assert acceptance["below_floor"]["requests"] == below and acceptance["below_floor"]["floor"] == 2.0
        # the decoding's own summary is its overall row's
        assert decoding["acceptance"]["pooled"] == pytest.approx(_by_hand(decoding["per_prompt"])["pooled"])
    definitions = next(i for i, line in enumerate(lines) if line.startswith("category") and "pooled" in line)
    assert all(f"T={t} {d}" in lines[definitions] for t in (0, 1) for d in ("per-request", "pooled", "token-wtd", "< 2"))
    assert any(line.startswith("per-request accepted length: requests per bin of 0.5") for line in lines)
    assert any(line.startswith("writing T=1 ") for line in lines)

    settings = report["settings"]
    assert settings["engines"][0]["engine"] == "dflash" and settings["engines"][0]["torch"]
    assert (settings["dtype"], settings["temperatures"], settings["top_p"], settings["top_k"]) == ("float32", [0.0, 1.0], 1.0, None)
    assert (settings["block_size"], settings["num_speculative_tokens"], settings["max_new_tokens"]) == (4, 3, 6)
    assert [f["xxh64"] for f in settings["prompt_files"]] == [xxhash.xxh64(Path(f).read_bytes()).hexdigest() for f in files]
    assert settings["teacher"]["weights_hash"] == open_cache(cache_url).manifest["teacher"]["weights_hash"]
    assert settings["drafter"]["checkpoint"] == str(trained) and len(settings["drafter"]["weights_hash"]) == 16
    assert settings["chat_template_kwargs"] is None and settings["chat_template_hash"] == report["chat_template_hash"]
    assert "settings" in lines and any(line.strip().startswith("temperature, top-p, top-k") for line in lines)


def test_eval_warns_in_one_line_when_the_template_is_not_the_caches(tmp_path, trained, teacher_dir):
    teacher = tmp_path / "teacher"
    shutil.copytree(teacher_dir("qwen3"), teacher)
    template = teacher / "chat_template.jinja"
    if template.exists():
        template.write_text("{#- another template -#}" + template.read_text())
    else:
        config = json.loads((teacher / "tokenizer_config.json").read_text())
        config["chat_template"] = "{#- another template -#}" + config["chat_template"]
        (teacher / "tokenizer_config.json").write_text(json.dumps(config))
    files = _prompt_files(tmp_path)
    args = ["eval", "--checkpoint", str(trained), "--teacher", str(teacher), "--prompts", files[1],
            "--max-new-tokens", "4", "--out", str(tmp_path / "eval.json"), "--quiet"]
    result = CliRunner().invoke(app, args + ["--chat-template-kwargs", '{"style": 1}', "--allow-template-mismatch"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, result.output
    assert "chat-template kwargs {\"style\": 1}" in warnings[0] and "with null" in warnings[0]
    assert "the teacher's chat template (hash" in warnings[1] and "pass the teacher the cache was built from" in warnings[1]
    assert json.loads((tmp_path / "eval.json").read_text())["warnings"] == warnings


def test_vllm_group_summaries_from_the_workers_per_group_counters():
    from dflash_train.measuring.serving import group_summaries

    alone = {"outputs": [[1, 2], [3, 4, 5], [6]], "groups": [{"seconds": 2.0, "spec_decode": {}},
                                                             {"seconds": 1.0, "spec_decode": {}}]}
    spec = {"outputs": [[1, 2], [3, 4, 9], [6]],
            "groups": [{"seconds": 1.0, "spec_decode": {"spec_decode_num_drafts": 4, "spec_decode_num_accepted_tokens": 6}},
                       {"seconds": 1.0, "spec_decode": {"spec_decode_num_drafts": 0}}]}
    out = group_summaries(alone, spec, {"math": [0, 1], "code": [2]}, block_size=4)
    # no per-request metrics from this worker: the pooled counters only, no definitions
    assert out["math"] == {"prompts": 2, "accepted_length": 2.5, "speedup": 2.0, "matched_teacher": False, "acceptance": None}
    assert out["code"] == {"prompts": 1, "accepted_length": None, "speedup": 1.0, "matched_teacher": True, "acceptance": None}


def test_sweep_decodings_pool_each_categorys_rounds():
    from dflash_train.measuring.speculative import SpecResult
    from dflash_train.sweep.measure import category_lengths

    results = [SpecResult([0], [3, 1]), SpecResult([0], [4]), SpecResult([0], [2, 2, 2])]
    lengths = category_lengths([{"category": "a"}, {"category": "b"}, {"category": "a"}], results)
    assert lengths == {"a": pytest.approx(10 / 5), "b": 4.0}  # pooled over rounds, not a mean of prompt means
    assert category_lengths([{}], results[:1]) == {"prompts": 2.0}  # a reference from before categories


def test_vllm_per_request_metrics_give_the_three_definitions():
    """With vLLM's per-request spec-decode metrics (the worker's `per_request`), each category
    gets the same three definitions as the built-in decoder, computed by hand here."""
    from dflash_train.measuring.serving import group_summaries
    from dflash_train.measuring.vllm_worker import _request_metrics

    class Metrics:  # what vLLM 0.32 hands the worker: a histogram of steps by accepted drafts
        histogram = [1, 0, 1, 0]  # one step accepting nothing, one accepting 2: 2 steps, 2 drafts

    assert _request_metrics(type("Completion", (), {"spec_decode_metrics": Metrics()})()) == {
        "steps": 2, "accepted": 2, "histogram": [1, 0, 1, 0]}
    assert _request_metrics(type("Completion", (), {"spec_decode_metrics": None})()) is None
    alone = {"outputs": [[1], [2], [3]], "groups": [{"seconds": 1.0, "spec_decode": {}}, {"seconds": 1.0, "spec_decode": {}}]}
    spec = {"outputs": [[1], [2], [3]], "per_request": [{"steps": 2, "accepted": 2}, {"steps": 4, "accepted": 12},
                                                        {"steps": 0, "accepted": 0}],
            "groups": [{"seconds": 1.0, "spec_decode": {"spec_decode_num_drafts": 6, "spec_decode_num_accepted_tokens": 14}},
                       {"seconds": 1.0, "spec_decode": {"spec_decode_num_drafts": 0}}]}
    out = group_summaries(alone, spec, {"math": [0, 1], "code": [2]}, block_size=4, max_length=5)
    math_part = out["math"]["acceptance"]
    assert math_part["per_request_mean"] == pytest.approx((2 + 4) / 2)
    assert math_part["pooled"] == pytest.approx(1 + 14 / 6) == out["math"]["accepted_length"]  # the counters' number
    assert math_part["token_weighted"] == pytest.approx((4 * 2 + 16 * 4) / 20)
    assert math_part["histogram"]["counts"] == [0, 0, 1, 0, 0, 0, 1, 0]  # 2 in [2, 2.5), 4 in [4, 4.5)
    assert out["code"]["acceptance"]["per_request_mean"] is None and out["code"]["acceptance"]["without_steps"] == 1
