"""Mooncake traces: real production traffic as prompt-block ids (FAST'25 release, and its kin).

The format (kvcache-ai/Mooncake, `FAST25-release/traces/`; NVIDIA AIPerf's `mooncake_trace`;
LiteLLM's `prefix_block_hashes` records) is JSON Lines, one request per line:
`timestamp` (arrival, ms), `input_length` and `output_length` (tokens), `hash_ids` (one id per
`block_size`-token block of the prompt, 512 unless told, at most MAX_BLOCK_SIZE; an id names its
block *and every block before it*, so equal ids mean an equal prefix up to that block). Ids are
ints (Mooncake) or strings (LiteLLM's 16-hex-character HMAC chains). A file is recognised by its
fields (`is_mooncake`), gzipped or not (by its magic bytes, not its name); other fields are ignored.

`read_mooncake` checks every line before returning anything and reports all bad lines at once,
each with its number: not UTF-8, not JSON, a missing or ill-typed field, `len(hash_ids)` other
than `ceil(input_length / block_size)` (the last block may be partial), or an id that another
line puts after a different id (ids are prefix hashes: an id has one predecessor).

Ids are renumbered densely in order of first appearance (`MooncakeRequest.blocks`). For the
token-level structures (`trace_requests`, what `read_trace` and `route` use), block `b` becomes
a page of `block_size` token ids: first `FIRST_TOKEN_ID + 1 + b`, its own, then `FIRST_TOKEN_ID`
repeated (the same filler in every page), and a prompt is its blocks' pages with the last one cut
to `input_length`. Every kvlearn cache matches prefixes, and two prompts' token ids part exactly at
the first token of the first block where their ids differ, so every cache sees exactly the trace's
prefix sharing. The filler costs nothing per block: a prompt's parts are its blocks' one-token
heads and one shared tuple of fillers (145 M prompt tokens of the conversation trace in a few MB). A
request keeps its arrival (s) and output length (`max_new_tokens`, at least 1). The bundled traces:
`mooncake_trace_path(name)`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvlearn.errors import check_positive_int
from kvlearn.routing.jsonlines import bad_lines, json_lines, raw_lines
from kvlearn.routing.trace_request import FIRST_TOKEN_ID, TraceError, TraceRequest

BLOCK_SIZE = 512                # tokens per hash id in the Mooncake release
MAX_BLOCK_SIZE = 2**20          # tokens per hash id, at most: more than any model's context
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
DATA = Path(__file__).parent / "data" / "mooncake"
BUNDLED = {"conversation": "conversation_trace.jsonl.gz", "synthetic": "synthetic_trace.jsonl.gz"}


@dataclass(frozen=True, eq=False)
class MooncakeRequest:
    """One line: `arrival` in seconds, `blocks` the dense ids of its prompt's blocks (the last
    one holds `input_length - (len(blocks) - 1) * block_size` tokens), `line` in the file."""

    line: int
    arrival: float
    input_length: int
    output_length: int
    blocks: tuple[int, ...]


@dataclass(eq=False)
class MooncakeTrace:
    """A checked trace: `requests` sorted by arrival (equal arrivals keep file order),
    `num_blocks` distinct hash ids, `block_size` tokens per id."""

    path: Path
    block_size: int
    requests: list[MooncakeRequest]
    num_blocks: int

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def __repr__(self) -> str:
        return (f"MooncakeTrace({self.path.name}, {len(self):,} requests, {self.prompt_tokens:,} prompt tokens, "
                f"{self.num_blocks:,} blocks of {self.block_size})")

    def trace_requests(self) -> list[TraceRequest]:
        """The requests as chapter 7's `TraceRequest`s (see the module docstring): block `b` is the
        parts `(FIRST_TOKEN_ID + 1 + b,)` and `block_size - 1` fillers, each built once and shared
        by every prompt holding it."""
        size = self.block_size
        fill = (FIRST_TOKEN_ID,) * (size - 1)
        heads = [(FIRST_TOKEN_ID + 1 + b,) for b in range(self.num_blocks)]
        out = []
        for r in self.requests:
            parts = [p for b in r.blocks for p in (heads[b], fill)]
            tail = r.input_length - (len(r.blocks) - 1) * size - 1   # fillers of the last, maybe partial, block
            parts[-1] = fill[:tail]
            out.append(TraceRequest(f"line{r.line}", r.arrival, tuple(p for p in parts if p),
                                    max(r.output_length, 1), line=r.line))
        return out


def mooncake_trace_path(name: str) -> Path:
    """The bundled trace `name` ("conversation" or "synthetic"; see data/mooncake/README.md)."""
    if name not in BUNDLED:
        raise ValueError(f"No bundled Mooncake trace {name!r}; bundled: {', '.join(BUNDLED)}.")
    return DATA / BUNDLED[name]


def is_mooncake(path) -> bool:
    """Whether the first non-empty line of `path` is a JSON object with a `hash_ids` field (a file
    that cannot be read or parsed is not: the JSON Lines reader then says why, line by line)."""
    for _, raw in raw_lines(Path(path), []):
        try:
            row = json.loads(raw)
        except (ValueError, RecursionError):  # not UTF-8 or not JSON, or nested too deeply
            return False
        return isinstance(row, dict) and "hash_ids" in row
    return False


def _check_row(row, block_size: int) -> str | None:
    """What is wrong with one parsed line on its own, or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    missing = [name for name in FIELDS if name not in row]
    if missing:
        return f"missing field(s) {', '.join(map(repr, missing))}; a Mooncake line has {', '.join(FIELDS)}"
    t = row["timestamp"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        return f"'timestamp' must be a number of milliseconds >= 0, got {t!r}"
    for name, low in (("input_length", 1), ("output_length", 0)):
        n = row[name]
        if isinstance(n, bool) or not isinstance(n, int) or n < low:
            return f"{name!r} must be an int >= {low}, got {n!r}"
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not ids:
        return "'hash_ids' must be a non-empty list of block ids"
    bad = next((h for h in ids if not (isinstance(h, str) and h) and
                (isinstance(h, bool) or not isinstance(h, int) or h < 0)), None)
    if bad is not None:
        return f"'hash_ids' must hold ints >= 0 or non-empty strings, found {bad!r}"
    need = -(-row["input_length"] // block_size)
    if len(ids) != need:
        return (f"{len(ids)} hash id(s) for input_length {row['input_length']}, which needs {need} block(s) of "
                f"{block_size} tokens (is the block size {block_size}? --block-size sets it)")
    return None


def _check_prefixes(ids: list, number: int, before: dict) -> str | None:
    """Whether every id of line `number` follows the id that it follows elsewhere (`before`:
    id -> (the id before it, first line)); records the line's ids in `before` only if so."""
    mine, previous = {}, None
    for h in ids:
        seen = before.get(h) or mine.setdefault(h, (previous, number))
        if seen[0] != previous:
            where = "earlier on this line" if seen[1] == number else f"on line {seen[1]}"
            return f"hash id {h!r} follows {previous!r} here but {seen[0]!r} {where}: an id names a whole prefix"
        previous = h
    before.update(mine)
    return None


def read_mooncake(path, block_size: int = BLOCK_SIZE, max_errors: int = 20) -> MooncakeTrace:
    """Read and check a Mooncake trace (see the module docstring), plain or gzipped.

    Raises TraceError listing every bad line (up to `max_errors`) before returning anything."""
    check_positive_int("block_size", block_size, " (tokens per hash id)")
    if block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE:,} tokens per hash id (the Mooncake release's "
                         f"is {BLOCK_SIZE}), got {block_size:,}.")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No trace file at {path}: give a Mooncake JSON Lines file, gzipped or not.")
    dense: dict = {}              # hash id -> dense block id
    before: dict = {}             # hash id -> (the id before it, line where seen first)
    requests, errors = [], []
    for number, row in json_lines(path, errors):
        problem = _check_row(row, block_size)
        if problem is None:
            problem = _check_prefixes(row["hash_ids"], number, before)
        if problem is not None:
            errors.append(f"{path}:{number}: {problem}")
            continue
        blocks = tuple(dense.setdefault(h, len(dense)) for h in row["hash_ids"])
        requests.append(MooncakeRequest(number, row["timestamp"] / 1000, row["input_length"], row["output_length"],
                                        blocks))
    if errors:
        raise TraceError(bad_lines(errors, max_errors, "the Mooncake trace; nothing was read"))
    if not requests:
        raise TraceError(f"{path} holds no requests: write one JSON object per line.")
    requests.sort(key=lambda r: r.arrival)
    return MooncakeTrace(path, block_size, requests, len(dense))
