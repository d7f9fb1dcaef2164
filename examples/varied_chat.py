"""Vary a synthetic_chat reply among equally valid phrasings, so a teacher that learns the corpus
is uncertain exactly at those choices and confident everywhere else (issue 54's third and fourth
caches).

`vary_reply` rewrites one reply of synthetic_chat's generators: an optional opener and closing
sentence (full replies only: a system prompt asking for brevity keeps replies bare, so the teacher
stays confident there), synonyms for the generators' fixed phrases, and the order of a
description's last two sentences. Every choice is uniform and independent of the prompt, so no
model can predict it: each is a branch point of known entropy. `canonical` maps every variant
back to one form, to score a reply as right whatever phrasing it chose.

No imports from synthetic_chat: it calls in here (with varied=True), never the other way.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

OPENERS = ["", "Sure. ", "Of course! ", "Happy to help. ", "Here is the answer. "]
CLOSERS = ["", " Hope that helps!", " Anything else?", " Just ask if you need more."]
# Greetings and thanks are not answers: an opener or closer there would read oddly.
_SOCIAL = ("Hello! ", "You're welcome! ")

# Each group lists interchangeable phrases of the base generators' replies; the first is the
# base generator's own, which `canonical` maps every other member back to. Longer phrases come
# first in the pattern, so " enjoys eating " is never read as " enjoys " + "eating ".
SYNONYMS: list[list[str]] = [
    [" likes to eat ", " loves to eat ", " enjoys eating "],
    [" lives in ", " makes a home in ", " resides in "],
    ["'s best friend is ", "'s closest friend is ", "'s dearest friend is "],
    [" enjoys ", " loves ", " is fond of "],
    [" years old", " years of age"],
    ["Let's add ", "We add ", "I'll add "],
    [" column by column.", " one column at a time.", " digit by digit."],
    ["So ", "That gives ", "In total, "],
    ["The list has ", "That list has ", "I count "],
    ["Spelling it out: ", "Letter by letter: ", "Spelled out: "],
    [" means adding ", " is the same as adding "],
    ["Starting at ", "Beginning at ", "From "],
    [" each time: ", " at every step: "],
    ["For example, ", "For instance, ", "As an example, "],
    [" starts with the letter ", " begins with the letter "],
    [" ends with the letter ", " finishes with the letter "],
    [" creatures live in ", " creatures make their home in "],
    ["You're welcome! ", "Glad I could help! ", "My pleasure! "],
]
_ALTERNATIVE = {phrase: group for group in SYNONYMS for phrase in group}


def _alternation(phrases) -> re.Pattern:
    # A phrase that starts with a letter starts a word, so "So " never matches the end of "Also ".
    def start(phrase: str) -> str:
        return ("(?<!\\w)" if phrase[0].isalpha() else "") + re.escape(phrase)

    return re.compile("|".join(start(p) for p in sorted(phrases, key=len, reverse=True)))


# Varying rewrites only the base phrases (the other members never occur in base replies: a test
# checks); canonical reads every member back.
_BASE = _alternation(group[0] for group in SYNONYMS)
_ANY = _alternation(_ALTERNATIVE)

# synthetic_chat.describe's shape: "{n} is a ... in {town}. {n} is {age} years old, ... {hobby}.
# {n}'s best friend is {friend}." Its last two sentences say independent facts in either order.
_DESCRIPTION = re.compile(r"^(\w+ is an? [^.]+\.) (\w+ is \d+ [^.]+\.) (\w+'s [^.]+\.)$")


@dataclass(frozen=True)
class Varied:
    text: str
    nats: float
    """The entropy of the choices drawn (a sum of ln(options)): the least loss per reply any
    model can reach on its variable parts (a bound, as two choice paths could spell one text)."""


def _swap_sentences(rng: random.Random, reply: str) -> tuple[str, float]:
    match = _DESCRIPTION.match(reply)
    if not match:
        return reply, 0.0
    first, second, third = match.groups()
    return (f"{first} {third} {second}" if rng.random() < 0.5 else reply), math.log(2)


def _synonyms(rng: random.Random, reply: str) -> tuple[str, float]:
    nats = 0.0
    pieces, end = [], 0
    for match in _BASE.finditer(reply):
        group = _ALTERNATIVE[match.group()]
        pieces += [reply[end : match.start()], rng.choice(group)]
        nats += math.log(len(group))
        end = match.end()
    return "".join(pieces) + reply[end:], nats


def vary_reply(rng: random.Random, reply: str, brief: bool) -> Varied:
    """One of the equally valid rewrites of a base generator's reply, drawn uniformly at each
    choice point."""
    text, order_nats = _swap_sentences(rng, reply)
    text, synonym_nats = _synonyms(rng, text)
    if brief or reply.startswith(_SOCIAL):
        return Varied(text, order_nats + synonym_nats)
    opener, closer = rng.choice(OPENERS), rng.choice(CLOSERS)
    nats = order_nats + synonym_nats + math.log(len(OPENERS)) + math.log(len(CLOSERS))
    return Varied(opener + text + closer, nats)


def canonical(reply: str) -> str:
    """The base generator's phrasing of any variant: opener and closer removed, each synonym
    mapped to its group's first phrase, a description's sentences in the base order."""
    text = reply.strip()
    for opener in sorted(filter(None, OPENERS), key=len, reverse=True):
        text = text.removeprefix(opener)
    for closer in sorted(filter(None, CLOSERS), key=len, reverse=True):
        text = text.removesuffix(closer)
    text = _ANY.sub(lambda m: _ALTERNATIVE[m.group()][0], text)
    swapped = re.match(r"^(\w+ is an? [^.]+\.) (\w+'s [^.]+\.) (\w+ is \d+ [^.]+\.)$", text)
    return f"{swapped[1]} {swapped[3]} {swapped[2]}" if swapped else text
