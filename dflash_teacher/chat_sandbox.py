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
  TEMPLATE_TEXT_TOTAL budgets;
- every container a filter or a str/list/dict method returns (`|list`, `|batch`, `|map`,
  `.split()`, `.copy()`) is counted against the same budgets by its shape (text_measures.built_size),
  an iterator's items as they are yielded, since a template can build millions of lists and no text.

Past a budget the render raises TemplateTooCostly, naming the template. The budgets are far above
what a real template needs: it loops over the messages and writes each once, plus a few markers.
The tokenizer's own render, which runs after this one passes, does the same work.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from functools import lru_cache

from dflash_teacher.render_budget import TEMPLATE_TEXT_BASE, Budget, TemplateTooCostly, current, spending
from dflash_teacher.text_measures import (
    BINOPS,
    FILTER_MEASURES,
    as_int,
    built_item_size,
    built_size,
    method_size,
    result_length,
    str_format_size,
    text_size,
)

MEMORY = "bytes of memory"
"""The unit containers are counted in (text_measures.built_size)."""

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


def _call(env):
    """The sandbox's call(), measuring the str and bytes methods that grow text first."""
    def call(context, obj, *args, **kwargs):
        budget = current()
        if budget is not None and isinstance(obj, types.BuiltinMethodType):
            owner = getattr(obj, "__self__", None)
            if isinstance(owner, (str, bytes)):
                args = list(args)
                budget.build(method_size(owner, obj.__name__, args, kwargs, budget), f"a .{obj.__name__}() result")
            elif isinstance(owner, int) and obj.__name__ == "to_bytes":
                budget.build(as_int(args[0] if args else kwargs.get("length", 1)), "a .to_bytes() result")
        result = type(env).call(env, context, obj, *args, **kwargs)
        if budget is not None and isinstance(obj, types.BuiltinMethodType):  # .split(), .copy(): new containers
            size = built_size(result, new_strings=isinstance(getattr(obj, "__self__", None), (str, bytes)))
            if size:
                budget.build(size, f"a .{obj.__name__}() result", MEMORY)
        return result
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


def _counted(name: str, func: Callable) -> Callable:
    """`func` (a filter), with the containers it returns counted against the render's budget: a
    list, tuple, dict or set as built_size measures it, an iterator item by item as it yields
    (`|batch(1)|list` over a megabyte builds a million lists, and no text). Jinja's pass-argument
    marks are kept."""
    @functools.wraps(func)
    def counted(*args, **kwargs):
        result = func(*args, **kwargs)
        budget = current()
        if budget is None or isinstance(result, (str, bytes)):
            return result
        if hasattr(result, "__next__"):
            return _counting(result, budget, f"a |{name} result")
        size = built_size(result)
        if size:
            budget.build(size, f"a |{name} result", MEMORY)
        return result

    return counted


def _counting(items, budget: Budget, what: str):
    """`items` yielded one by one, refused once what they add up to is past one value's budget."""
    size = 0
    for item in items:
        size += built_item_size(item)
        if size > budget.chars:
            budget.build(size, what, MEMORY)
        yield item
    budget.build(size, what, MEMORY)


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
    for name, func in list(env.filters.items()):
        if name in FILTER_MEASURES:
            func = _measured(name, func, FILTER_MEASURES[name])
        env.filters[name] = _counted(name, func)
    if "lipsum" in env.globals:
        env.globals["lipsum"] = _measured("lipsum", env.globals["lipsum"], FILTER_MEASURES["lipsum"])
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


def render_guarded(source: str, variables: dict, budget: Budget) -> str:
    """`source` rendered with `variables` under `budget`; raises TemplateTooCostly past it."""
    import jinja2.sandbox

    # a template variable shadows the environment's global range(): this render's alone is budgeted
    variables = {**variables, "range": lambda *args: BudgetedRange(jinja2.sandbox.safe_range(*args), budget)}
    with spending(budget):
        written, chunks = 0, []
        for chunk in guarded_template(source).generate(**variables):
            written += len(chunk)
            budget.written(written)
            chunks.append(chunk)
    return "".join(chunks)
