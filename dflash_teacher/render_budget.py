"""What one chat's guarded render may spend (see dflash_teacher.chat_sandbox): the budgets, the
Budget a render spends, and the budget of the render running on this thread."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

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

    def build(self, length: int, what: str, unit: str = "characters") -> None:
        """Allow building one value of `length` characters (or items, or for a container bytes of
        memory, counted against the same budgets), or refuse it unbuilt."""
        if length > self.chars:
            self._refuse(f"asked for {what} of {length:,} {unit} (at most {self.chars:,} here)")
        self.total -= length
        if self.total < 0:
            self._refuse(f"built more than {TEMPLATE_TEXT_TOTAL * self.chars:,} characters in all (with {what})")
        self.clock()

    def written(self, length: int) -> None:
        if length > self.chars:
            self._refuse(f"wrote a chat of {length:,} characters (at most {self.chars:,} here)")


def current() -> Budget | None:
    return getattr(_guard, "budget", None)


@contextmanager
def spending(budget: Budget) -> Iterator[Budget]:
    """Make `budget` the one this thread's guarded render spends, until the block ends."""
    previous, _guard.budget = current(), budget
    try:
        yield budget
    finally:
        _guard.budget = previous
