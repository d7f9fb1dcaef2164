"""eval's exactness (issue 57): where a greedy output first leaves the teacher's, and whether that
is a flip at a near tie (the teacher's own margin within rounding) or a real mismatch.

A bf16 verify forward and a one-token decode round differently, which no CPU test can make
happen on purpose; what stands in for it here is a real tiny teacher whose LM head is changed at
one step only (along that step's hidden state, orthogonal to every earlier one, so the earlier
tokens stay the teacher's): a change below the tie threshold where the teacher's top two are
within a few fp32 steps is what rounding does; one far above it where the teacher was clear is
what a decoding error does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_speculative import copy_drafter, one_thread, run_teacher  # noqa: F401 (the fixture: one thread)

from dflash_train.measuring.commands import EvalResult
from dflash_train.measuring.exactness import (
    NEAR_TIE_ULPS,
    exactness_summary,
    exactness_text,
    first_divergence,
    resolution,
)
from dflash_train.measuring.speculative import TeacherChoice, speculative_generate, teacher_generate
from dflash_train.settings.spec_config import SpecConfig

PROMPT, MAX_NEW, STEP = [3, 7, 3, 9, 12], 16, 6
FP32 = torch.float32


def test_resolution_is_the_dtypes_step_at_that_magnitude():
    assert resolution(20.0, torch.bfloat16) == 0.125 and resolution(-17.5, torch.bfloat16) == 0.125
    assert resolution(1.0, torch.bfloat16) == 2.0 ** -7
    assert resolution(3.0, FP32) == 2.0 ** -22
    assert 0 < resolution(0.0, FP32) < 1e-30  # an all-zero row still has a finite step


def test_first_divergence_names_the_position_the_margin_and_the_verdict():
    choices = [TeacherChoice(20.0, 3.0, 9), TeacherChoice(20.0, 0.25, 5), TeacherChoice(20.0, 0.0, 6)]
    assert first_divergence([1, 2, 3], [1, 2, 3], choices, torch.bfloat16) is None
    flip = first_divergence([1, 5, 8], [1, 2, 3], choices, torch.bfloat16)
    assert flip == {"position": 1, "token": 5, "teacher_token": 2, "teacher_runner_up": 5, "teacher_margin": 0.25,
                    "margin_ulps": 2.0, "near_tie": True}
    # the same margin in fp32 is millions of steps: a real mismatch there
    assert not first_divergence([1, 5, 8], [1, 2, 3], choices, FP32)["near_tie"]
    # a near margin, but not the runner-up: no rounding explains a third token
    assert not first_divergence([1, 4, 8], [1, 2, 3], choices, torch.bfloat16)["near_tie"]
    # a clear choice left (3.0 = 24 steps of 0.125 > NEAR_TIE_ULPS)
    assert not first_divergence([9, 2, 3], [1, 2, 3], choices, torch.bfloat16)["near_tie"]
    # the output runs past the teacher's end: no margin to judge by, a mismatch
    past = first_divergence([1, 2, 3, 4], [1, 2, 3], choices, torch.bfloat16)
    assert past["position"] == 3 and past["teacher_token"] is None and past["teacher_margin"] is None
    assert not past["near_tie"]


def _final_states(teacher, ids: list[int]) -> torch.Tensor:
    """The teacher's final-normed states [T, H] of ids: what its LM head reads."""
    with torch.no_grad():
        return teacher.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def raised_at(teacher, tokens: list[int], step: int, token: int, amount: float):
    """A copy of the teacher whose logit of `token` is `amount` higher where it chooses new token
    `step` after PROMPT + tokens and unchanged (to rounding) at every earlier step: the head row
    moves along the part of that step's state orthogonal to all earlier steps' states."""
    states = _final_states(teacher, PROMPT + tokens[:step]).double()
    first = len(PROMPT) - 1  # the state that chose new token 0
    earlier, here = states[first:first + step], states[first + step]
    basis = torch.linalg.qr(earlier.T)[0]  # [H, step]: earlier states' span
    direction = here - basis @ (basis.T @ here)
    changed = copy.deepcopy(teacher)
    with torch.no_grad():
        row = changed.get_output_embeddings().weight[token]
        row += (amount * direction / direction.dot(here)).float()
    return changed


def _reference(teacher):
    base = teacher_generate(teacher, PROMPT, SpecConfig(max_new_tokens=MAX_NEW))
    return base, base.teacher_choices[STEP]


def led_by(teacher, tokens: list[int], top: int, other: int, lead: float):
    """A copy of the teacher whose own generation after PROMPT + tokens[:STEP] scores `top` at
    `lead` above `other` at STEP (`lead` < 0: below), as its one-token decode rounds: one raise of
    `other` lands within ~10 fp32 steps (the moved head row rounds), so it is corrected until the
    decode's margin is within one step of `lead`."""
    changed = teacher
    for _ in range(6):
        base, choice = _reference(changed)
        assert base.tokens[:STEP] == tokens[:STEP] and {base.tokens[STEP], choice.runner_up} == {top, other}
        signed = choice.margin if base.tokens[STEP] == top else -choice.margin
        if abs(signed - lead) <= resolution(choice.top_logit, FP32):
            return changed
        changed = raised_at(changed, tokens, STEP, other, signed - lead)
    raise AssertionError(f"the margin at new token {STEP} stays {signed}, not {lead}")


def test_a_flip_at_a_near_tie_is_named_with_its_position_and_margin():
    teacher = run_teacher("qwen3", 0.14)
    base, choice = _reference(teacher)
    top, runner_up, ulp = base.tokens[STEP], choice.runner_up, resolution(choice.top_logit, FP32)
    # the teacher's top two brought within 3 fp32 steps at STEP ...
    tied = led_by(teacher, base.tokens, top, runner_up, 3 * ulp)
    reference, tie = _reference(tied)
    assert reference.tokens[:STEP + 1] == base.tokens[:STEP + 1] and tie.runner_up == runner_up
    assert 0 < tie.margin <= NEAR_TIE_ULPS * ulp, (tie.margin, ulp)
    # ... and a decoder whose teacher rounds the other way there: the runner-up wins. 64 steps, since
    # this decoder's block verify forward rounds on its own too (several fp32 steps here on the CPU)
    flipped = led_by(tied, base.tokens, top, runner_up, -64 * ulp)
    spec = speculative_generate(flipped, copy_drafter(flipped, 4), PROMPT, SpecConfig(max_new_tokens=MAX_NEW))
    assert spec.tokens[:STEP] == reference.tokens[:STEP] and spec.tokens[STEP] == runner_up

    found = first_divergence(spec.tokens, reference.tokens, reference.teacher_choices, FP32)
    assert found["position"] == STEP and found["near_tie"] and found["teacher_margin"] == tie.margin
    assert found["token"] == runner_up and found["teacher_token"] == top
    assert 0 < found["margin_ulps"] <= NEAR_TIE_ULPS
    rows = [{"id": "p0", "divergence": None}, {"id": "p1", "divergence": found}]
    text = exactness_text(rows)
    assert text.startswith("no, near-tie flips only: 1 of 2 prompts") and f"'p1' at new token {STEP}" in text
    assert f"teacher margin {tie.margin:.4g}" in text
    summary = exactness_summary([None, found], FP32)
    assert summary == {"mismatches": 0, "near_tie_flips": 1, "near_tie_ulps": NEAR_TIE_ULPS, "logits_dtype": "float32"}
    # not exact, so matched_teacher stays False; but eval does not fail on rounding
    report = {"decoding": {"matched_teacher": False, "exactness": summary}}
    assert EvalResult(report, [], None).lossless and not EvalResult(report, [], None).matched


def test_a_divergence_where_the_teacher_was_clear_is_a_real_mismatch():
    teacher = run_teacher("qwen3", 0.14)
    base, choice = _reference(teacher)
    assert choice.margin / resolution(choice.top_logit, FP32) > 1000 * NEAR_TIE_ULPS  # the teacher was clear
    wrong = raised_at(teacher, base.tokens, STEP, choice.runner_up, choice.margin + 0.5)
    spec = speculative_generate(wrong, copy_drafter(wrong, 4), PROMPT, SpecConfig(max_new_tokens=MAX_NEW))
    assert spec.tokens[:STEP] == base.tokens[:STEP] and spec.tokens[STEP] == choice.runner_up

    found = first_divergence(spec.tokens, base.tokens, base.teacher_choices, FP32)
    assert found["position"] == STEP and not found["near_tie"] and found["teacher_margin"] == choice.margin
    text = exactness_text([{"id": "p1", "divergence": found}])
    assert text.startswith("NO: 1 of 1 prompts") and f"'p1' at new token {STEP}" in text
    summary = exactness_summary([found], FP32)
    assert summary["mismatches"] == 1 and summary["near_tie_flips"] == 0
    assert not EvalResult({"decoding": {"matched_teacher": False, "exactness": summary}}, [], None).lossless


def test_the_teachers_choices_are_its_top_two_at_every_new_token():
    teacher = run_teacher("qwen3", 0.14)
    base, _ = _reference(teacher)
    assert len(base.teacher_choices) == len(base.tokens) == MAX_NEW
    states = _final_states(teacher, PROMPT + base.tokens[:-1])[len(PROMPT) - 1:]
    with torch.no_grad():
        top = teacher.lm_head(states).topk(2)
    for i, choice in enumerate(base.teacher_choices):
        assert int(top.indices[i, 0]) == base.tokens[i] and choice.runner_up == int(top.indices[i, 1])
        assert choice.margin == pytest.approx(float(top.values[i, 0] - top.values[i, 1]), abs=1e-5)
    # speculative decoding records none: its logits are the verify forward's, not the reference
    assert speculative_generate(teacher, copy_drafter(teacher, 4), PROMPT, SpecConfig(max_new_tokens=4)).teacher_choices == []


def test_the_report_puts_the_divergence_and_its_summary_beside_matched_teacher(teacher_dir):
    """decode_report on a real fp32 teacher: equal outputs, so no divergence, nothing counted."""
    from dflash_teacher.teacher import TeacherConfig, load_teacher
    from dflash_train.measuring.commands import decoding_lines
    from dflash_train.measuring.decode_report import Prompt, decode_report
    from dflash_train.settings.drafter_config import drafter_config_from_teacher
    from dflash_train.training.model import DFlashDrafter

    teacher = load_teacher(TeacherConfig(name_or_path=teacher_dir("qwen3"), dtype="float32", layers=(0, 2), top_k=1))
    model = teacher.model
    cfg = drafter_config_from_teacher(model.config.to_dict(), (0, 2), mask_token_id=model.config.vocab_size - 1,
                                      block_size=4, num_hidden_layers=1)
    torch.manual_seed(0)
    drafter = DFlashDrafter.build(cfg, model.get_input_embeddings().weight.detach(),
                                  model.get_output_embeddings().weight.detach(), "cpu").eval()
    spec = SpecConfig(max_new_tokens=8)
    report = decode_report(teacher, drafter, [Prompt("a", [5, 17, 33, 2]), Prompt("b", [11, 12, 13])], spec)
    assert report["matched_teacher"] is True and [r["divergence"] for r in report["per_prompt"]] == [None, None]
    assert report["exactness"] == {"mismatches": 0, "near_tie_flips": 0, "near_tie_ulps": NEAR_TIE_ULPS,
                                   "logits_dtype": "float32"}
    assert ("output equals teacher's greedy", "yes") in decoding_lines([spec], [report], cfg.num_draft_positions)
    sampled = decode_report(teacher, drafter, [Prompt("a", [5, 17, 33, 2])], SpecConfig(max_new_tokens=8, temperature=1.0))
    assert sampled["exactness"] is None and sampled["per_prompt"][0]["divergence"] is None
