"""Synthetic chat conversations with learnable structure, for the quickstart's tiny teacher.

Every assistant reply is a deterministic function of the conversation so far (task, numbers,
the fictional world's facts, and whether the system prompt asks for brevity), so a small model
trained on a few thousand rows becomes confident and a drafter trained on its features can
generalise to prompts it has never seen. Prompts vary in phrasing; replies vary only where
the input does.

All randomness flows through an explicit `random.Random`, so a seed fixes the output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import varied_chat

Message = dict[str, str]
Turn = tuple[str, str]  # (user text, assistant text)

# The world is fixed by its own seed so that training and held-out prompts ask about the same
# entities; only the corpus seed differs between the two.
WORLD_SEED = 1234
WORLD_SIZE = 100

SYSTEM_PROMPTS_FULL = [
    "You are a helpful assistant.",
    "You are a friendly assistant who explains each step.",
    "You are a careful tutor. Show your work.",
]
SYSTEM_PROMPTS_BRIEF = [
    "You are a helpful assistant. Answer briefly.",
    "Be concise: give only the answer.",
]

KINDS = ["fox", "owl", "dragon", "robot", "otter", "wizard", "bear", "cat", "heron", "golem"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "silver", "black", "white", "brown"]
TOWNS = [
    "Ashford", "Brindle Cove", "Cinderfall", "Dunmere", "Elmstead", "Fernhollow",
    "Greywater", "Harrowgate", "Ivybridge", "Juniper Vale", "Kestrel Point", "Larkspur",
]
FOODS = [
    "apples", "honey", "fish", "mushrooms", "plums", "bread", "carrots", "cheese",
    "berries", "soup", "rice", "pears",
]
HOBBIES = [
    "painting", "singing", "sailing", "reading", "gardening", "climbing",
    "baking", "dancing", "fishing", "chess", "juggling", "knitting",
]
NAME_SYLLABLES = [
    "ka", "lo", "mi", "ru", "zen", "tor", "bel", "vi", "dra", "quo", "fen", "sil",
    "mar", "no", "thi", "gal", "pe", "ros", "ul", "wen",
]

WORDS = [
    "apple", "river", "stone", "garden", "window", "candle", "forest", "mirror", "pencil",
    "rabbit", "bottle", "castle", "dragon", "engine", "flower", "guitar", "hammer", "island",
    "jacket", "kettle", "ladder", "monkey", "needle", "orange", "pillow", "rocket", "saddle",
    "tunnel", "violin", "wallet", "yellow", "zipper", "anchor", "basket", "cactus", "donkey",
    "feather", "glove", "harbor", "igloo", "jungle", "koala", "lemon", "magnet", "nest",
    "ocean", "parrot", "quilt", "robin", "spoon", "tiger", "umbrella", "valley", "walrus",
    "bread", "cloud", "desk", "egg", "frog", "goat", "hat", "ink", "jam", "kite", "lamp",
    "moon", "nut", "owl", "pear", "queen", "ring", "sun", "tree", "van", "wolf", "yarn",
    "zebra", "acorn", "bridge", "comet", "dolphin", "eagle", "fountain", "giraffe", "honey",
    "iron", "jewel", "kitten", "lantern", "marble", "nickel", "olive", "pepper", "quartz",
    "ribbon", "salmon", "teapot", "unicorn", "velvet", "whistle", "button", "cookie",
    "daisy", "ember", "fiddle", "gravel", "helmet", "insect", "jigsaw", "kernel", "lizard",
    "meadow", "noodle", "oyster", "puzzle", "raisin", "sponge", "tulip", "walnut",
]

# Spelling a word is recalled, not copied, so the letter tasks use a short list a tiny model can
# memorise within its training budget.
SPELLING_WORDS = [
    "apple", "river", "stone", "garden", "candle", "lemon", "tiger", "zebra", "ocean", "robin",
    "honey", "moon", "frog", "goat", "kite", "lamp", "nest", "pear", "ring", "tree",
    "cloud", "bread", "eagle", "olive", "spoon", "tulip", "walnut", "yarn", "owl", "sun",
]

# (unit, target unit, factor)
CONVERSIONS = [
    ("kilometers", "meters", 1000),
    ("meters", "centimeters", 100),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("kilograms", "grams", 1000),
    ("days", "hours", 24),
    ("weeks", "days", 7),
    ("dozens", "items", 12),
    ("liters", "milliliters", 1000),
    ("years", "months", 12),
]

GLOSSARY = {
    "a noun": "A noun is a word that names a person, place or thing. For example, 'river', "
    "'teacher' and 'city' are nouns.",
    "a verb": "A verb is a word that describes an action or a state. For example, 'run', "
    "'think' and 'be' are verbs.",
    "an adjective": "An adjective is a word that describes a noun. For example, in 'a red "
    "kite', the word 'red' is an adjective.",
    "a prime number": "A prime number is a whole number greater than 1 that can only be "
    "divided evenly by 1 and itself. The first few primes are 2, 3, 5, 7 and 11.",
    "an even number": "An even number is a whole number that can be divided by 2 with no "
    "remainder. For example, 4, 10 and 36 are even.",
    "an odd number": "An odd number is a whole number that leaves a remainder of 1 when "
    "divided by 2. For example, 3, 9 and 21 are odd.",
    "photosynthesis": "Photosynthesis is the process plants use to turn sunlight, water and "
    "carbon dioxide into sugar and oxygen. It happens mostly in the leaves.",
    "evaporation": "Evaporation is when a liquid turns into a gas. For example, a puddle "
    "dries up because its water evaporates in the warm air.",
    "gravity": "Gravity is the force that pulls objects toward each other. It is why things "
    "fall to the ground and why the moon circles the earth.",
    "a triangle": "A triangle is a flat shape with three straight sides and three corners. "
    "Its three angles always add up to 180 degrees.",
    "a square": "A square is a flat shape with four equal sides and four right angles.",
    "a circle": "A circle is a round flat shape where every point on the edge is the same "
    "distance from the center. That distance is called the radius.",
    "a mammal": "A mammal is a warm-blooded animal that has hair or fur and feeds its young "
    "with milk. Dogs, whales and humans are mammals.",
    "a reptile": "A reptile is a cold-blooded animal with dry, scaly skin. Snakes, lizards "
    "and turtles are reptiles.",
    "a planet": "A planet is a large round body that travels around a star. The earth is a "
    "planet that travels around the sun.",
    "a fraction": "A fraction is a way to write part of a whole. In 3/4, the 4 says how many "
    "equal parts the whole has and the 3 says how many of them we take.",
    "an average": "The average of some numbers is their sum divided by how many numbers "
    "there are. The average of 2, 4 and 6 is 12 / 3 = 4.",
    "a list": "A list is an ordered collection of items. The first item comes first, the "
    "last item comes last, and the order matters.",
    "a sentence": "A sentence is a group of words that expresses a complete thought. It "
    "starts with a capital letter and ends with a period, a question mark or an exclamation "
    "mark.",
    "a recipe": "A recipe is a set of instructions for cooking a dish. It lists the "
    "ingredients first and then the steps in order.",
    "a map": "A map is a drawing of an area seen from above. It shows where places are and "
    "how to travel between them.",
    "a clock": "A clock is a tool that shows the time. A day has 24 hours, an hour has 60 "
    "minutes and a minute has 60 seconds.",
    "melting": "Melting is when a solid turns into a liquid because it gets warmer. Ice "
    "melts into water at 0 degrees Celsius.",
    "freezing": "Freezing is when a liquid turns into a solid because it gets colder. Water "
    "freezes into ice at 0 degrees Celsius.",
    "a rainbow": "A rainbow is an arc of colors in the sky. It appears when sunlight shines "
    "through raindrops, which split the light into red, orange, yellow, green, blue and "
    "violet.",
    "a volcano": "A volcano is an opening in the ground where hot melted rock, called lava, "
    "comes out from deep inside the earth.",
    "an island": "An island is a piece of land that is surrounded by water on all sides.",
    "a habit": "A habit is something a person does so often that they do it without "
    "thinking, like brushing their teeth every morning.",
    "a vowel": "A vowel is one of the letters a, e, i, o and u. Every English word has at "
    "least one vowel sound.",
    "a palindrome": "A palindrome is a word that reads the same forwards and backwards. "
    "For example, 'level' and 'noon' are palindromes.",
}


@dataclass(frozen=True)
class Entity:
    name: str
    kind: str
    color: str
    town: str
    food: str
    hobby: str
    age: int
    friend: str


# A task generator takes (rng, brief, world) and returns one (user, assistant) turn.
TaskGenerator = Callable[[random.Random, bool, list[Entity]], Turn]


def make_world(seed: int = WORLD_SEED, size: int = WORLD_SIZE) -> list[Entity]:
    """A fixed fictional world of `size` creatures, each with a few attributes."""
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < size:
        syllables = rng.choice([2, 2, 3])
        name = "".join(rng.choice(NAME_SYLLABLES) for _ in range(syllables)).capitalize()
        if name not in names:
            names.append(name)
    # A friend is another entity, chosen by a derangement-like shuffle so nobody is their own.
    friends = names[1:] + names[:1]
    rng.shuffle(friends)
    friends = [
        f if f != n else names[(i + 1) % size] for i, (n, f) in enumerate(zip(names, friends))
    ]
    return [
        Entity(
            name=name,
            kind=rng.choice(KINDS),
            color=rng.choice(COLORS),
            town=rng.choice(TOWNS),
            food=rng.choice(FOODS),
            hobby=rng.choice(HOBBIES),
            age=rng.randint(2, 99),
            friend=friend,
        )
        for name, friend in zip(names, friends)
    ]


def join_items(items: list[str]) -> str:
    return ", ".join(items)


def with_article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


# ---------------------------------------------------------------------------------------------
# Task generators. Each takes (rng, brief, world) and returns one (user, assistant) turn.
# `brief` is True when the system prompt asks for short answers. Brief replies about the world
# still open with a word ("Town: ...", "Food: ...") so the answer word has the same
# leading-space token as everywhere else.
#
# There are no tasks that copy a list of words from the prompt (repeating, reversing or sorting
# one): in four trials the 8-minute teacher never learned to copy list items (0% exact on
# held-out prompts, always the same few words), while it did learn the tasks below.
# ---------------------------------------------------------------------------------------------


def addition_steps(a: int, b: int) -> str:
    """Column addition of two numbers below 100, written out digit by digit."""
    ones = a % 10 + b % 10
    carry = ones // 10
    if a < 10 and b < 10:
        return f"{a} + {b} = {a + b}."
    if carry:
        ones_text = f"Ones: {a % 10} + {b % 10} = {ones}, so we write {ones % 10} and carry 1."
        tens_text = f"Tens: {a // 10} + {b // 10} + 1 = {a // 10 + b // 10 + 1}."
    else:
        ones_text = f"Ones: {a % 10} + {b % 10} = {ones}."
        tens_text = f"Tens: {a // 10} + {b // 10} = {a // 10 + b // 10}."
    return (
        f"Let's add {a} and {b} column by column. {ones_text} {tens_text} "
        f"So {a} + {b} = {a + b}."
    )


def task_addition(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    a, b = rng.randint(10, 99), rng.randint(1, 99)
    phrasing = rng.choice([
        "What is {a} + {b}?",
        "Add {a} and {b}.",
        "Compute {a} plus {b}.",
        "What do you get when you add {a} and {b}?",
        "Can you work out {a} + {b} for me?",
    ])
    answer = f"{a} + {b} = {a + b}." if brief else addition_steps(a, b)
    return phrasing.format(a=a, b=b), answer


def task_subtraction(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    a = rng.randint(2, 12)
    b = rng.randint(1, a)
    phrasing = rng.choice([
        "What is {a} - {b}?",
        "Subtract {b} from {a}.",
        "What is {a} minus {b}?",
        "If I have {a} apples and give away {b}, how many are left?",
    ])
    user = phrasing.format(a=a, b=b)
    if "apples" in user:
        answer = f"{a} - {b} = {a - b}. You have {a - b} apples left."
    else:
        answer = f"{a} - {b} = {a - b}."
    return user, answer


def task_multiplication(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    phrasing = rng.choice([
        "What is {a} times {b}?",
        "What is {a} × {b}?",
        "Multiply {a} by {b}.",
        "What is the product of {a} and {b}?",
    ])
    if brief:
        answer = f"{a} × {b} = {a * b}."
    else:
        answer = f"{a} × {b} means adding {a} to itself {b} times. {a} × {b} = {a * b}."
    return phrasing.format(a=a, b=b), answer


def task_count_words(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    items = rng.sample(WORDS, rng.randint(2, 7))
    phrasing = rng.choice([
        "How many words are in this list: {x}?",
        "Count the words: {x}",
        "How many items does the list {x} have?",
    ])
    if brief:
        answer = f"{len(items)} words."
    else:
        answer = f"The list has {len(items)} words."
    return phrasing.format(x=join_items(items)), answer


def task_add_small(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    phrasing = rng.choice(["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}."])
    return phrasing.format(a=a, b=b), f"{a} + {b} = {a + b}."


def task_count_letters(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    word = rng.choice(SPELLING_WORDS)
    phrasing = rng.choice([
        "How many letters are in the word '{w}'?",
        "How many letters does '{w}' have?",
        "Count the letters in '{w}'.",
        "Spell '{w}' and tell me how long it is.",
    ])
    if brief:
        answer = f"'{word}' has {len(word)} letters."
    else:
        answer = f"Spelling it out: {'-'.join(word)}. The word '{word}' has {len(word)} letters."
    return phrasing.format(w=word), answer


def task_first_last_letter(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    word = rng.choice(SPELLING_WORDS)
    if rng.random() < 0.5:
        user = rng.choice(
            ["What is the first letter of '{w}'?", "Which letter does '{w}' start with?"]
        )
        answer = f"The word '{word}' starts with the letter '{word[0]}'."
    else:
        user = rng.choice(
            ["What is the last letter of '{w}'?", "Which letter does '{w}' end with?"]
        )
        answer = f"The word '{word}' ends with the letter '{word[-1]}'."
    return user.format(w=word), answer


def task_convert(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    unit, target, factor = rng.choice(CONVERSIONS)
    n = rng.randint(1, 12)
    phrasing = rng.choice([
        "Convert {n} {u} to {t}.",
        "How many {t} are in {n} {u}?",
        "What is {n} {u} in {t}?",
        "I have {n} {u}. How many {t} is that?",
    ])
    # Every unit name is a regular plural, so dropping the "s" gives the singular.
    unit_name = unit[:-1] if n == 1 else unit
    amount = f"{n} {unit_name}"
    if brief:
        answer = f"{amount} = {n * factor} {target}."
    else:
        answer = (
            f"There are {factor} {target} in 1 {unit[:-1]}, so {amount} is "
            f"{n} × {factor} = {n * factor} {target}."
        )
    return phrasing.format(n=n, u=unit_name, t=target), answer


def task_sequence(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    """Count up or down from a number by a fixed step: a simple sequence to continue."""
    step = rng.randint(1, 5)
    if rng.random() < 0.7:
        start = rng.randint(0, 30)
        terms = [start + i * step for i in range(5)]
        direction, change = "up", "adding"
    else:
        start = rng.randint(4 * step, 4 * step + 30)
        terms = [start - i * step for i in range(5)]
        direction, change = "down", "subtracting"
    numbers = join_items([str(t) for t in terms])
    phrasing = rng.choice([
        "Count {d} by {s} from {a}.",
        "Count {d} from {a} in steps of {s}.",
        "Start at {a} and count {d} by {s}.",
    ])
    if brief:
        answer = f"{numbers}."
    else:
        answer = f"Starting at {start} and {change} {step} each time: {numbers}."
    return phrasing.format(d=direction, s=step, a=start), answer


def describe(entity: Entity) -> str:
    looks = with_article(f"{entity.color} {entity.kind}")
    return (
        f"{entity.name} is {looks} who lives in {entity.town}. "
        f"{entity.name} is {entity.age} years old, likes to eat {entity.food} and enjoys "
        f"{entity.hobby}. {entity.name}'s best friend is {entity.friend}."
    )


# (question templates, full answer, brief answer) for each attribute of an entity.
WORLD_QUESTIONS: list[tuple[list[str], Callable[[Entity], str], Callable[[Entity], str]]] = [
    (
        ["What color is {n}?", "What is {n}'s color?", "Which color is {n}?"],
        lambda e: f"{e.name} is {e.color}.",
        lambda e: f"Color: {e.color}.",
    ),
    (
        ["What kind of creature is {n}?", "What is {n}?", "Is {n} an animal or something else?"],
        lambda e: f"{e.name} is {with_article(e.kind)}.",
        lambda e: f"Kind: {e.kind}.",
    ),
    (
        ["Where does {n} live?", "Which town is {n} from?", "What is {n}'s home town?"],
        lambda e: f"{e.name} lives in {e.town}.",
        lambda e: f"Town: {e.town}.",
    ),
    (
        ["What does {n} like to eat?", "What is {n}'s favorite food?", "What food does {n} love?"],
        lambda e: f"{e.name} likes to eat {e.food}.",
        lambda e: f"Food: {e.food}.",
    ),
    (
        ["What is {n}'s hobby?", "What does {n} enjoy doing?", "How does {n} spend free time?"],
        lambda e: f"{e.name} enjoys {e.hobby}.",
        lambda e: f"Hobby: {e.hobby}.",
    ),
    (
        ["How old is {n}?", "What is {n}'s age?", "Tell me {n}'s age."],
        lambda e: f"{e.name} is {e.age} years old.",
        lambda e: f"Age: {e.age}.",
    ),
    (
        ["Who is {n}'s best friend?", "Who is {n} friends with?", "Name {n}'s best friend."],
        lambda e: f"{e.name}'s best friend is {e.friend}.",
        lambda e: f"Best friend: {e.friend}.",
    ),
    (
        ["Tell me about {n}.", "Who is {n}?", "Describe {n}.", "What do you know about {n}?"],
        describe,
        lambda e: f"{e.name} is {with_article(e.color + ' ' + e.kind)} from {e.town}.",
    ),
]


def task_world_fact(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    entity = rng.choice(world)
    # Descriptions are long and predictable: give them a larger share.
    templates, full, short = rng.choice(WORLD_QUESTIONS + WORLD_QUESTIONS[-1:] * 3)
    user = rng.choice(templates).format(n=entity.name)
    return user, short(entity) if brief else full(entity)


def task_world_town(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    town = rng.choice(TOWNS)
    residents = [e.name for e in world if e.town == town]
    user = rng.choice(
        ["Who lives in {t}?", "Which creatures live in {t}?", "List the residents of {t}."]
    )
    if brief:
        answer = f"Residents: {join_items(residents)}."
    else:
        answer = f"{len(residents)} creatures live in {town}: {join_items(residents)}."
    return user.format(t=town), answer


def task_glossary(rng: random.Random, brief: bool, world: list[Entity]) -> Turn:
    term = rng.choice(sorted(GLOSSARY))
    definition = GLOSSARY[term]
    user = rng.choice([
        "What is {t}?",
        "Can you explain what {t} is?",
        "Explain {t} in simple words.",
        "I don't understand what {t} is. Can you help?",
    ]).format(t=term)
    # The brief answer is the definition's first sentence.
    answer = definition.split(". ")[0].rstrip(".") + "." if brief else definition
    return user, answer


# (generator, sampling weight)
TASKS: list[tuple[TaskGenerator, float]] = [
    (task_addition, 1.5),
    (task_add_small, 0.8),
    (task_subtraction, 0.7),
    (task_multiplication, 1.0),
    (task_count_words, 0.6),
    (task_count_letters, 0.8),
    (task_first_last_letter, 0.5),
    (task_convert, 1.0),
    (task_sequence, 0.8),
    (task_world_fact, 3.0),
    (task_world_town, 0.4),
    (task_glossary, 1.2),
]

GREETINGS = ["Hi!", "Hello!", "Hey there.", "Good morning!"]
GREETING_REPLY = "Hello! I can help with arithmetic, word puzzles, unit conversions, number " \
    "sequences and questions about the creatures of our little world. What would you like to do?"
THANKS = ["Thanks!", "Thank you.", "Great, thanks a lot.", "That helps, thank you!"]
THANKS_REPLY = "You're welcome! Let me know if you have another question."


def sample_task(rng: random.Random) -> TaskGenerator:
    generators = [g for g, _ in TASKS]
    weights = [w for _, w in TASKS]
    return rng.choices(generators, weights)[0]


def sample_system(rng: random.Random) -> tuple[list[Message], bool]:
    """An optional system prompt, and whether it asks for brief answers."""
    roll = rng.random()
    if roll < 0.2:
        return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS_BRIEF)}], True
    if roll < 0.55:
        return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS_FULL)}], False
    return [], False


def sample_conversation(rng: random.Random, world: list[Entity], varied: bool = False) -> list[Message]:
    """One conversation: optional system prompt, then 1-3 user/assistant turns; `varied`: each
    reply drawn among its equally valid phrasings (varied_chat.vary_reply)."""
    messages, brief = sample_system(rng)
    n_turns = rng.choices([1, 2, 3], [0.5, 0.3, 0.2])[0]
    turns: list[Turn] = []
    if rng.random() < 0.08:
        turns.append((rng.choice(GREETINGS), GREETING_REPLY))
    while len(turns) < n_turns:
        turns.append(sample_task(rng)(rng, brief, world))
    if len(turns) >= 2 and rng.random() < 0.3:
        turns[-1] = (rng.choice(THANKS), THANKS_REPLY)
    if varied:
        # Drawn only when asked, so the default corpus (and the shipped teacher) stay as they were.
        turns = [(user, varied_chat.vary_reply(rng, reply, brief).text) for user, reply in turns]
    for user, assistant in turns:
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": assistant})
    return messages


@dataclass(frozen=True)
class HeldoutPrompt:
    messages: list[Message]  # optional system + one user message
    reference: str  # the reply the generator gives
    task: str  # the generator's name, for per-task scores


def sample_prompt(rng: random.Random, world: list[Entity], varied: bool = False) -> HeldoutPrompt:
    """A single-turn prompt (optional system + one user message) and its reference reply."""
    messages, brief = sample_system(rng)
    task = sample_task(rng)
    user, reference = task(rng, brief, world)
    if varied:
        reference = varied_chat.vary_reply(rng, reference, brief).text
    messages.append({"role": "user", "content": user})
    return HeldoutPrompt(messages=messages, reference=reference, task=task.__name__)


def make_corpus(seed: int, n_rows: int, world: list[Entity], varied: bool = False) -> list[list[Message]]:
    rng = random.Random(seed)
    return [sample_conversation(rng, world, varied) for _ in range(n_rows)]


def user_texts(conversations: list[list[Message]]) -> set[str]:
    return {m["content"] for conv in conversations for m in conv if m["role"] == "user"}


def make_teacher_extra(
    seed: int, n_rows: int, world: list[Entity], excluded_user_texts: set[str], varied: bool = False
) -> list[list[Message]]:
    """More conversations from the same generators, none asking an excluded (held-out) prompt."""
    rng = random.Random(seed)
    out: list[list[Message]] = []
    while len(out) < n_rows:
        conv = sample_conversation(rng, world, varied)
        if not any(m["role"] == "user" and m["content"] in excluded_user_texts for m in conv):
            out.append(conv)
    return out


def make_heldout(
    seed: int, n_rows: int, world: list[Entity], seen_user_texts: set[str], varied: bool = False
) -> list[HeldoutPrompt]:
    """Single-turn prompts whose user text never appears in the training corpus.

    Greetings and thanks are excluded by construction (sample_prompt draws tasks only), and
    prompts are also kept distinct from each other.
    """
    rng = random.Random(seed)
    out: list[HeldoutPrompt] = []
    taken = set(seen_user_texts)
    while len(out) < n_rows:
        prompt = sample_prompt(rng, world, varied)
        text = prompt.messages[-1]["content"]
        if text in taken:
            continue
        taken.add(text)
        out.append(prompt)
    return out
