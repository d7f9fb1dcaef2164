"""How a chat is rendered, where its answer ends, and the nucleus filter: one definition for
stage 0's regeneration, the build's assistant spans and stage 2's decoding, which must agree on
them."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from dflash_common.errors import ConfigError, TeacherError

if TYPE_CHECKING:  # torch loads where sampling runs, not with the corpus settings
    import torch

Render = Callable[[list[dict], bool], str]
"""A chat template as a function: (messages, add_generation_prompt) -> text."""

_PROBE = "dflash end-of-turn probe 7c1e"


def end_of_turn_text(render: Render) -> str:
    """The text a template writes right after an assistant message (e.g. "<|im_end|>\\n"), or ""
    for a template without a visible marker."""
    try:
        rendered = render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}], False)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe just has no marker
        return ""
    return rendered[rendered.rindex(_PROBE) + len(_PROBE):] if _PROBE in rendered else ""


def check_template_kwargs(kwargs) -> None:
    """Refuse chat-template variables that are not a JSON object of plain values."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError(f"chat template kwargs {kwargs!r} must be a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    try:
        # allow_nan=False: NaN and Infinity are not JSON, and they are written into manifests and settings
        json.dumps(kwargs, allow_nan=False)
    except ValueError:
        raise ConfigError(f"chat template kwargs {kwargs!r} hold a number that is not finite (NaN or Infinity), "
                          "which JSON cannot hold; pass finite numbers") from None
    except TypeError:
        raise ConfigError(f"chat template kwargs {kwargs!r} must hold plain JSON values") from None


# Jinja's sandbox caps one range() at 100,000 items, but not how many a template makes: two
# nested loops are 10^10 steps, hours for one row. While render_chat renders, every range()
# item a template iterates counts against one budget per render, far above what a real template
# needs (it loops over the messages); past it the render fails, and the row with it.
TEMPLATE_RANGE_STEPS = 1_000_000
_budget = threading.local()


class TemplateTooCostly(RuntimeError):
    """A chat template iterated more range() items than TEMPLATE_RANGE_STEPS for one chat."""


class _BudgetedRange:
    """A sandbox range whose iteration spends the current render's budget."""

    def __init__(self, rng: range):
        self.rng = rng

    def __len__(self) -> int:
        return len(self.rng)

    def __getitem__(self, index):
        return self.rng[index]

    def __contains__(self, value) -> bool:
        return value in self.rng

    def __iter__(self):
        for value in self.rng:
            _budget.left -= 1
            if _budget.left < 0:
                raise TemplateTooCostly(f"the chat template iterated range() more than {TEMPLATE_RANGE_STEPS:,} "
                                        "times for one chat (nested loops?), so rendering was stopped; fix the template")
            yield value

    def __reversed__(self):
        return iter(_BudgetedRange(self.rng[::-1]))


def _install_range_budget() -> None:
    """Make the sandbox's range() budgeted. Installed at import, before transformers compiles a
    template (it does so lazily, and its sandbox takes `range` from jinja2.sandbox.safe_range);
    outside render_chat the range is the sandbox's own."""
    import jinja2.sandbox as sandbox

    if getattr(sandbox.safe_range, "dflash_budgeted", False):
        return
    original = sandbox.safe_range

    def budgeted_range(*args):
        rng = original(*args)
        return _BudgetedRange(rng) if getattr(_budget, "left", None) is not None else rng

    budgeted_range.dflash_budgeted = True
    sandbox.safe_range = budgeted_range


_install_range_budget()


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool,
                chat_template_kwargs: dict | None = None) -> str:
    """The chat as text through the tokenizer's template: the one rendering build, regenerate,
    eval and generate share, so the drafter is trained and measured on the prompts it is served.
    A template that loops too long raises TemplateTooCostly (see TEMPLATE_RANGE_STEPS)."""
    previous = getattr(_budget, "left", None)
    _budget.left = TEMPLATE_RANGE_STEPS
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(chat_template_kwargs or {}))
    finally:
        _budget.left = previous


def tokenizer_render(tokenizer, chat_template_kwargs: dict | None = None) -> Render:
    """The tokenizer's own chat template (with these variables) as a Render."""
    return lambda messages, add_generation_prompt: render_chat(tokenizer, messages, add_generation_prompt,
                                                               chat_template_kwargs)


def stop_token_ids(tokenizer, model_eos=None, end_of_turn: str | None = None) -> list[int]:
    """Tokens that end an answer: the tokenizer's eos, the model's configured eos ids, and the
    template's end-of-turn token when it is a single token (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>). `end_of_turn` defaults to the tokenizer's template's."""
    if end_of_turn is None:
        end_of_turn = end_of_turn_text(tokenizer_render(tokenizer)) if tokenizer.chat_template else ""
    candidates = [tokenizer.eos_token_id] + (list(model_eos) if isinstance(model_eos, (list, tuple)) else [model_eos])
    marker = end_of_turn.strip()
    if marker:
        encoded = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(encoded) == 1:
            candidates.append(encoded[0])
    ids: list[int] = []
    for token in candidates:
        if token is not None and int(token) not in ids:
            ids.append(int(token))
    if not ids:
        raise TeacherError("the teacher's tokenizer has no eos token and its chat template no end-of-turn token; "
                           "answers could not stop before --max-new-tokens")
    return ids


def cut_at_stop(ids: list[int], stop_ids: Iterable[int]) -> tuple[list[int], bool]:
    """(answer ids before the first stop token, whether a stop token ended it)."""
    stops = set(stop_ids)
    for position, token in enumerate(ids):
        if token in stops:
            return ids[:position], True
    return ids, False


def strip_end_of_turn(text: str, end_of_turn: str) -> str:
    """Drop a trailing end-of-turn marker that decoding kept (one that is not a special token)."""
    marker = end_of_turn.strip()
    if marker and text.endswith(marker):
        return text[: -len(marker)]
    return text


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set (most likely first) holding `top_p` of the
    probability: a token stays when the mass strictly before it is below top_p, so the most
    likely token always stays. probs [..., V], rows summing to 1; not renormalised."""
    import torch

    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
