"""The types every trace reader produces: `TraceRequest` (one request of a trace) and `TraceError`
(a trace file with bad lines), and the token-id space of generated and replayed prompts.

`kvlearn.routing.traces` (JSON Lines traces, the generator) and `kvlearn.routing.mooncake`
(Mooncake traces) both build on this module; it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

VOCAB_SIZE = 49152      # SmolLM2's vocabulary: generated token ids are valid for the real model
FIRST_TOKEN_ID = 3      # generated ids skip SmolLM2's special tokens 0-2 (end of text, <|im_start|>, <|im_end|>)


class TraceError(ValueError):
    """A trace file has bad lines; the message lists each one with its line number."""


@dataclass(eq=False)
class TraceRequest:
    """One request of a trace. `parts` joined are the prompt's token ids; `answer` is what the
    request answered, as far as the trace knows it (the head of its session's next turn), so a
    simulated replica caches the same tokens a real one did; `line` is its line in the file."""

    id: str
    arrival: float
    parts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    session: str | None = None
    answer: tuple[int, ...] = ()
    line: int | None = None
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self):
        self.num_prompt_tokens = sum(map(len, self.parts))

    @property
    def prompt_ids(self) -> list[int]:
        return list(chain.from_iterable(self.parts))

    @property
    def where(self) -> str:
        """How error messages name this request."""
        return f"request {self.id!r}" + (f" (line {self.line})" if self.line is not None else "")

    def to_json(self) -> dict:
        row = {"id": self.id, "arrival": round(self.arrival, 6), "prompt_ids": self.prompt_ids,
               "max_new_tokens": self.max_new_tokens}
        if self.session is not None:
            row["session"] = self.session
        return row

    def __repr__(self) -> str:
        session = f", session={self.session!r}" if self.session else ""
        return (f"TraceRequest({self.id!r}, t={self.arrival:.3f}s, {self.num_prompt_tokens} prompt tokens, "
                f"max_new_tokens={self.max_new_tokens}{session})")
