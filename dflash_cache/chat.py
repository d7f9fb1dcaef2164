"""How a chat is rendered, where its answer ends, and the nucleus filter: one definition for
stage 0's regeneration, the build's assistant spans and stage 2's decoding, which must agree on
them."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from functools import lru_cache
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


# A chat every template renders: one user turn and one answer.
_PLAIN_CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def error_text(err: BaseException) -> str:
    """An exception's first line, or its type when it has no text (jinja's TemplateError(), a
    MemoryError): never an empty reason."""
    text = str(err).strip()
    return text.splitlines()[0] if text else f"{type(err).__name__} without a message"


def described(err: BaseException) -> str:
    """An exception's type and first line, for a message ("TemplateError: ...")."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else f"{type(err).__name__} without a message"


def template_fault(render: Render, err: BaseException, template: str) -> str | None:
    """When rendering a row's chat raised ``err``: if the template named ``template`` fails on a
    plain user/assistant chat too, it fails on every row and is at fault, and this is the message
    saying so (with the error's type); None when the plain chat renders, so the row is at fault."""
    try:
        render(_PLAIN_CHAT, False)
    except Exception as plain:  # noqa: BLE001 - any failure of the template on a plain chat blames it
        return (f"the chat template of {template} fails on every chat, a plain user/assistant one too "
                f"({described(plain)}), so the template, not the rows, is at fault: fix or "
                "replace the template (or pass the --chat-template-kwargs it needs)")
    return None


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


# Jinja's sandbox caps one range() at 100,000 items, but not how many a template makes (two
# nested loops are 10^10 steps, hours for one row), nor how long a string it builds ('x' * 10**9,
# or a loop doubling one, is gigabytes for one row). So before the tokenizer renders a chat, the
# same template renders it once more in a guarded copy of its environment, which counts range()
# items against TEMPLATE_RANGE_STEPS and refuses any product, power or concatenation, and any
# output, longer than the chat's text budget (template_text_budget). Past either budget the
# render fails, and the row with it. Both budgets are far above what a real template needs (it
# loops over the messages and writes each once, plus a few markers).
TEMPLATE_RANGE_STEPS = 1_000_000
TEMPLATE_TEXT_BASE = 1 << 20
"""Characters a rendered chat may hold beyond TEMPLATE_TEXT_PER_INPUT per character of its input."""
TEMPLATE_TEXT_PER_INPUT = 4
"""Characters a rendered chat may hold per character of its messages and template variables."""
_guard = threading.local()  # the budget of the guarded render running on this thread


class TemplateTooCostly(RuntimeError):
    """A chat template needed more range() steps or wrote more text than one chat may cost."""


def template_text_budget(messages: list[dict], chat_template_kwargs: dict | None) -> int:
    """The most characters rendering this chat may produce, or build in one expression."""
    size = len(json.dumps(messages, ensure_ascii=False, default=str))
    size += len(json.dumps(chat_template_kwargs or {}, ensure_ascii=False, default=str))
    return TEMPLATE_TEXT_BASE + TEMPLATE_TEXT_PER_INPUT * size


class _Budget:
    def __init__(self, steps: int, chars: int):
        self.steps, self.chars = steps, chars

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise TemplateTooCostly(f"the chat template iterated range() more than {TEMPLATE_RANGE_STEPS:,} "
                                    "times for one chat (nested loops?), so rendering was stopped; fix the template")

    def text(self, length: int, what: str) -> None:
        if length > self.chars:
            raise TemplateTooCostly(f"the chat template {what} of {length:,} characters for one chat (at most "
                                    f"{self.chars:,} here), so rendering was stopped; fix the template")


class _BudgetedRange:
    """A sandbox range whose iteration spends the guarded render's budget."""

    def __init__(self, rng: range, budget: _Budget):
        self.rng, self.budget = rng, budget

    def __len__(self) -> int:
        return len(self.rng)

    def __getitem__(self, index):
        return self.rng[index]

    def __contains__(self, value) -> bool:
        return value in self.rng

    def __iter__(self):
        for value in self.rng:
            self.budget.step()
            yield value

    def __reversed__(self):
        return iter(_BudgetedRange(self.rng[::-1], self.budget))


def _result_length(operator: str, left, right) -> int:
    """How long the sequence (or, for numbers, the digit string) a binary operation would make,
    found without making it."""
    sized = (str, list, tuple)
    if operator == "*" and isinstance(left, int) and isinstance(right, sized):
        left, right = right, left
    if operator == "*" and isinstance(left, sized) and isinstance(right, int):
        return len(left) * max(right, 0)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        return int(right * abs(left).bit_length() * 0.302) + 1  # decimal digits of the power
    if operator == "*" and isinstance(left, int) and isinstance(right, int):
        return (abs(left).bit_length() + abs(right).bit_length()) * 302 // 1000 + 1
    return 0


def _guarded_binop(context, operator: str, left, right):
    budget = getattr(_guard, "budget", None)
    if budget is not None:
        budget.text(_result_length(operator, left, right), f"asked for a {operator!r} result")
    return _BINOPS[operator](left, right)


_BINOPS = {"*": lambda a, b: a * b, "**": lambda a, b: a ** b, "+": lambda a, b: a + b}


def _folded(node) -> object:
    """The value Jinja's compiler would fold a constant expression of *, ** and + into, made only
    while each result stays under TEMPLATE_TEXT_BASE (else TemplateTooCostly); None for anything
    else. Folding happens when a template is compiled, before any budget of a render applies."""
    from jinja2 import nodes

    if isinstance(node, nodes.Const):
        return node.value
    if isinstance(node, nodes.BinExpr) and node.operator in _BINOPS:
        left, right = _folded(node.left), _folded(node.right)
        if left is None or right is None:
            return None
        length = _result_length(node.operator, left, right)
        if length > TEMPLATE_TEXT_BASE:
            raise TemplateTooCostly(f"the chat template holds a constant {node.operator!r} expression of {length:,} "
                                    f"characters (at most {TEMPLATE_TEXT_BASE:,}), which compiling it would build; fix "
                                    "the template")
        return _BINOPS[node.operator](left, right)
    return None


@lru_cache(maxsize=16)
def _guarded_template(source: str):
    """The chat template compiled in a copy of the environment transformers renders it in (same
    filters, globals and extensions: taken from its compile of an empty template), with *, ** and
    + routed through the budget. Jinja decides at compile time which operators it intercepts, hence
    a compile of our own; transformers' compiled template and jinja itself are left as they are.
    Constant expressions are checked first: transformers' own compile would fold them."""
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template("").environment.overlay()
    env.intercepted_binops = frozenset(_BINOPS)
    env.call_binop = _guarded_binop
    tree = env.parse(source)
    for node in tree.find_all(nodes.BinExpr):
        _folded(node)
    return env.from_string(tree)


def _check_cost(tokenizer, messages: list[dict], add_generation_prompt: bool, chat_template_kwargs: dict | None) -> None:
    """Render the chat through the guarded template, with what the tokenizer's own render passes
    it, counting range() steps and text (see TEMPLATE_RANGE_STEPS); raises TemplateTooCostly."""
    from transformers.utils import chat_template_utils

    budget = _Budget(TEMPLATE_RANGE_STEPS, template_text_budget(messages, chat_template_kwargs))
    alias = getattr(chat_template_utils, "_alias_reasoning_fields", lambda chat: chat)
    variables = {**tokenizer.special_tokens_map, **(chat_template_kwargs or {}), "messages": alias(messages),
                 "tools": None, "documents": None, "add_generation_prompt": add_generation_prompt}
    import jinja2.sandbox

    # a template variable shadows the environment's global range(): this render's alone is budgeted
    variables["range"] = lambda *args: _BudgetedRange(jinja2.sandbox.safe_range(*args), budget)
    previous, _guard.budget = getattr(_guard, "budget", None), budget
    try:
        written = 0
        for chunk in _guarded_template(tokenizer.get_chat_template()).generate(**variables):
            written += len(chunk)
            budget.text(written, "wrote a chat")
    finally:
        _guard.budget = previous


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool,
                chat_template_kwargs: dict | None = None) -> str:
    """The chat as text through the tokenizer's template: the one rendering build, regenerate,
    eval and generate share, so the drafter is trained and measured on the prompts it is served.
    A template that loops too long or writes too much raises TemplateTooCostly (see
    TEMPLATE_RANGE_STEPS), before the tokenizer renders it."""
    _check_cost(tokenizer, messages, add_generation_prompt, chat_template_kwargs)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(chat_template_kwargs or {}))


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
