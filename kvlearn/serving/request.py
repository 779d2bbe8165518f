"""Chapter 6: one request, as the scheduler and every KV manager see it.

A request IS a chapter-1 `Sequence` (its tokens are held once, and in "blocks" mode the block
manager fills its `block_table` directly), plus what serving adds: an id, a generation budget, where
it is in its life, and how many of its tokens already have KV.
"""

from __future__ import annotations

from kvlearn.sequence import Sequence

STATUSES = ("waiting", "running", "finished", "aborted")


class Request(Sequence):
    """One generation request. `token_ids` is the prompt followed by the generated tokens.

    num_computed: leading tokens whose KV is in the pool (the scheduler sets it from what admission
    found cached and after each forward); the newest generated token never has KV until the next
    step computes it. prefill_len: the tokens its prefill computes up to, set at admission (the
    prompt, plus the outputs so far after a preemption); while num_computed < prefill_len the
    prompt is still being computed, in chunks. kv: the KV manager's handle while the request holds KV (see
    `kvlearn.serving.kv_manager.KVHandle`), None otherwise. status: "waiting", "running", "finished",
or "aborted" (taken out by a step that failed; its output is cut short).
    """

    def __init__(self, rid: int, prompt_ids, max_new_tokens: int, page_size: int = 1):
        super().__init__(prompt_ids, block_size=page_size)
        self.rid = rid
        self.max_new_tokens = max_new_tokens
        self.status = "waiting"
        self.num_computed = self.prefill_len = 0
        self.kv = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def max_tokens(self) -> int:
        """Most tokens this request ever holds KV for: its last token never needs any."""
        return self.num_prompt_tokens + self.max_new_tokens - 1

    @property
    def done(self) -> bool:
        """Whether its budget is spent (the scheduler also finishes it at an end-of-sequence token)."""
        return len(self.token_ids) - self.num_prompt_tokens >= self.max_new_tokens

    def __repr__(self) -> str:
        return (f"Request(r{self.rid}, {self.status}, {self.num_prompt_tokens} prompt + "
                f"{len(self.output_ids)} output tokens, {self.num_computed} with KV)")

    @property
    def prefilling(self) -> bool:
        """True while part of the prompt has no KV yet (a prefill in chunks)."""
        return self.num_computed < self.prefill_len
