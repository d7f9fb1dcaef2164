"""A chat template rendered under a budget: the work it does and the text it builds.

Jinja's sandbox keeps a template from reaching Python, but not from spending it: two nested loops
over a 100,000-character string are 10^10 steps, a macro calling itself twice to depth 40 is 2^40
calls, and `~`, `|replace`, `|join`, `|center(10**9)`, `'%1000000000d'|format`, `.ljust`,
`'{:>N}'.format`, `|indent` or `|tojson(indent=...)` build gigabyte strings before anything
looks at them. So before the tokenizer renders a chat, the same template renders it once more in
a guarded copy of its environment (same filters, globals and extensions, taken from transformers'
compile of an empty template), where:

- every loop iteration, loop test, macro or call-block call and range() item is a step, and a
  render may take TEMPLATE_STEPS of them and TEMPLATE_SECONDS of time;
- every string (or list) a template builds is measured *before* it is built, from its operands:
  the operators `~ * ** + %`, the filters and methods that grow text, values written out; each
  may be at most the chat's text budget (template_text_budget) and all of them together
  TEMPLATE_TEXT_TOTAL budgets.

Past a budget the render raises TemplateTooCostly, naming the template. The budgets are far above
what a real template needs: it loops over the messages and writes each once, plus a few markers.
The tokenizer's own render, which runs after this one passes, does the same work.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import string
import threading
import time
import types
from collections.abc import Callable
from functools import lru_cache

TEMPLATE_STEPS = 1_000_000
"""Loop iterations, loop tests, macro calls and range() items one chat's render may take."""
TEMPLATE_SECONDS = 20.0
"""Seconds one chat's render may take (a backstop: each step may itself cost up to a budget)."""
TEMPLATE_TEXT_BASE = 1 << 20
"""Characters a rendered chat may hold beyond TEMPLATE_TEXT_PER_INPUT per character of its input."""
TEMPLATE_TEXT_PER_INPUT = 4
"""Characters a rendered chat may hold per character of its messages and template variables."""
TEMPLATE_TEXT_TOTAL = 64
"""Text budgets all the strings one render builds may add up to (a loop rebuilding a string)."""

_guard = threading.local()  # the budget of the guarded render running on this thread


class TemplateTooCostly(RuntimeError):
    """A chat template took more steps or time, or built more text, than one chat may cost."""


def template_text_budget(messages: list[dict], chat_template_kwargs: dict | None) -> int:
    """The most characters rendering this chat may produce, or build in one expression."""
    size = len(json.dumps(messages, ensure_ascii=False, default=str))
    size += len(json.dumps(chat_template_kwargs or {}, ensure_ascii=False, default=str))
    return TEMPLATE_TEXT_BASE + TEMPLATE_TEXT_PER_INPUT * size


class Budget:
    """What one chat's render may still spend; `name` names the template in every refusal."""

    def __init__(self, chars: int, name: str, steps: int | None = None, seconds: float | None = None):
        self.chars, self.name = chars, name
        self.steps = TEMPLATE_STEPS if steps is None else steps
        self.total = TEMPLATE_TEXT_TOTAL * chars
        self.deadline = time.monotonic() + (TEMPLATE_SECONDS if seconds is None else seconds)
        self._steps_given = self.steps

    def _refuse(self, what: str) -> None:
        raise TemplateTooCostly(f"the chat template of {self.name} {what} for one chat, so rendering was stopped; "
                                "fix or replace the template")

    def step(self) -> str:
        """Spend one step (returns "", so a step can be written out or or-ed into a test)."""
        self.steps -= 1
        if self.steps < 0:
            self._refuse(f"took more than {self._steps_given:,} steps (loop iterations, loop tests, macro calls, "
                         "range() items: nested loops or recursion?)")
        if not self.steps & 1023:
            self.clock()
        return ""

    def clock(self) -> None:
        if time.monotonic() > self.deadline:
            self._refuse(f"took more than {TEMPLATE_SECONDS:g} s")

    def build(self, length: int, what: str) -> None:
        """Allow building one value of `length` characters (or items), or refuse it unbuilt."""
        if length > self.chars:
            self._refuse(f"asked for {what} of {length:,} characters (at most {self.chars:,} here)")
        self.total -= length
        if self.total < 0:
            self._refuse(f"built more than {TEMPLATE_TEXT_TOTAL * self.chars:,} characters in all (with {what})")
        self.clock()

    def written(self, length: int) -> None:
        if length > self.chars:
            self._refuse(f"wrote a chat of {length:,} characters (at most {self.chars:,} here)")


def current() -> Budget | None:
    return getattr(_guard, "budget", None)


# --- measuring a value before it is built -------------------------------------------------------

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


def number_digits(value: int) -> int:
    """Decimal digits of an int, from its bit length."""
    return abs(value).bit_length() * 302 // 1000 + 1


def _as_int(value, default: int = 0) -> int:
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
    return sum(abs(_as_int(v)) for v in values)


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
    step = len(indent) if isinstance(indent, str) else max(_as_int(indent), 0) if indent is not None else 0
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
    if operator == "*" and _as_int(left, None) is not None and isinstance(right, sized):
        left, right = right, left
    if operator == "*" and isinstance(left, sized) and _as_int(right, None) is not None:
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


# --- the hooks the guarded environment calls ---------------------------------------------------


def _binop(context, operator: str, left, right):
    budget = current()
    if budget is not None:
        budget.build(result_length(operator, left, right, budget.chars), f"a {operator!r} result")
    return BINOPS[operator](left, right)


def _concat(join, parts: tuple):
    budget = current()
    if budget is not None:
        size = 0
        for part in parts:
            size += text_size(part, budget.chars)
            if size > budget.chars:
                break
        budget.build(size, "a '~' result")
    return join(parts)


def _finalize(value):
    budget = current()
    if budget is not None and not isinstance(value, str):
        budget.build(text_size(value, budget.chars), "a value written out")
    return value


def _materialized(value, budget: Budget) -> list:
    """An iterable as a list, a step per item (a generator is consumed once: the call gets the list)."""
    if isinstance(value, (list, tuple, str, bytes)):
        return list(value) if not isinstance(value, list) else value
    items = []
    for item in value:
        budget.step()
        items.append(item)
    return items


def _method_size(owner, name: str, args: list, kwargs: dict, budget: Budget) -> int:
    """Characters a str or bytes method would make (0: one that does not grow its text); may
    replace a consumed iterable argument in `args` with its list."""
    def arg(index, key, default=None):
        return args[index] if len(args) > index else kwargs.get(key, default)

    length = len(owner)
    if name in ("ljust", "rjust", "center", "zfill"):
        return max(length, _as_int(arg(0, "width")))
    if name == "expandtabs":
        return length + owner.count("\t" if isinstance(owner, str) else b"\t") * max(_as_int(arg(0, "tabsize", 8)), 1)
    if name == "replace":
        old, new, count = arg(0, "old"), arg(1, "new"), _as_int(arg(2, "count", -1), -1)
        if not isinstance(old, type(owner)) or not isinstance(new, type(owner)):
            return 0
        hits = owner.count(old) if old else length + 1
        return length + (hits if count < 0 else min(hits, count)) * max(len(new) - len(old), 0)
    if name == "join" and args:
        args[0] = items = _materialized(args[0], budget)
        return sum(_sized(i) for i in items) + length * max(len(items) - 1, 0)
    if name == "translate":
        table = arg(0, "table")
        widest = max((len(v) for v in table.values() if isinstance(v, str)), default=1) if isinstance(table, dict) else 1
        return length * max(widest, 1)
    if name in ("encode", "hex"):
        return 4 * length
    return 0


def _call(env):
    """The sandbox's call(), measuring the str and bytes methods that grow text first."""
    def call(context, obj, *args, **kwargs):
        budget = current()
        if budget is not None and isinstance(obj, types.BuiltinMethodType):
            owner = getattr(obj, "__self__", None)
            if isinstance(owner, (str, bytes)):
                args = list(args)
                budget.build(_method_size(owner, obj.__name__, args, kwargs, budget), f"a .{obj.__name__}() result")
            elif isinstance(owner, int) and obj.__name__ == "to_bytes":
                budget.build(_as_int(args[0] if args else kwargs.get("length", 1)), "a .to_bytes() result")
        return type(env).call(env, context, obj, *args, **kwargs)
    return call


def _wrap_str_format(env):
    def wrap(value):
        wrapped = type(env).wrap_str_format(env, value)
        if wrapped is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def guarded(*args, **kwargs):
            budget = current()
            if budget is not None:
                positional, named = ((), args[0]) if is_map and args else (args, kwargs)
                budget.build(str_format_size(fmt, positional, named, budget.chars), "a .format() result")
            return wrapped(*args, **kwargs)

        return functools.update_wrapper(guarded, wrapped)
    return wrap


def _measure_filters() -> dict[str, Callable]:
    """For each filter that grows text: (its bound arguments, budget) -> characters it would make.
    A measure may replace a consumed iterable argument with its list."""
    def center(a, b):
        return max(text_size(a["value"], b.chars), _as_int(a["width"]))

    def replace(a, b):
        s, old, new, count = str(a["s"]) if isinstance(a["s"], str) else a["s"], a["old"], a["new"], a["count"]
        if not all(isinstance(x, str) for x in (s, old, new)):
            return text_size(s, b.chars) + text_size(new, b.chars)
        hits = s.count(old) if old else len(s) + 1
        hits = min(hits, _as_int(count, hits)) if count is not None else hits
        return len(s) + hits * max(len(new) - len(old), 0)

    def join(a, b):
        a["value"] = items = _materialized(a["value"], b)
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

    def indent(a, b):
        s, width = a["s"], a["width"]
        pad = len(width) if isinstance(width, str) else max(_as_int(width), 0)
        return text_size(s, b.chars) + (str(s).count("\n") + 1 if isinstance(s, str) else 1) * pad

    def format_(a, b):
        values = a["kwargs"] or a["args"]
        return percent_size(str(a["value"]) if isinstance(a["value"], str) else "", values, b.chars)

    def tojson(a, b):
        return json_size(a.get("x", a.get("value")), a.get("indent"), b.chars)

    def wordwrap(a, b):
        s = a["s"]
        wrap = a.get("wrapstring")
        return text_size(s, b.chars) * (1 + (len(wrap) if isinstance(wrap, str) else 1))

    def escape(a, b):
        s = next(iter(a.values()))
        if not isinstance(s, str):
            return text_size(s, b.chars) * 6
        return len(s) + 4 * sum(s.count(c) for c in "&<>\"'")

    def text(a, b):
        return text_size(next(iter(a.values())), b.chars)

    def pprint(a, b):
        return 2 * text_size(a["value"], b.chars)

    def urlize(a, b):
        value = a["value"]
        extra = sum(len(a.get(k) or "") for k in ("target", "rel") if isinstance(a.get(k), str))
        words = len(value.split()) if isinstance(value, str) else 1
        return 3 * text_size(value, b.chars) + words * (64 + extra)

    def batch(a, b):
        return _as_int(a["linecount"]) if a.get("fill_with") is not None else 0

    def slice_(a, b):
        return _as_int(a["slices"])

    def sum_(a, b):
        a["iterable"] = items = _materialized(a["iterable"], b)
        start = a.get("start")
        if not isinstance(start, (list, tuple, str)) and not any(isinstance(i, (list, tuple)) for i in items[:1]):
            return 0
        total = _sized(start) + sum(_sized(i) for i in items)
        b.build(total * len(items), "a |sum of sequences (copied once per item)")
        return total

    def lipsum(a, b):
        return max(_as_int(a["n"], 5), 0) * max(_as_int(a["max"], 100), 1) * 16

    return {"center": center, "replace": replace, "join": join, "indent": indent, "format": format_,
            "tojson": tojson, "wordwrap": wordwrap, "e": escape, "escape": escape, "forceescape": escape,
            "string": text, "pprint": pprint, "urlize": urlize, "batch": batch, "slice": slice_, "sum": sum_,
            "xmlattr": lambda a, b: 6 * text_size(a["d"], b.chars), "urlencode": lambda a, b: 3 * text_size(
                a["value"], b.chars), "lipsum": lipsum}


def _measured(name: str, func: Callable, measure: Callable) -> Callable:
    """`func` (a filter or global), measured by `measure` before it runs. Jinja's pass-argument
    marks (context, environment) are kept, so it is called as the original was."""
    signature = inspect.signature(func)

    @functools.wraps(func)
    def guarded(*args, **kwargs):
        budget = current()
        if budget is None:
            return func(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        budget.build(measure(bound.arguments, budget), f"a |{name} result")
        return func(*bound.args, **bound.kwargs)

    return guarded


# --- the guarded compile -----------------------------------------------------------------------


class _StepMarker:
    """A constant the guarded compiler writes as a step (falsy, so `step or test` is the test)."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "<template step>"


STEP = _StepMarker()


@lru_cache(maxsize=1)
def _compiler():
    """Jinja's compiler with a step at the top of every block it runs (a loop body, a macro or
    call block, an if branch), `~` measured, and the STEP constant written as a step."""
    from jinja2.compiler import CodeGenerator

    class BudgetedCodeGenerator(CodeGenerator):
        def blockvisit(self, nodes, frame) -> None:
            self.writeline("environment.dflash_step()")
            super().blockvisit(nodes, frame)

        def visit_Const(self, node, frame) -> None:
            if node.value is STEP:
                self.write("environment.dflash_step()")
            else:
                super().visit_Const(node, frame)

        def visit_Concat(self, node, frame) -> None:
            if frame.eval_ctx.volatile:
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            else:
                join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
            self.write(f"environment.dflash_concat({join}, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    return BudgetedCodeGenerator


def _step_loop_tests(tree, env) -> None:
    """A step before every loop test: a loop whose test is always false runs no block."""
    from jinja2 import nodes

    for node in tree.find_all(nodes.For):
        if node.test is not None:
            step = nodes.Const(STEP).set_lineno(node.lineno).set_environment(env)
            node.test = nodes.Or(step, node.test).set_lineno(node.lineno).set_environment(env)


def _folded(node) -> object:
    """The value Jinja's compiler would fold a constant expression of the measured operators
    into, made only while each result stays under TEMPLATE_TEXT_BASE (else TemplateTooCostly); None
    for anything else. Folding happens when a template is compiled, before any render's budget."""
    from jinja2 import nodes

    if isinstance(node, nodes.Const):
        return node.value
    if isinstance(node, nodes.BinExpr) and node.operator in BINOPS:
        left, right = _folded(node.left), _folded(node.right)
        if left is None or right is None:
            return None
        length = result_length(node.operator, left, right, TEMPLATE_TEXT_BASE)
        if length > TEMPLATE_TEXT_BASE:
            raise TemplateTooCostly(f"the chat template holds a constant {node.operator!r} expression of {length:,} "
                                    f"characters (at most {TEMPLATE_TEXT_BASE:,}), which compiling it would build; fix "
                                    "the template")
        try:
            return BINOPS[node.operator](left, right)
        except Exception:  # noqa: BLE001 - jinja leaves an expression it cannot fold to run time
            return None
    return None


@lru_cache(maxsize=16)
def guarded_template(source: str):
    """The chat template compiled in a guarded copy of the environment transformers renders it in
    (see the module's docstring). transformers' compiled template and jinja itself are left as
    they are; the copy gets its own filters and globals."""
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    base = _compile_jinja_template("").environment
    env = base.overlay()
    env.code_generator_class = _compiler()
    env.optimized = False  # folding would build constants unmeasured, and drop the loop tests' steps
    env.intercepted_binops = frozenset(BINOPS)
    env.call_binop = _binop
    env.dflash_step = lambda: _step()
    env.dflash_concat = _concat
    env.finalize = _finalize if base.finalize is None else (lambda value: _finalize(base.finalize(value)))
    env.filters = dict(base.filters)
    env.globals = dict(base.globals)
    measures = _measure_filters()
    for name, func in list(env.filters.items()):
        if name in measures:
            env.filters[name] = _measured(name, func, measures[name])
    if "lipsum" in env.globals:
        env.globals["lipsum"] = _measured("lipsum", env.globals["lipsum"], measures["lipsum"])
    env.wrap_str_format = _wrap_str_format(env)
    env.call = _call(env)
    tree = env.parse(source)
    for node in tree.find_all(nodes.BinExpr):
        _folded(node)
    _step_loop_tests(tree, env)
    return env.from_string(tree)


def _step() -> str:
    budget = current()
    return budget.step() if budget is not None else ""


class BudgetedRange:
    """A sandbox range whose iteration spends the guarded render's steps."""

    def __init__(self, rng: range, budget: Budget):
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
        return iter(BudgetedRange(self.rng[::-1], self.budget))


def render_guarded(source: str, variables: dict, budget: Budget) -> None:
    """Render `source` with `variables` under `budget`; raises TemplateTooCostly past it."""
    import jinja2.sandbox

    # a template variable shadows the environment's global range(): this render's alone is budgeted
    variables = {**variables, "range": lambda *args: BudgetedRange(jinja2.sandbox.safe_range(*args), budget)}
    previous, _guard.budget = current(), budget
    try:
        written = 0
        for chunk in guarded_template(source).generate(**variables):
            written += len(chunk)
            budget.written(written)
    finally:
        _guard.budget = previous
