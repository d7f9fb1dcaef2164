"""How a chat is rendered and where its answer ends: one definition for stage 0's regeneration, the
build's assistant spans and stage 2's decoding, which must agree on them. The template's cost
sandbox is dflash_teacher.chat_sandbox (its budget dflash_teacher.render_budget), nucleus
filtering dflash_teacher.sampling."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dflash_common.errors import TeacherError
from dflash_common.template_kwargs import check_template_kwargs
from dflash_teacher.chat_sandbox import render_guarded
from dflash_teacher.render_budget import Budget, template_text_budget

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


def template_variables(tokenizer, messages: list[dict], add_generation_prompt: bool,
                       chat_template_kwargs: dict | None) -> dict:
    """What transformers' apply_chat_template hands the template for this chat (tokenize=False, no
    tools or documents): the special tokens, the kwargs, the messages with None-valued keys dropped
    and reasoning aliased, each rebuilt as plain data. The guarded render gets exactly these, so it
    renders what the real render will (kwargs transformers would take as its own parameters are
    refused before, see dflash_common.template_kwargs)."""
    from transformers.utils import chat_template_utils as utils

    plain = getattr(utils, "_plain_template_data", lambda value: value)
    alias = getattr(utils, "_alias_reasoning_fields", lambda chat: chat)
    normalize = getattr(utils, "_normalize_chat_messages",
                        lambda chat: [{k: v for k, v in m.items() if v is not None} for m in chat])
    chat = alias(plain(normalize(messages)))
    return {**plain({**tokenizer.special_tokens_map, **(chat_template_kwargs or {})}), "messages": chat,
            "tools": None, "documents": None, "add_generation_prompt": add_generation_prompt}


def guarded_render(tokenizer, messages: list[dict], add_generation_prompt: bool,
                   chat_template_kwargs: dict | None) -> str:
    """The chat rendered through the guarded template (dflash_teacher.chat_sandbox) with what the
    tokenizer's own render passes it; raises TemplateTooCostly naming the template."""
    name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    budget = Budget(template_text_budget(messages, chat_template_kwargs), name)
    variables = template_variables(tokenizer, messages, add_generation_prompt, chat_template_kwargs)
    return render_guarded(tokenizer.get_chat_template(), variables, budget)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool,
                chat_template_kwargs: dict | None = None) -> str:
    """The chat as text through the tokenizer's template: the one rendering build, regenerate,
    eval and generate share, so the drafter is trained and measured on the prompts it is served.
    A template that works too long or builds too much text raises TemplateTooCostly (see
    dflash_teacher.chat_sandbox), before the tokenizer renders it; kwargs that are not template
    variables (`chat_template`, `continue_final_message`, ...) raise ConfigError unrendered."""
    check_template_kwargs(chat_template_kwargs, "chat template kwargs")
    guarded_render(tokenizer, messages, add_generation_prompt, chat_template_kwargs)
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


