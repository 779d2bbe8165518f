"""Workloads: deterministic batches of chat prompts shaped like real serving traffic.

Each generator renders its prompts through the model's chat template, so the token ids are exactly
what a server would see, and draws its choices from a seeded `random.Random`: the same arguments
always give the same prompts. The patterns differ in how much of their prompts they share:

- `shared_system_prompt`: one long system prompt, many short questions (a chat product);
- `short_system_prompt`: the same shape, small: about 150 shared tokens, a dozen questions;
- `few_shot`: a few tasks, each with its own instructions and worked examples, many queries;
- `multi_turn_chat`: conversations where every turn resends the whole history so far;
- `branching`: one conversation that forks into several follow-ups, which fork again;
- `no_sharing`: every prompt with a different system prompt (the control).

Every workload reports its *unique-token floor*: the number of distinct token prefixes across its
prompts, which is the number of nodes of a trie holding them all. A prefix cache cannot compute
fewer prompt tokens than that: each distinct prefix ends in a token whose KV depends on that whole
prefix, and no other prompt can supply it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvlearn.errors import check_positive_int
from kvlearn.model import template_ids
from kvlearn.serving.prefixes import unique_token_floor


@dataclass(frozen=True)
class Workload:
    """A named list of prompts (token ids) plus a short label per prompt for display.

    Invariant: `unique_token_floor <= num_prompt_tokens`, with equality when no two prompts share
    even their first token.
    """

    name: str
    description: str
    prompts: tuple[tuple[int, ...], ...]
    labels: tuple[str, ...]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def unique_token_floor(self) -> int:
        return unique_token_floor(self.prompts)

    @property
    def shareable_fraction(self) -> float:
        """Fraction of prompt tokens a perfect prefix cache would not compute."""
        return 1.0 - self.unique_token_floor / self.num_prompt_tokens

    def prompt_lists(self) -> list[list[int]]:
        """The prompts as plain lists, the form `Engine.generate` and Hugging Face take."""
        return [list(p) for p in self.prompts]

    def __repr__(self) -> str:
        return (f"Workload({self.name!r}: {self.num_requests} requests, {self.num_prompt_tokens:,} prompt "
                f"tokens, unique-token floor {self.unique_token_floor:,} "
                f"({self.shareable_fraction:.0%} shareable))")


def _check_count(name: str, value: int, available: int | None = None) -> None:
    check_positive_int(name, value)
    if available is not None and value > available:
        raise ValueError(f"{name}={value} is more than the {available} distinct items this workload has; "
                         f"ask for at most {available}.")


# --- shared system prompt ----------------------------------------------------------------------

LIBRARY_SYSTEM_PROMPT = """\
You are Ada, the help desk assistant of the Northbridge Public Library. Answer visitors' questions \
in two or three friendly sentences. Facts you can rely on: the main building on Elm Street opens \
from nine in the morning to eight in the evening on weekdays, and from ten to five on Saturdays; it \
is closed on Sundays and public holidays. The Riverside branch opens only in the afternoons. A \
library card is free for anyone who lives, works or studies in the city; visitors bring a photo ID \
and a letter or bill with their address. Members may borrow up to twelve items at a time: books for \
three weeks, films and music for one week. Loans can be renewed twice online unless someone else \
has reserved the item. There are no late fees for children's books; for other items the fee is \
twenty cents a day, capped at five dollars. The reading rooms on the second floor are silent \
zones. Group study rooms hold up to six people and can be booked for two hours a day. Printing \
costs ten cents a page in black and white and fifty cents in colour. Wireless internet is free and \
needs no password. The makerspace has two 3D printers and a sewing machine; a short safety \
session is required first. Story time for toddlers is on Tuesday and Thursday mornings. If you do \
not know an answer, say so and suggest asking a librarian at the front desk. Lost property is kept \
at the front desk for thirty days."""

LIBRARY_QUESTIONS = (
    "What time do you open on Saturday?",
    "Can I get a library card if I only work in the city?",
    "How many books can I borrow at once?",
    "How long can I keep a film?",
    "Is there a fee if I return a children's book late?",
    "How much does colour printing cost?",
    "Do I need a password for the wifi?",
    "Can I book a study room for my team of five?",
    "Is the library open on Sunday?",
    "How do I renew a book?",
    "When is story time for toddlers?",
    "Can I use the 3D printer today?",
    "What is the maximum late fee?",
    "Where can I read in silence?",
    "What do I need to bring to sign up?",
    "Does the Riverside branch open in the morning?",
    "Can I renew a book that someone reserved?",
    "How long can I keep a music album?",
    "Is there a sewing machine I can use?",
    "How late are you open on Wednesday?",
    "Can six people use one study room?",
    "How much is black and white printing?",
    "Are you open on public holidays?",
    "Can a student from another town get a card?",
)


def shared_system_prompt(tokenizer, num_requests: int = 16, seed: int = 0) -> Workload:
    """One long system prompt (about 300 tokens) shared by every request, then a short question."""
    _check_count("num_requests", num_requests, len(LIBRARY_QUESTIONS))
    questions = random.Random(seed).sample(LIBRARY_QUESTIONS, num_requests)
    prompts = [template_ids(tokenizer, [{"role": "system", "content": LIBRARY_SYSTEM_PROMPT},
                                        {"role": "user", "content": q}]) for q in questions]
    return Workload("shared_system", "one library help-desk system prompt, many short visitor questions",
                    tuple(map(tuple, prompts)), tuple(questions))


BIKE_SHOP_SYSTEM_PROMPT = """\
You are Pip, the front desk assistant of Spoke & Chain, a small bicycle repair shop. Answer in one \
or two short sentences. The shop opens Tuesday to Saturday from eight to six. A basic tune-up costs \
forty dollars and takes a day; a flat tyre is fixed while you wait for twelve dollars. Customers \
may rent a city bike for fifteen dollars a day, helmet included. Repairs are guaranteed for thirty \
days. We sell used bikes, checked by a mechanic, with a one-year warranty. Parking for cargo bikes \
is behind the shop. Lights, bells and locks are sold at the counter. \
If a question is not about bikes, say politely that you can only help with the \
shop."""

BIKE_SHOP_QUESTIONS = (
    "Are you open on Monday?", "How much is a tune-up?", "Can you fix a flat while I wait?",
    "How much does it cost to rent a bike for a day?", "Is a helmet included with the rental?",
    "How long is the guarantee on repairs?", "Do you sell used bikes?", "Where can I park my cargo bike?",
    "What time do you close on Saturday?", "How long does a tune-up take?",
    "Do used bikes come with a warranty?", "Can you help me with my tax return?",
    "Do you open before nine?", "What does a flat tyre repair cost?",
)


def short_system_prompt(tokenizer, num_requests: int = 12, seed: int = 0) -> Workload:
    """A small workload: a system prompt of about 150 tokens shared by a dozen short questions
    (prompts of about 170 tokens), where per-step overheads weigh more than on `shared_system`."""
    _check_count("num_requests", num_requests, len(BIKE_SHOP_QUESTIONS))
    questions = random.Random(seed).sample(BIKE_SHOP_QUESTIONS, num_requests)
    prompts = [template_ids(tokenizer, [{"role": "system", "content": BIKE_SHOP_SYSTEM_PROMPT},
                                        {"role": "user", "content": q}]) for q in questions]
    return Workload("short_system", "a short bike-shop system prompt, a dozen questions",
                    tuple(map(tuple, prompts)), tuple(questions))


# --- few-shot -------------------------------------------------------------------------------------

FEW_SHOT_TASKS = {
    "sentiment": (
        "Label the sentiment of each review as positive or negative.",
        [("The soup was cold and the waiter ignored us.", "negative"),
         ("Lovely staff, and the cake was perfect.", "positive"),
         ("I waited an hour for a burnt pizza.", "negative"),
         ("Best coffee in town, I come back every week.", "positive")],
        ["The room was clean and quiet.", "The battery died after two days.",
         "Great value for the price.", "The film was far too long and dull.",
         "Friendly driver and a smooth ride.", "My order arrived broken."],
    ),
    "capital": (
        "Give the capital city of each country.",
        [("France", "Paris"), ("Japan", "Tokyo"), ("Canada", "Ottawa"), ("Kenya", "Nairobi")],
        ["Italy", "Egypt", "Peru", "Norway", "Vietnam", "Australia"],
    ),
    "plural": (
        "Write the plural of each English noun.",
        [("cat", "cats"), ("box", "boxes"), ("child", "children"), ("mouse", "mice")],
        ["city", "knife", "tooth", "bus", "sheep", "leaf"],
    ),
}


def few_shot(tokenizer, num_requests: int = 12, seed: int = 0) -> Workload:
    """Requests spread over a few tasks; a task's instructions and worked examples are shared."""
    pool = [(task, query) for task, (_, _, queries) in FEW_SHOT_TASKS.items() for query in queries]
    _check_count("num_requests", num_requests, len(pool))
    chosen = random.Random(seed).sample(pool, num_requests)
    prompts, labels = [], []
    for task, query in chosen:
        instructions, examples, _ = FEW_SHOT_TASKS[task]
        shots = "\n".join(f"Input: {x}\nOutput: {y}" for x, y in examples)
        prompts.append(template_ids(tokenizer, [{"role": "user",
                                                 "content": f"{instructions}\n\n{shots}\nInput: {query}\nOutput:"}]))
        labels.append(f"{task}: {query}")
    return Workload("few_shot", "three tasks, each with four worked examples, many queries",
                    tuple(map(tuple, prompts)), tuple(labels))


# --- multi-turn chat ------------------------------------------------------------------------------

CONVERSATIONS = (  # (user, assistant) turns
    [
        ("I want to start running. How often should I go?",
         "Three short runs a week is a good start, with a rest day between them."),
        ("How long should each run be?",
         "Begin with twenty minutes, alternating one minute of running and two of walking."),
        ("What shoes do I need?",
         "Any comfortable running shoes that fit well; a shop can check your stride."),
        ("Should I stretch before running?",
         "Warm up with five minutes of brisk walking; stretch gently after the run."),
    ],
    [
        ("Can you help me plan a vegetable garden?",
         "Gladly. How much space do you have, and how much sun does it get?"),
        ("About four square metres with sun all afternoon.",
         "That suits tomatoes, beans, lettuce and herbs well."),
        ("When should I plant the tomatoes?",
         "After the last frost, once nights stay above ten degrees."),
        ("How often do they need water?",
         "Deeply two or three times a week, more often in a heatwave."),
    ],
    [
        ("What is a good first programming language?",
         "Python is a popular choice: its syntax is readable and it has many tutorials."),
        ("What can I build with it as a beginner?",
         "Small games, a to-do list, or scripts that rename your photos."),
        ("How long until I can get a job?",
         "With steady practice, many people need one to two years."),
        ("Which book should I read first?",
         "Pick a project-based beginner book and type every example yourself."),
    ],
    [
        ("I am visiting Lisbon for three days. Any tips?",
         "Walk the Alfama district, ride tram 28 and try a custard tart in Belem."),
        ("Is it easy to get around without a car?",
         "Yes: metro, trams and buses cover the centre, and it is very walkable."),
        ("What about a day trip?",
         "Sintra is forty minutes by train, with palaces in the hills."),
        ("Where should I watch the sunset?",
         "The viewpoints of Graca or Santa Luzia look over the whole city."),
    ],
)


def multi_turn_chat(tokenizer, num_conversations: int = 3, num_turns: int = 3, seed: int = 0) -> Workload:
    """Chats where turn k resends turns 1..k-1 (user and assistant) before its new question.

    Prompts come in rounds (every conversation's first turn, then every second turn, ...), the way
    concurrent users take turns; each prompt extends its conversation's previous prompt.
    """
    _check_count("num_conversations", num_conversations, len(CONVERSATIONS))
    _check_count("num_turns", num_turns, min(len(c) for c in CONVERSATIONS))
    chosen = random.Random(seed).sample(range(len(CONVERSATIONS)), num_conversations)
    prompts, labels = [], []
    for turn in range(num_turns):
        for c in chosen:
            history = []
            for user, assistant in CONVERSATIONS[c][:turn]:
                history += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            question = CONVERSATIONS[c][turn][0]
            prompts.append(template_ids(tokenizer, history + [{"role": "user", "content": question}]))
            labels.append(f"chat {c} turn {turn + 1}: {question}")
    return Workload("multi_turn",
                    f"{num_conversations} conversations x {num_turns} turns, each turn resends the history",
                    tuple(map(tuple, prompts)), tuple(labels))


# --- branching ------------------------------------------------------------------------------------

BRANCH_ROOT = ("Write the opening line of a mystery story set in a lighthouse.",
               "The lamp had burned every night for ninety years, until the night the keeper vanished.")
BRANCH_ANSWER = "The fog rolled in, and the bell began to ring on its own."
BRANCHES = (
    ("Continue it as a ghost story.", "Continue it as a comedy.", "Continue it as a detective story."),
    ("Now make it end happily.", "Now end it with a twist.", "Now end it in one sentence."),
)


def branching(tokenizer, num_branches: int = 3, num_leaves: int = 2, seed: int = 0) -> Workload:
    """One opening exchange that forks into `num_branches` follow-ups, each forking `num_leaves` ways.

    Every node of the tree below the root is one request (a follow-up and its children), the shape
    of tree search and of users regenerating and editing a chat.
    """
    _check_count("num_branches", num_branches, len(BRANCHES[0]))
    _check_count("num_leaves", num_leaves, len(BRANCHES[1]))
    rng = random.Random(seed)
    trunk = [{"role": "user", "content": BRANCH_ROOT[0]}, {"role": "assistant", "content": BRANCH_ROOT[1]}]
    prompts, labels = [], []
    for branch in rng.sample(BRANCHES[0], num_branches):
        prompts.append(template_ids(tokenizer, trunk + [{"role": "user", "content": branch}]))
        labels.append(branch)
        # The branch's answer is scripted so the prompts are known in advance, like a replayed trace.
        answered = trunk + [{"role": "user", "content": branch}, {"role": "assistant", "content": BRANCH_ANSWER}]
        for leaf in rng.sample(BRANCHES[1], num_leaves):
            prompts.append(template_ids(tokenizer, answered + [{"role": "user", "content": leaf}]))
            labels.append(f"{branch} / {leaf}")
    return Workload("branching", f"one exchange forking {num_branches} ways, each forking {num_leaves} ways",
                    tuple(map(tuple, prompts)), tuple(labels))


# --- no sharing (control) -------------------------------------------------------------------------

PERSONAS = ("Pirate", "Librarian", "Chef", "Astronaut", "Gardener", "Detective", "Poet", "Mechanic",
            "Teacher", "Doctor", "Farmer", "Pilot", "Painter", "Sailor", "Baker", "Judge")
TOPICS = ("the moon", "rain", "bread", "maps", "bees", "glass", "trains", "salt", "owls", "ice",
          "paper", "wind", "clocks", "honey", "stones", "rivers")


def no_sharing(tokenizer, num_requests: int = 16, seed: int = 0) -> Workload:
    """Every prompt has its own system prompt, so prompts share only the template's first tokens."""
    _check_count("num_requests", num_requests, len(PERSONAS))
    rng = random.Random(seed)
    personas, topics = rng.sample(PERSONAS, num_requests), rng.sample(TOPICS, num_requests)
    prompts = [template_ids(tokenizer, [{"role": "system", "content": f"{p}s answer every question in character."},
                                        {"role": "user", "content": f"Tell me one fact about {t}."}])
               for p, t in zip(personas, topics, strict=True)]
    return Workload("no_sharing", "a different system prompt per request (control)",
                    tuple(map(tuple, prompts)), tuple(f"{p}: {t}" for p, t in zip(personas, topics, strict=True)))


WORKLOADS = {
    "shared_system": shared_system_prompt,
    "short_system": short_system_prompt,
    "few_shot": few_shot,
    "multi_turn": multi_turn_chat,
    "branching": branching,
    "no_sharing": no_sharing,
}


def make_workload(name: str, tokenizer, **sizes) -> Workload:
    """Build the workload called `name` (a key of WORKLOADS) with the generator's keyword sizes."""
    if name not in WORKLOADS:
        raise ValueError(f"Unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}.")
    return WORKLOADS[name](tokenizer, **sizes)
