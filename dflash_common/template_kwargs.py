"""Which chat-template kwargs dflash passes to a chat template: variables the template reads as data
(e.g. {"enable_thinking": false}), nothing else. Shared by the teacher's render, the corpus and every
stage's settings, so here at the bottom; torch-free, so the configs check them when built
and a cache's reader when it reads its manifest.

transformers' `apply_chat_template(messages, **kwargs)` takes some kwargs as its own parameters
instead of handing them to the template: `chat_template` replaces the teacher's template (so the
guarded render would check one template while another renders), `continue_final_message` and
`add_generation_prompt` move where a prompt ends, `tokenize` and its companions change what comes
back. A variable named like a function the template calls (`range`, `raise_exception`) would
shadow it. Each of those keys is refused, naming the key and why.
"""

from __future__ import annotations

import json

from dflash_common.errors import ConfigError, DFlashError, quoted, shown
from dflash_common.values import MAX_OPTION_DEPTH, nesting_depth

TEMPLATE_KWARGS_BYTES = 1 << 20
"""The most bytes of JSON the kwargs may take: they are a few flags, and they also raise the
guarded render's text budget (dflash_teacher.render_budget.template_text_budget)."""

_REPLACES_TEMPLATE = "transformers takes it as the template to render (it would replace the teacher's own)"
_ENDS_PROMPT = "transformers takes it as its own parameter, which moves where a prompt ends (dflash sets it itself)"
_REPLACES_CHAT = "transformers and the template take it as the chat itself, not a variable beside it"
_CHANGES_OUTPUT = "transformers takes it as its own parameter, which changes what the render returns"
_SHADOWS_FUNCTION = "it would shadow a function the template calls, so the guarded render and the real one would differ"

RESERVED_TEMPLATE_KWARGS: dict[str, str] = {
    # apply_chat_template's and render_jinja_template's own parameters (transformers 5)
    "chat_template": _REPLACES_TEMPLATE, "tools": _REPLACES_TEMPLATE + " (a tools list picks the tool_use template)",
    "continue_final_message": _ENDS_PROMPT, "add_generation_prompt": _ENDS_PROMPT,
    "conversation": _REPLACES_CHAT, "conversations": _REPLACES_CHAT, "messages": _REPLACES_CHAT,
    "documents": _REPLACES_CHAT,
    "tokenize": _CHANGES_OUTPUT, "return_dict": _CHANGES_OUTPUT, "return_tensors": _CHANGES_OUTPUT,
    "return_assistant_tokens_mask": _CHANGES_OUTPUT, "padding": _CHANGES_OUTPUT, "truncation": _CHANGES_OUTPUT,
    "max_length": _CHANGES_OUTPUT, "tokenizer_kwargs": _CHANGES_OUTPUT, "sanitize_control_tokens": _CHANGES_OUTPUT,
    # the functions of the environment transformers renders templates in (jinja's and its own)
    **{name: _SHADOWS_FUNCTION for name in ("range", "dict", "lipsum", "cycler", "joiner", "namespace",
                                            "raise_exception", "strftime_now")},
}
"""Keys a template kwargs object may not hold, each with why."""

EXAMPLE = '{"enable_thinking": false}'
_FIX = f"template kwargs are variables the template reads as data, e.g. {EXAMPLE}"


def _kind(value) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), f"a {type(value).__name__}")


def template_kwargs_problem(kwargs) -> str | None:
    """What is wrong with chat-template kwargs (None: nothing; None kwargs are none given), as the
    middle of a line: "holds 'chat_template' (a string): ...; drop the key". Pure."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        return f"is {_kind(kwargs)} {quoted(kwargs, 40)}, not a JSON object; {_FIX}"
    if not all(isinstance(k, str) for k in kwargs):
        return f"has a key that is not text; {_FIX}"
    for key, value in kwargs.items():
        if key in RESERVED_TEMPLATE_KWARGS:
            return (f"holds {key!r} ({_kind(value)}): {RESERVED_TEMPLATE_KWARGS[key]}; drop the key ({_FIX})")
    if nesting_depth(kwargs) > MAX_OPTION_DEPTH:
        return f"is nested more than {MAX_OPTION_DEPTH} levels deep; {_FIX}"
    try:
        # allow_nan=False: NaN and Infinity are not JSON, and they are written into manifests and settings
        size = len(json.dumps(kwargs, allow_nan=False).encode())
    except ValueError:
        return "holds a number that is not finite (NaN or Infinity), which JSON cannot hold; pass finite numbers"
    except TypeError:
        return f"must hold plain JSON values; {_FIX}"
    if size > TEMPLATE_KWARGS_BYTES:
        return f"takes {size:,} bytes of JSON, more than {TEMPLATE_KWARGS_BYTES:,}; {_FIX}"
    return None


def check_template_kwargs(kwargs, what: str = "--chat-template-kwargs", error: type[DFlashError] = ConfigError,
                          fix: str | None = None) -> None:
    """Raise `error` naming `what` (the option, or a manifest's field) when the kwargs are not
    variables a template reads as data; `fix`, when given, follows the problem."""
    problem = template_kwargs_problem(kwargs)
    if problem:
        raise error(f"{shown(what, 200)} {problem}" + (f"; {fix}" if fix else ""))
