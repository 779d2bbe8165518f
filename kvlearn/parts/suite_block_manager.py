"""The conformance suite of the `block_manager` part (chapters 1-2), judged by `BlockReference`.

A program is a block size, a pool of blocks (the part gets a fresh `PageAllocator` of them, as the
engine hands it the pool's) and random operations over a 3-token alphabet (so prompts share
blocks): allocate (often a prompt that extends an earlier one), compute (`hash_blocks` up to some
token), append a token (and may_append, or preempt when there is no room), deallocate, misuse of a
deallocated sequence, `slot_mapping`, `evict_cached`. After every call the part's blocks, counts
(the prefix-cache counters in `stats` too), tables and free blocks must be the reference's, the
free blocks in the order they will be handed out; `hash_blocks` must return how many blocks it hashed;
a deallocated sequence has an empty table and `num_cached_tokens` 0.
About one program in three builds the part with `hash_fn=colliding_hash`, a chained hash that
collides on purpose, so that the collision guard is tested (the reference publishes by that hash).

With `caching=False` (chapter 1's `block_table` suite, `suite_block_table`) the part is built with
`enable_prefix_caching=False`, judged by the reference with prefix caching off, and asked only what
`BlockTablePart` lists: no lookup, no hash_blocks, no evict_cached, no cache counters.
"""

from __future__ import annotations

import random
from operator import attrgetter

from kvlearn.allocator import PageAllocator
from kvlearn.errors import KVCapacityError
from kvlearn.parts.block_manager import BlockManagerPart
from kvlearn.parts.judge import Broken, Trace, ints, number, same
from kvlearn.parts.references import BlockReference
from kvlearn.sequence import Sequence

CONTRACT = BlockManagerPart

HINTS = {
    "collision": "a hit needs the block's own tokens to equal the sequence's block: equal hashes with other "
                 "tokens are a collision, a miss that ends the walk (chapter 2, section 8: the collision guard, "
                 "self.blocks[block_id].token_ids != tokens). This program builds the part with "
                 "hash_fn=colliding_hash, which collides on purpose.",
    "hit": "allocate walks the sequence's full blocks, chaining each block's hash with the one before it, and "
           "shares every published block it finds, up to the first miss; never the block that holds the last "
           "token (the full-hit rule: at most (num_tokens - 1) // block_size blocks). num_cached_prefix and "
           "can_allocate ask the same question without changing anything (chapter 2).",
    "table": "allocate gives the sequence one block per logical block: the shared (hit) blocks first, then new "
             "ones; seq.num_cached_tokens = hit blocks * block_size (chapter 1).",
    "take": "new blocks come from the allocator's free pages first (allocator.alloc); only when it has none left "
            "is a cached block reused, least recently freed first, and it forgets the hash it published "
            "(chapter 2: BlockManagerBase.evict_one).",
    "share": "allocate takes its hits first: each leaves cached_blocks and gains a holder before new_blocks runs, "
             "so eviction never hands out a block the sequence shares (chapter 2).",
    "refs": "a block's ref_count is the number of live block tables that hold it: +1 for each block allocate "
            "or may_append gives a sequence, -1 for each block of a sequence deallocate releases.",
    "free": "when its last user leaves, a block stays cached (still hittable, at the back of the LRU list) only "
            "if it is the published copy of its prefix; any other block goes back to the allocator "
            "(allocator.free). num_free_blocks counts both: the allocator's free pages and cached blocks.",
    "order": "deallocate walks the table from its last block, but gives the blocks it does not keep cached back "
             "to the allocator in table order, in one allocator.free call (the released list reversed): the "
             "table's first block is then handed out first (chapter 1: back to the free list, in table order).",
    "walk": "deallocate walks the table from its last block to its first: each published block nobody holds goes "
            "to the end of cached_blocks in that order, so the head of a prefix is evicted last (chapter 2).",
    "duplicate": "one copy per prefix: the first block hash_blocks publishes for a prefix stays its published copy "
                 "(hash_to_block_id.setdefault: a later copy never replaces it), and only the published copy stays "
                 "cached when its last user leaves; a copy goes back to the allocator (chapter 2).",
    "publish": "hash_blocks(seq, n) publishes the full blocks among the first n tokens, once their KV is computed "
               "(never allocate): each block without a hash gets its chained hash (block i - 1's hash with its "
               "tokens) and its token_ids, and hash_to_block_id gets that hash unless it already points at another "
               "block (one copy per prefix). A copy keeps its hash all the same, so it is never hashed again.",
    "count": "hash_blocks returns how many blocks got a hash in this call: the full blocks among the first n tokens "
             "that had none before (published or copies; a hit or a block hashed earlier counts nothing).",
    "stats": "allocate counts each sequence it gives a table in stats (self.count_hits(seq), once "
             "seq.num_cached_tokens is set): queries + 1, query_tokens + its tokens, hit_blocks + its hits, "
             "hit_tokens + its cached tokens; a refused allocate, num_cached_prefix and can_allocate count nothing.",
    "append": "may_append gives the sequence a new block when its newest token starts one (the table has a "
              "block per logical block again); can_append says whether that needs a block nobody has.",
    "capacity": "allocate and may_append raise kvlearn.KVCapacityError when too few blocks are free, before "
                "changing anything (can_allocate / can_append tell in advance).",
    "misuse": "deallocate, may_append, can_append, slot_mapping and hash_blocks raise ValueError for a sequence "
              "that is not allocated (never, or already deallocated), allocate for one that is, and they change "
              "nothing (BlockManagerBase.check_live, check_new); deallocate empties seq.block_table.",
    "reset": "deallocate sets seq.num_cached_tokens back to 0, as it empties seq.block_table: the sequence holds "
             "no block, so none of its tokens is cached (a preempted sequence allocated again counts its hits "
             "anew; chapter 2).",
    "slots": "slot_mapping(seq, start, end): token position p lives in slot "
             "block_table[p // block_size] * block_size + p % block_size (chapter 1).",
    "evict_cached": "evict_cached forgets every cached block nobody uses, gives them back to the allocator and "
                    "returns their tokens (blocks * block_size); stats.evicted_blocks counts them, as it counts "
                    "each cached block reused for new KV.",
}


def generate(rng: random.Random, caching: bool = True) -> tuple[dict, list[tuple]]:
    setup = {"block_size": rng.choice([1, 2, 2, 3, 4]), "num_blocks": rng.randint(1, 10)}
    kinds = ["allocate", "allocate", "allocate", "compute", "compute", "append", "append", "deallocate",
             "misuse", "allocate_again", "slot_mapping", "evict_cached"]
    if not caching:   # nothing to publish or evict
        kinds = [k for k in kinds if k not in ("compute", "evict_cached")]
    ops = []
    for _ in range(rng.randint(1, 30)):
        ops.append((rng.choice(kinds), rng.randrange(1 << 30)))
        if caching and ops[-1][0] == "allocate" and rng.random() < 0.7:
            # often a prompt is computed at once, so later prompts hit it while the pool runs dry
            ops.append(("compute", rng.randrange(1 << 30)))
    # One program in three hashes with colliding_hash; decided by a number drawn already, so that the
    # other programs are the ones drawn before the collision programs came in.
    setup["colliding_hash"] = caching and ops[0][1] % 3 == 0
    return setup, ops


def colliding_hash(parent_hash: int | None, token_ids: list[int]) -> int:
    """A chained hash that collides on purpose: a block's hash is 3 * its parent's hash (0 for none)
    + 1 + the parity of its tokens' sum, so blocks after one parent whose sums have one parity
    collide ([0, 1] and [1, 0], [0] and [2]); blocks after different parents never do."""
    return 3 * (parent_hash or 0) + 1 + sum(token_ids) % 2


# Said in a program built with colliding_hash, after the hints of the rules a hash decides.
COLLIDING = (" (This program builds the part with hash_fn=colliding_hash, which collides on purpose: hash with "
             "self.hash_fn, the part's own, and publish by that hash.)")


def run(impl, setup: dict, ops: list[tuple], trace: Trace, caching: bool = True, hints: dict = HINTS) -> None:
    """Run one program on a fresh part; `Broken` (with one of `hints`) at the first call the
    reference disagrees with."""
    bs, n_blocks = setup["block_size"], setup["num_blocks"]
    colliding = setup.get("colliding_hash", False)
    ref = BlockReference(n_blocks, bs, caching, hash_fn=colliding_hash if colliding else None)
    allocator = PageAllocator(n_blocks, device="cpu")
    trace.note(f"allocator = PageAllocator({n_blocks})")
    if colliding:
        trace.note("from kvlearn.parts.suite_block_manager import colliding_hash   # collides on purpose")
        hints = hints | {key: hints[key] + COLLIDING for key in ("hit", "duplicate", "publish", "free")}
        m = trace.call(f"m = {impl.__name__}({n_blocks}, {bs}, enable_prefix_caching=True, allocator=allocator, "
                       "hash_fn=colliding_hash)", impl, n_blocks, bs, enable_prefix_caching=True,
                       allocator=allocator, hash_fn=colliding_hash)
    else:
        m = trace.call(f"m = {impl.__name__}({n_blocks}, {bs}, enable_prefix_caching={caching}, "
                       "allocator=allocator)", impl, n_blocks, bs, enable_prefix_caching=caching, allocator=allocator)
    # After a refused call, whatever changed is the refusal's fault: the capacity rule is the hint.
    refused = hints | {key: hints["capacity"] for key in ("refs", "free", "order", "walk", "table") if key in hints}
    live: list[list] = []   # [sequence, its name, tokens computed]
    dead: list[list] = []
    prompts: list[list[int]] = []
    names = iter(range(1, 1 << 30))

    def release(entry):
        s, name, _ = entry
        trace.call(f"m.deallocate({name})", m.deallocate, s)
        ref.release(s.seq_id)
        live.remove(entry)
        dead.append(entry)
        prompts.append(list(s.token_ids))
        same(f"{name}.block_table after deallocate", [], list(s.block_table), hints["misuse"])
        same(f"{name}.num_cached_tokens after deallocate", 0, s.num_cached_tokens, hints["reset"])

    for trace.op, (op, r) in enumerate(ops):
        rng = random.Random(r)
        if op == "allocate":
            tokens = [rng.randint(0, 2) for _ in range(rng.randint(0, 8))]
            if prompts and rng.random() < 0.6:
                base = rng.choice(prompts)
                tokens = base[:rng.choice([len(base), rng.randint(0, len(base))])] + tokens   # often a next turn
            tokens = tokens or [0]
            s, name = Sequence(tokens, block_size=bs), f"s{next(names)}"
            trace.note(f"{name} = Sequence({tokens}, block_size={bs})")
            hit = ref.hit(tokens)   # none without prefix caching
            fits = ref.blocks_needed(len(tokens), hit) <= ref.num_free
            if caching:
                got = number("num_cached_prefix", trace.call(f"m.num_cached_prefix({name})", m.num_cached_prefix, s))
                trace.answer(str(got))
                rule = "collision" if ref.collided and got > len(hit) * bs else \
                    "duplicate" if ref.copied(tokens) else "hit"
                same(f"m.num_cached_prefix({name})", len(hit) * bs, got, hints[rule])
            got = trace.call(f"m.can_allocate({name})", m.can_allocate, s)
            trace.answer(str(got))
            same(f"m.can_allocate({name})", fits, got, hints["capacity"])
            if not fits:
                trace.refused(f"m.allocate({name})", (KVCapacityError,), m.allocate, s, hint=hints["capacity"])
                check_state(m, ref, allocator, live, trace, caching, refused)
            else:
                trace.call(f"m.allocate({name})", m.allocate, s)
                table = list(s.block_table)
                trace.answer(f"block_table {table}, num_cached_tokens {s.num_cached_tokens}")
                same(f"{name}.num_cached_tokens", len(hit) * bs, s.num_cached_tokens,
                     hints["hit" if caching else "table"])
                if caching:   # a copy of a prefix in place of its published block breaks the one-copy rule
                    # (the table's first blocks against the hit: a wrong table may be shorter, or longer)
                    copies = [g for g, b in zip(table, hit, strict=False) if g != b and ref.same_key(g, b)]
                    same(f"{name}.block_table[:{len(hit)}] (the shared blocks)", hit, table[:len(hit)],
                         hints["duplicate" if copies else "hit"])
                same(f"len({name}.block_table)", s.num_blocks, len(table), hints["table"])
                problem = ref.allocate(s.seq_id, hit, table[len(hit):], s.num_tokens)
                if problem:
                    raise Broken(f"m.allocate({name}): {problem[1]}", hints[problem[0]])
                live.append([s, name, len(hit) * bs if caching else s.num_tokens])   # nothing to publish
        elif op == "compute" and live:
            entry = rng.choice(live)
            s, name, done = entry
            upto = rng.randint(done, min(s.num_tokens, len(s.block_table) * bs))
            args = (s,) if upto == s.num_tokens and rng.random() < 0.5 else (s, upto)
            line = f"m.hash_blocks({name}{'' if len(args) == 1 else f', {upto}'})"
            # blocks the reference hashes now that the part hashed before their KV was computed
            early = [b for b in s.block_table[:upto // bs] if b not in ref.hashed and m.blocks[b].hash is not None]
            got = number("hash_blocks' answer", trace.call(line, m.hash_blocks, *args))
            trace.answer(str(got))
            same(line, ref.publish(s.seq_id, s.token_ids, upto), got, hints["publish" if early else "count"])
            entry[2] = upto
        elif op == "append" and any(done == s.num_tokens for s, _, done in live):
            entry = rng.choice([e for e in live if e[2] == e[0].num_tokens])
            s, name, _ = entry
            token = rng.randint(0, 2)
            trace.note(f"{name}.append_token({token})")
            s.append_token(token)
            need = s.num_blocks - len(ref.tables[s.seq_id])
            got = trace.call(f"m.can_append({name})", m.can_append, s)
            trace.answer(str(got))
            same(f"m.can_append({name})", need <= ref.num_free, got, hints["append"])
            if need > ref.num_free:
                trace.refused(f"m.may_append({name})", (KVCapacityError,), m.may_append, s, hint=hints["capacity"])
                check_state(m, ref, allocator, live, trace, caching, refused)
                release(entry)   # preempted
            else:
                old = list(ref.tables[s.seq_id])
                trace.call(f"m.may_append({name})", m.may_append, s)
                table = list(s.block_table)
                trace.answer(f"block_table {table}")
                same(f"{name}.block_table[:{len(old)}] (unchanged by may_append)", old, table[:len(old)],
                     hints["append"])
                same(f"len({name}.block_table)", s.num_blocks, len(table), hints["append"])
                problem = ref.append(s.seq_id, table)
                if problem:
                    raise Broken(f"m.may_append({name}): {problem[1]}", hints[problem[0]])
        elif op == "deallocate" and live:
            release(rng.choice(live))
        elif op == "allocate_again" and live:
            s, name, _ = rng.choice(live)
            trace.refused(f"m.allocate({name})   # already allocated", (ValueError,), m.allocate, s,
                          hint=hints["misuse"])
        elif op == "misuse" and dead:
            s, name, _ = rng.choice(dead)
            call = rng.choice(["deallocate", "may_append", "can_append", "slot_mapping"]
                              + (["hash_blocks"] if caching else []))
            args = (s, 0, 0) if call == "slot_mapping" else (s,)
            trace.refused(f"m.{call}({', '.join([name] + ['0'] * (len(args) - 1))})   # deallocated", (ValueError,),
                          getattr(m, call), *args, hint=hints["misuse"])
        elif op == "slot_mapping" and live:
            s, name, _ = rng.choice(live)
            covered = min(s.num_tokens, len(s.block_table) * bs)
            start = rng.randint(0, covered)
            end = rng.randint(start, covered)
            got = ints("slot_mapping's answer", trace.call(f"m.slot_mapping({name}, {start}, {end})",
                                                           m.slot_mapping, s, start, end))
            trace.answer(str(got))
            expect = [s.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            same(f"m.slot_mapping({name}, {start}, {end})", expect, got, hints["slots"])
        elif op == "evict_cached":
            got = number("evict_cached's answer", trace.call("m.evict_cached()", m.evict_cached))
            trace.answer(str(got))
            same("m.evict_cached()", ref.evict_cached(), got, hints["evict_cached"])
        else:
            continue
        check_state(m, ref, allocator, live, trace, caching, hints)


def check_state(m, ref: BlockReference, allocator: PageAllocator, live: list[list], trace: Trace,
                caching: bool = True, hints: dict = HINTS) -> None:
    """Every block's ref_count, the free blocks (which, then in what order) and, with caching, the
    cached ones and the counters, and the live tables, against the reference."""
    def ask(what: str):
        return trace.call(f"m.{what}", attrgetter(what), m, quiet=True)

    refs = ref.refs()
    blocks = ask("blocks")
    got = [(b.block_id, b.ref_count) for b in blocks]
    same("[(b.block_id, b.ref_count) for b in m.blocks]", [(b, refs[b]) for b in range(ref.num_blocks)], got,
         hints["refs"])
    for s, name, _ in live:
        same(f"{name}.block_table", ref.tables[s.seq_id], list(s.block_table), hints["table"])
    same("m.num_free_blocks", ref.num_free, number("num_free_blocks", ask("num_free_blocks")), hints["free"])
    pages = allocator.free_pages
    what = "the allocator's free pages (the part must take new blocks from the allocator it was given)"
    same(f"{what}, sorted", sorted(ref.free), sorted(pages), hints["free"])
    same(f"{what}, in the order they are handed out", ref.free, pages, hints["order"])
    if caching:
        same("m.num_cached_free_blocks", len(ref.cached),
             number("num_cached_free_blocks", ask("num_cached_free_blocks")), hints["free"])
    same("the blocks m.is_cached says are cached", sorted(ref.cached),
         [b for b in range(ref.num_blocks) if trace.call(f"m.is_cached({b})", m.is_cached, b, quiet=True)],
         hints["free"])
    ids = list(ask("free_block_ids"))
    same("sorted(m.free_block_ids)", sorted(ref.free + list(ref.cached)), sorted(ids), hints["free"])
    same("m.free_block_ids (the order they are handed out)", ref.free + list(ref.cached), ids,
         hints["walk" if caching else "order"])
    if caching:
        stats = ask("stats")
        same("m.stats (queries, query_tokens, hit_blocks, hit_tokens)", ref.counters,
             (stats.queries, stats.query_tokens, stats.hit_blocks, stats.hit_tokens), hints["stats"])
        same("m.stats.evicted_blocks", ref.evicted_blocks, stats.evicted_blocks, hints["take"])

