"""Traces: the requests that reach a fleet of replicas, when, and with which prompts.

A trace is a list of `TraceRequest`s (`kvlearn.routing.trace_request`) sorted by arrival time.
It comes from one of two places:

- `read_trace(path)`: the user's JSON Lines file, one request per line with the fields `id`
  (string), `arrival` (seconds, >= 0), `prompt_ids` (token ids) or `prompt` (text, put through the
  course's chat template), `max_new_tokens` (int >= 1) and optional `session` (string). Every line
  is checked before anything runs; all bad lines are reported at once, each with its line number.
  A Mooncake trace (production traffic as prompt-block ids, see `kvlearn.routing.mooncake`) is
  recognised by its fields and read as such.
- `multi_tenant_trace(...)`: a seeded generator of the traffic prefix caches live on. Its knobs
  imitate what published production traces show:
  * many tenants (apps), each with its own system prompt of a few hundred to a few thousand tokens,
    and a few tenants taking most of the traffic: Zipf popularity, as measured for web objects
    (Breslau et al., "Web caching and Zipf-like distributions", INFOCOM 1999) and used for prompt
    popularity by prefix-caching studies;
  * multi-turn sessions whose every turn resends the whole conversation so far (ShareGPT-style
    chats; the Mooncake trace of Kimi, Qin et al. FAST 2025, shows long shared prefixes and
    outputs far shorter than inputs);
  * few-shot templates: a tenant's worked examples shared by a share of its sessions;
  * Poisson arrivals, or burstier ones (BurstGPT, Wang et al. 2024, found production LLM arrivals
    burstier than Poisson): inter-arrival times are Gamma with a chosen coefficient of variation.

A generated prompt is stored as a tuple of shared parts (system prompt, examples, turns), so a
100,000-request trace holds each system prompt once; `prompt_ids` joins the parts on demand.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np

from kvlearn.errors import check_positive_int
from kvlearn.routing.budget import check_generated_memory
from kvlearn.routing.jsonlines import bad_lines, json_lines
from kvlearn.routing.mooncake import is_mooncake, read_mooncake
from kvlearn.routing.trace_request import FIRST_TOKEN_ID, VOCAB_SIZE, TraceError, TraceRequest
from kvlearn.serving.prefixes import unique_token_floor as distinct_prefixes

FIELDS = {"id", "arrival", "prompt_ids", "prompt", "max_new_tokens", "session"}


# --- reading and writing ---------------------------------------------------------------------------

def _check_line(row, vocab_size: int | None) -> str | None:
    """What is wrong with one parsed line, or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    unknown = sorted(set(row) - FIELDS)
    if unknown:
        return f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(FIELDS))}"
    for name in ("id", "arrival", "max_new_tokens"):
        if name not in row:
            return f"missing field {name!r}"
    if not isinstance(row["id"], str) or not row["id"]:
        return f"'id' must be a non-empty string, got {row['id']!r}"
    arrival = row["arrival"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) or arrival < 0:
        return f"'arrival' must be a number of seconds >= 0, got {arrival!r}"
    n = row["max_new_tokens"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return f"'max_new_tokens' must be an int >= 1, got {n!r}"
    if "session" in row and not isinstance(row["session"], str):
        return f"'session' must be a string, got {row['session']!r}"
    if ("prompt_ids" in row) == ("prompt" in row):
        return "give exactly one of 'prompt_ids' (token ids) and 'prompt' (text)"
    if "prompt" in row:
        return None if isinstance(row["prompt"], str) and row["prompt"] else "'prompt' must be a non-empty string"
    ids = row["prompt_ids"]
    if not isinstance(ids, list) or not ids:
        return "'prompt_ids' must be a non-empty list of token ids"
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0
                or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        limit = f" and < {vocab_size}" if vocab_size is not None else ""
        return f"'prompt_ids' must hold ints >= 0{limit}, found {bad!r}"
    return None


def read_trace(path, vocab_size: int | None = VOCAB_SIZE, tokenizer=None, max_errors: int = 20,
               block_size: int = 512) -> list[TraceRequest]:
    """Read and check a JSON Lines trace (see the module docstring); requests sorted by arrival.

    Raises TraceError listing every bad line (up to `max_errors`) before returning anything. Lines
    with `prompt` text are tokenized with `tokenizer` (default: the course's, loaded on demand).
    A Mooncake trace (lines with `hash_ids`, gzipped or not; `block_size` tokens per id) is read
    by `kvlearn.routing.mooncake` instead: its token ids are its own, beyond any vocabulary."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No trace file at {path}: give a JSON Lines file (one request per line).")
    if is_mooncake(path):
        return read_mooncake(path, block_size, max_errors).trace_requests()
    rows, errors, seen = [], [], {}
    for number, row in json_lines(path, errors):
        problem = _check_line(row, vocab_size)
        if problem is None and row["id"] in seen:
            problem = f"id {row['id']!r} already used on line {seen[row['id']]}"
        if problem is not None:
            errors.append(f"{path}:{number}: {problem}")
        else:
            seen[row["id"]] = number
            rows.append((number, row))
    if errors:
        raise TraceError(bad_lines(errors, max_errors, "the trace; nothing was simulated"))
    if not rows:
        raise TraceError(f"{path} holds no requests: write one JSON object per line.")
    if tokenizer is None and any("prompt" in row for _, row in rows):
        from kvlearn.model import load_tokenizer
        tokenizer = load_tokenizer()
    requests = []
    for number, row in rows:
        if "prompt" in row:
            from kvlearn.model import chat_ids
            ids = chat_ids(tokenizer, row["prompt"])
        else:
            ids = row["prompt_ids"]
        requests.append(TraceRequest(row["id"], float(row["arrival"]), (tuple(ids),), row["max_new_tokens"],
                                     row.get("session"), line=number))
    requests.sort(key=lambda r: r.arrival)  # stable: equal arrivals keep file order
    _derive_answers(requests)
    return requests


def _derive_answers(requests: list[TraceRequest]) -> None:
    """A turn's answer is where its session's next turn continues its prompt (up to max_new_tokens)."""
    last = {}
    for req in requests:
        if req.session is None:
            continue
        before = last.get(req.session)
        if before is not None and req.num_prompt_tokens > before.num_prompt_tokens:
            prompt, previous = req.prompt_ids, before.prompt_ids
            if prompt[:len(previous)] == previous:
                before.answer = tuple(prompt[len(previous):len(previous) + before.max_new_tokens])
        last[req.session] = req


def check_trace_path(path) -> Path:
    """`path` as a Path if a trace may be written there: a regular file or a new name in an
    existing folder; else ValueError saying what to give."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder: give a file path to write the trace to, e.g. {path / 'trace.jsonl'}.")
    if path.exists() and not path.is_file():
        raise ValueError(f"{path} is not a regular file: give a file path to write the trace to.")
    if not path.parent.is_dir():
        raise ValueError(f"No folder {path.parent} to write the trace in: create it, or give a path in a folder that "
                         "exists.")
    return path


def write_trace(requests, path) -> Path:
    """Write a trace as JSON Lines (the format `read_trace` reads) to a file path (`check_trace_path`)."""
    path = check_trace_path(path)
    with path.open("w", encoding="utf-8") as f:
        for req in requests:
            f.write(json.dumps(req.to_json(), separators=(",", ":")) + "\n")
    return path


# --- the generator ---------------------------------------------------------------------------------

_ID_RANGE = VOCAB_SIZE - FIRST_TOKEN_ID
_ID_BITS = _ID_RANGE.bit_length()


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    """`n` ids drawn as `rng.randrange(FIRST_TOKEN_ID, VOCAB_SIZE)` would draw them, one by one,
    five times faster. randrange takes the top bits of one 32-bit word of the generator per try
    and tries again when the number is out of range; `getrandbits(32 * k)` returns the next k
    words in order, so taking their top bits and dropping the out-of-range ones gives the same
    ids from the same words, leaving the generator where the one-by-one draws would."""
    ids: list[int] = []
    while len(ids) < n:
        k = n - len(ids)
        words = np.frombuffer(rng.getrandbits(32 * k).to_bytes(4 * k, "little"), dtype="<u4") >> (32 - _ID_BITS)
        ids += (words[words < _ID_RANGE] + FIRST_TOKEN_ID).tolist()
    return tuple(ids)


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def multi_tenant_trace(num_requests: int = 1000, num_tenants: int = 16, zipf_s: float = 1.1,
                       system_tokens: tuple[int, int] = (200, 2000), question_tokens: tuple[int, int] = (16, 128),
                       output_tokens: tuple[int, int] = (16, 128), mean_turns: float = 3.0,
                       fewshot_share: float = 0.3, rate: float = 20.0, burstiness: float = 1.0,
                       think_time_s: float = 5.0, hot_tenant_share: float = 0.0, seed: int = 0) -> list[TraceRequest]:
    """A seeded multi-tenant trace of `num_requests` requests, sorted by arrival.

    Tenants have Zipf(`zipf_s`) popularity and system prompts of log-uniform length in
    `system_tokens`; `hot_tenant_share` > 0 sends that share of sessions to tenant 0 on top. A
    share `fewshot_share` of tenants prepend one of three worked-example blocks (100-400 tokens)
    chosen per session. Sessions start at `rate / mean_turns` per second with Gamma inter-arrivals
    of coefficient of variation `burstiness` (1 = Poisson); each has a geometric number of turns of
    mean `mean_turns`, `think_time_s` apart on average (exponential). Turn k's prompt is
    turn k-1's prompt + its answer + a new question: questions and answers have log-uniform lengths
    in `question_tokens` and `output_tokens`, and max_new_tokens is the answer's length.
    """
    check_positive_int("num_requests", num_requests)
    check_positive_int("num_tenants", num_tenants)
    for name, lengths in (("system_tokens", system_tokens), ("question_tokens", question_tokens),
                          ("output_tokens", output_tokens)):
        if not (isinstance(lengths, (tuple, list)) and len(lengths) == 2 and all(
                isinstance(n, int) and not isinstance(n, bool) for n in lengths) and 1 <= lengths[0] <= lengths[1]):
            raise ValueError(f"{name} must be a (low, high) pair of ints with 1 <= low <= high, got {lengths!r}.")
    if not 0 <= hot_tenant_share < 1 or not 0 <= fewshot_share <= 1:
        raise ValueError("hot_tenant_share must be in [0, 1) and fewshot_share in [0, 1].")
    for name, value, low, high, what in (   # finite ranges: no draw divides by zero, overflows or loops forever
            ("rate", rate, 1e-6, 1e9, "requests per second"),
            ("burstiness", burstiness, 1e-3, 1e3, "coefficient of variation of inter-arrivals; 1: Poisson"),
            ("mean_turns", mean_turns, 1, 1e3, "turns per session"), ("think_time_s", think_time_s, 0, 1e9, "seconds"),
            ("zipf_s", zipf_s, 0, 100, "exponent of the tenants' Zipf popularity")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ValueError(f"{name} must be a number in [{low:g}, {high:g}] ({what}), got {value!r}.")
    check_generated_memory(num_requests, num_tenants, system_tokens, question_tokens, output_tokens)
    rng = random.Random(seed)
    systems = [_tokens(rng, _log_uniform(rng, *system_tokens)) for _ in range(num_tenants)]
    examples = [[_tokens(rng, rng.randint(100, 400)) for _ in range(3)] if rng.random() < fewshot_share else []
                for _ in range(num_tenants)]
    weights = [1 / (k + 1) ** zipf_s for k in range(num_tenants)]
    shape = 1 / burstiness ** 2                      # Gamma(shape, scale): mean 1/rate, cv = burstiness
    session_rate = rate / mean_turns
    requests, start, sid = [], 0.0, 0
    while len(requests) < num_requests:
        start += rng.gammavariate(shape, 1 / (shape * session_rate))
        tenant = 0 if rng.random() < hot_tenant_share else rng.choices(range(num_tenants), weights)[0]
        parts = (systems[tenant],) + ((rng.choice(examples[tenant]),) if examples[tenant] else ())
        turns = 1
        while rng.random() > 1 / mean_turns:
            turns += 1
        t, previous = start, None
        for turn in range(turns):
            if previous is not None:
                previous.answer = _tokens(rng, previous.max_new_tokens)
                parts = previous.parts + (previous.answer,)
                t += rng.expovariate(1 / think_time_s) if think_time_s else 0.0
            parts = parts + (_tokens(rng, _log_uniform(rng, *question_tokens)),)
            previous = TraceRequest(f"s{sid}t{turn}", t, parts, _log_uniform(rng, *output_tokens),
                                    session=f"tenant{tenant}/s{sid}")
            requests.append(previous)
        sid += 1
    requests.sort(key=lambda r: r.arrival)
    return requests[:num_requests]


def tenant_of(req: TraceRequest) -> str | None:
    """The tenant a generated request belongs to (its session is 'tenantK/sN')."""
    return req.session.split("/")[0] if req.session and "/" in req.session else None


def unique_token_floor(requests) -> int:
    """The fewest prompt tokens any fleet of caches computes for the trace (chapter 6's floor,
    with the answers that later turns resend taken out).

    A prompt token's K and V come from a prefill, or from a cache that got them earlier: from an
    earlier prompt with the same prefix, or from the decode of an earlier request. A session's
    next turn resends the previous turn's answer (`TraceRequest.answer`), and the previous turn
    computed the K and V of all of it but its last token while decoding (the last is sampled and
    never fed back), so a replica that kept them computes none of those prompt tokens. The floor
    is therefore the distinct prompt prefixes (each computed at least once), less, for each
    request, the tokens of its answer (at most max_new_tokens - 1) that its session's next turn
    resends right after its prompt (`resent_answer`). Never above what a policy computes; exact
    when no two requests have equal prompts and answers (both would be taken out).

    Prompts are walked as a tree of shared parts (one node per distinct path of part objects);
    below each node the distinct prefixes of the next parts are counted with chapter 6's
    sorted-prefix method. Exact when sibling parts are never one the other's prefix, or when such
    siblings end their prompts (true of parsed traces, whose prompts are single parts, of generated
    ones, whose parts are random and long, and of Mooncake traces, whose blocks open with their
    own token id)."""
    root: dict[int, tuple] = {}       # id(part) -> (part, the children of the path ending with it)
    nodes = [root]
    previous: dict[str, TraceRequest] = {}   # session -> its latest turn so far
    resent = 0
    for req in requests:
        node = root
        for part in req.parts:
            entry = node.get(id(part))
            if entry is None:
                entry = node[id(part)] = (part, {})
                nodes.append(entry[1])
            node = entry[1]
        if req.session is not None:
            if req.session in previous:
                resent += resent_answer(previous[req.session], req)
            previous[req.session] = req
    distinct = sum(len(next(iter(node.values()))[0]) if len(node) == 1
                   else distinct_prefixes([part for part, _ in node.values()]) for node in nodes if node)
    return distinct - resent


def resent_answer(turn: TraceRequest, later: TraceRequest) -> int:
    """Tokens of `turn`'s answer whose K and V its decode computed (all but the last sampled token)
    and that `later` resends right after `turn`'s prompt."""
    fed_back = turn.answer[:turn.max_new_tokens - 1]
    if not fed_back:
        return 0
    k = len(turn.parts)
    if later.parts[:k] == turn.parts and later.parts[k:k + 1] == (turn.answer,):
        return len(fed_back)       # a generated trace: the answer is the next part, the same object
    n, ids = turn.num_prompt_tokens, later.prompt_ids
    if ids[:n] != turn.prompt_ids:
        return 0
    head = ids[n:n + len(fed_back)]
    return next((i for i, (a, b) in enumerate(zip(head, fed_back, strict=False)) if a != b), len(head))
