"""kvlearn: the KV-cache layer of an LLM inference engine, built chapter by chapter.

Names are imported lazily so that `import kvlearn` stays fast and does not pull in transformers
until a chapter needs the model.
"""

from importlib import import_module

_EXPORTS = {
    "load_model": "model",
    "load_tokenizer": "model",
    "model_path": "model",
    "chat_ids": "model",
    "KVCapacityError": "errors",
    "Sequence": "sequence",
    "Block": "blocks",
    "BlockManager": "blocks",
    "RadixCache": "radix",
    "MatchResult": "radix",
    "TreeNode": "radix",
    "KVPool": "pool",
    "ModelRunner": "runner",
    "Engine": "serving.engine",
    "EngineConfig": "serving.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name == "parts":   # kvlearn.parts: the learner's parts and their checks
        return import_module("kvlearn.parts")
    if name in _EXPORTS:
        return getattr(import_module(f"kvlearn.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kvlearn' has no attribute {name!r}")
