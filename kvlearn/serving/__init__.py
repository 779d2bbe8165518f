"""Chapter 6: the serving engine, made of the pieces of chapters 1-5.

config       EngineConfig: every option of the engine, documented and checked once
part_registry the parts a learner writes (kvlearn.parts), one record each: every list of parts reads it
kv_manager   the contract every cache mode implements, and the pool bookkeeping they share
cache_modes  the three cache modes: none, blocks (chapter 2), radix (chapter 3)
guard        trust but verify: a learner's part (kvlearn.parts) serves behind a guard that checks its answers
kv_factories the way in for a later chapter's KV manager (chapter 8's tiers register theirs)
request      one request: a chapter-1 Sequence with a generation budget and a status
scheduler    continuous batching: which requests run in the next step
engine       the scheduler, the KV pool (chapter 4) and the model runner (chapter 5) together
simulate     the scheduler without the model (SimEngine, the one model-free driver of chapters 6-8)
fast_forward many plain decode steps at once: SimEngine's shortcut, never the engine's path
prefixes     the common prefix of two prompts, and the distinct prefixes of many (the unique-token floor)
workloads    traffic patterns from real use, with their unique-token floors
"""
