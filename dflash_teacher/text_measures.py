"""How big a value a chat template asks for would be, found before it is built: str() of a value,
a binary operator's result, str.format and % formatting, json, the str and bytes methods and the
filters that grow text (dflash_teacher.chat_sandbox charges these to the render's budget)."""

from __future__ import annotations

import re
import string
from collections.abc import Callable

from dflash_teacher.render_budget import Budget

_BIG = 1 << 62  # a size no budget admits: what a number too long to read stands for


def text_size(value, limit: int, quoted: int = 2) -> int:
    """About how many characters str(value) holds (an upper bound within a small factor), found
    without making it; stops counting past `limit`. Shared lists (a list of one list twice, 30
    times over) are counted as often as they are written, as str() would write them."""
    if isinstance(value, str):
        return len(value)
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item) * (1 if isinstance(item, str) else 4) + quoted + 2
        elif isinstance(item, bool) or item is None:
            total += 7
        elif isinstance(item, int):
            total += number_digits(item) + 2
        elif isinstance(item, float):
            total += 26
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            stack.extend(item)
        elif type(item).__name__.endswith("Namespace"):
            total += 16
            stack.append(object.__getattribute__(item, "_Namespace__attrs"))
        else:  # Undefined, a loop, a macro, a generator: a short repr
            total += 64
    return total


_CONTAINERS = (list, tuple, set, frozenset, dict)
_REFERENCE = 8
"""What one item of a container costs, as bytes of memory (a pointer)."""
_OBJECT = 56
"""What a new container or string object costs beside its items or text, as bytes of memory."""


def _shell(item, new_strings: bool) -> int:
    """A container's own memory without its items' (a dict's keys and values both counted); a
    string's when it is new."""
    if isinstance(item, _CONTAINERS):
        return _OBJECT + _REFERENCE * len(item) * (2 if isinstance(item, dict) else 1)
    if new_strings and isinstance(item, (str, bytes)):
        return _OBJECT + len(item)
    return 0


def built_size(value, new_strings: bool = False) -> int:
    """What a container a template built costs, as bytes of memory (comparable to characters of
    text, a character being a byte): its items' references, the containers it holds one level down
    (a |batch(1) result's one-item lists) and, with `new_strings` (a .split() result), its strings;
    not the text of strings shared with the values it was built from, which were measured when
    they were built. 0 for anything else."""
    if not isinstance(value, _CONTAINERS):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return _shell(value, False) + sum(_shell(item, new_strings) for item in items)


def built_item_size(item) -> int:
    """What one item a filter's iterator yields adds to the container it may become (built_size)."""
    return _REFERENCE + _shell(item, False)


def number_digits(value: int) -> int:
    """Decimal digits of an int, from its bit length."""
    return abs(value).bit_length() * 302 // 1000 + 1


def as_int(value, default: int = 0) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def _digits_sum(spec: str) -> int:
    """The sum of the numbers a format spec holds (its width and precision), or _BIG for one too
    long to be a sane width."""
    total = 0
    for number in re.findall(r"\d+", spec):
        total += _BIG if len(number) > 15 else int(number)
    return total


def _int_args(args, kwargs) -> int:
    values = list(args) + list(kwargs.values()) if isinstance(kwargs, dict) else list(args)
    return sum(abs(as_int(v)) for v in values)


def str_format_size(fmt: str, args, kwargs, limit: int) -> int:
    """Characters `fmt.format(*args, **kwargs)` could make: its literal text, every field's
    width and precision (a nested {} width taken as the sum of the integer arguments) and the
    text of the argument each field names."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return 0  # the real call raises the same error
    size, auto = len(fmt), 0
    for _, field, spec, conversion in fields:
        if field is None:
            continue
        spec = spec or ""
        size += _digits_sum(spec) + (_int_args(args, kwargs) if "{" in spec else 0)
        root = re.split(r"[.\[]", field, maxsplit=1)[0]
        if root == "":
            value, auto = (args[auto] if auto < len(args) else None), auto + 1
        elif root.isdigit():
            value = args[int(root)] if len(root) < 6 and int(root) < len(args) else None
        else:
            value = kwargs.get(root) if isinstance(kwargs, dict) else None
        size += text_size(value, limit) * (4 if conversion in ("r", "a") else 1)
        if size > limit:
            break
    return size


_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")


def percent_size(fmt: str, values, limit: int) -> int:
    """Characters `fmt % values` could make: its text, every conversion's width and precision
    (a * taken as the sum of the integer values) and the values' text."""
    size, conversions = len(fmt), 0
    args = values if isinstance(values, tuple) else (values,)
    for width, precision, _ in _PERCENT.findall(fmt[: limit + 1]):
        conversions += 1
        for number in (width, precision):
            size += _int_args(args, {}) if number == "*" else _digits_sum(number)
    if isinstance(values, dict):
        size += conversions * text_size(values, limit)
    else:
        size += sum(text_size(v, limit) for v in args)
    return size


def json_size(value, indent, limit: int) -> int:
    """Characters json.dumps(value, indent=indent) could make: every string escaped at worst
    (six characters a character), and every item on its own line indented to its depth."""
    step = len(indent) if isinstance(indent, str) else max(as_int(indent), 0) if indent is not None else 0
    total, stack = 0, [(value, 1)]
    while stack and total <= limit:
        item, depth = stack.pop()
        total += 2 + (1 + depth * step if step or indent is not None else 2)
        if isinstance(item, str):
            total += 6 * len(item)
        elif isinstance(item, dict):
            stack.extend((k, depth + 1) for k in item.keys())
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
        else:
            total += text_size(item, limit)
    return total


def _sized(seq) -> int:
    return len(seq) if isinstance(seq, (str, bytes, list, tuple)) else 0


def result_length(operator: str, left, right, limit: int = _BIG) -> int:
    """How long the sequence (or, for numbers, the digit string) a binary operation would make,
    found without making it."""
    sized = (str, bytes, list, tuple)
    if operator == "*" and as_int(left, None) is not None and isinstance(right, sized):
        left, right = right, left
    if operator == "*" and isinstance(left, sized) and as_int(right, None) is not None:
        return len(left) * max(right, 0)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator == "%" and isinstance(left, (str, bytes)):
        return percent_size(left if isinstance(left, str) else left.decode("latin-1"), right, limit)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        return int(right * abs(left).bit_length() * 0.302) + 1  # decimal digits of the power
    if operator == "*" and isinstance(left, int) and isinstance(right, int):
        return (abs(left).bit_length() + abs(right).bit_length()) * 302 // 1000 + 1
    return 0


BINOPS: dict[str, Callable] = {"*": lambda a, b: a * b, "**": lambda a, b: a ** b, "+": lambda a, b: a + b,
                               "%": lambda a, b: a % b}


def materialized(value, budget: Budget) -> list:
    """An iterable as a list, a step per item (a generator is consumed once: the call gets the list)."""
    if isinstance(value, (list, tuple, str, bytes)):
        return list(value) if not isinstance(value, list) else value
    items = []
    for item in value:
        budget.step()
        items.append(item)
    return items


def method_size(owner, name: str, args: list, kwargs: dict, budget: Budget) -> int:
    """Characters a str or bytes method would make (0: one that does not grow its text); may
    replace a consumed iterable argument in `args` with its list."""
    def arg(index, key, default=None):
        return args[index] if len(args) > index else kwargs.get(key, default)

    length = len(owner)
    if name in ("ljust", "rjust", "center", "zfill"):
        return max(length, as_int(arg(0, "width")))
    if name == "expandtabs":
        return length + owner.count("\t" if isinstance(owner, str) else b"\t") * max(as_int(arg(0, "tabsize", 8)), 1)
    if name == "replace":
        old, new, count = arg(0, "old"), arg(1, "new"), as_int(arg(2, "count", -1), -1)
        if not isinstance(old, type(owner)) or not isinstance(new, type(owner)):
            return 0
        hits = owner.count(old) if old else length + 1
        return length + (hits if count < 0 else min(hits, count)) * max(len(new) - len(old), 0)
    if name == "join" and args:
        args[0] = items = materialized(args[0], budget)
        return sum(_sized(i) for i in items) + length * max(len(items) - 1, 0)
    if name == "translate":
        table = arg(0, "table")
        widest = max((len(v) for v in table.values() if isinstance(v, str)), default=1) if isinstance(table, dict) else 1
        return length * max(widest, 1)
    if name in ("encode", "hex"):
        return 4 * length
    return 0


# --- the filters that grow text: (their bound arguments, budget) -> characters they would make ---
# A measure may replace a consumed iterable argument with its list.


def _center(a, b):
    return max(text_size(a["value"], b.chars), as_int(a["width"]))


def _replace(a, b):
    s, old, new, count = str(a["s"]) if isinstance(a["s"], str) else a["s"], a["old"], a["new"], a["count"]
    if not all(isinstance(x, str) for x in (s, old, new)):
        return text_size(s, b.chars) + text_size(new, b.chars)
    hits = s.count(old) if old else len(s) + 1
    hits = min(hits, as_int(count, hits)) if count is not None else hits
    return len(s) + hits * max(len(new) - len(old), 0)


def _join(a, b):
    a["value"] = items = materialized(a["value"], b)
    if a.get("attribute") is not None:
        from jinja2.filters import make_attrgetter

        getter = make_attrgetter(a["eval_ctx"].environment, a["attribute"])
        items = [getter(i) for i in items]
        a["value"], a["attribute"] = items, None
    sizes = 0
    for item in items:
        sizes += text_size(item, b.chars)
        if sizes > b.chars:
            break
    return sizes + text_size(a["d"], b.chars) * max(len(items) - 1, 0)


def _indent(a, b):
    s, width = a["s"], a["width"]
    pad = len(width) if isinstance(width, str) else max(as_int(width), 0)
    return text_size(s, b.chars) + (str(s).count("\n") + 1 if isinstance(s, str) else 1) * pad


def _format(a, b):
    values = a["kwargs"] or a["args"]
    return percent_size(str(a["value"]) if isinstance(a["value"], str) else "", values, b.chars)


def _tojson(a, b):
    return json_size(a.get("x", a.get("value")), a.get("indent"), b.chars)


def _wordwrap(a, b):
    s = a["s"]
    wrap = a.get("wrapstring")
    return text_size(s, b.chars) * (1 + (len(wrap) if isinstance(wrap, str) else 1))


def _escape(a, b):
    s = next(iter(a.values()))
    if not isinstance(s, str):
        return text_size(s, b.chars) * 6
    return len(s) + 4 * sum(s.count(c) for c in "&<>\"'")


def _text(a, b):
    return text_size(next(iter(a.values())), b.chars)


def _pprint(a, b):
    return 2 * text_size(a["value"], b.chars)


def _urlize(a, b):
    value = a["value"]
    extra = sum(len(a.get(k) or "") for k in ("target", "rel") if isinstance(a.get(k), str))
    words = len(value.split()) if isinstance(value, str) else 1
    return 3 * text_size(value, b.chars) + words * (64 + extra)


def _batch(a, b):
    return as_int(a["linecount"]) if a.get("fill_with") is not None else 0


def _slice(a, b):
    return as_int(a["slices"])


def _sum(a, b):
    a["iterable"] = items = materialized(a["iterable"], b)
    start = a.get("start")
    if not isinstance(start, (list, tuple, str)) and not any(isinstance(i, (list, tuple)) for i in items[:1]):
        return 0
    total = _sized(start) + sum(_sized(i) for i in items)
    b.build(total * len(items), "a |sum of sequences (copied once per item)")
    return total


def _lipsum(a, b):
    return max(as_int(a["n"], 5), 0) * max(as_int(a["max"], 100), 1) * 16


FILTER_MEASURES: dict[str, Callable] = {
    "center": _center, "replace": _replace, "join": _join, "indent": _indent, "format": _format,
    "tojson": _tojson, "wordwrap": _wordwrap, "e": _escape, "escape": _escape, "forceescape": _escape,
    "string": _text, "pprint": _pprint, "urlize": _urlize, "batch": _batch, "slice": _slice, "sum": _sum,
    "xmlattr": lambda a, b: 6 * text_size(a["d"], b.chars), "urlencode": lambda a, b: 3 * text_size(a["value"], b.chars),
    "lipsum": _lipsum}
"""For each filter (and the lipsum global) that grows text: its measure, given the filter's bound
arguments and the render's Budget."""
