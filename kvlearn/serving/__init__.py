"""Chapter 6: the serving engine, made of the pieces of chapters 1-5.

config        EngineConfig: every option of the engine, documented and checked once
part_registry the parts a learner writes (kvlearn.parts), one record each, and what serves in their place
hooks         the ways in for what chapter 6 never imports: later chapters' KV managers, the parts' guards
kv_manager    the contract every cache mode implements, and the pool bookkeeping they share
cache_modes   the three cache modes: none, blocks (chapter 2), radix (chapter 3)
request       one request: a chapter-1 Sequence with a generation budget and a status
scheduler     continuous batching: which requests run in the next step
engine        the scheduler, the KV pool (chapter 4) and the model runner (chapter 5) together
simulate      the scheduler without the model (SimEngine, the one model-free driver of chapters 6-8)
fast_forward  many plain decode steps at once: SimEngine's shortcut, never the engine's path
prefixes      the common prefix of two prompts, and the distinct prefixes of many (the unique-token floor)
workloads     traffic patterns from real use, with their unique-token floors
"""
