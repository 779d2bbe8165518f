"""kvlearn: the KV-cache layer of an LLM inference engine, built chapter by chapter.

Names are imported lazily so that `import kvlearn` stays fast and does not pull in transformers
until a chapter needs the model. Chapter 10's quantized KV formats reach the pool through chapter 4's
`kvlearn.formats`, and chapter 8's tiers, the guards of a learner's parts (kvlearn.parts) and
chapter 10's part, the quantizer, reach the engine through chapter 6's hooks (`kvlearn.serving.hooks`),
filled here; each is imported when first asked for (an engine built; a learner's part given; the
registry of parts read), not before.
"""

from importlib import import_module

from kvlearn.formats import register_kv_cache_dtype
from kvlearn.serving.hooks import register_kv_factory, register_part_guards, register_part_records

_EXPORTS = {
    "load_model": "model",
    "load_tokenizer": "model",
    "model_path": "model_store",
    "chat_ids": "model",
    "KVCapacityError": "errors",
    "PartError": "errors",
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


def _tiered_kv(options, pool, model):
    """Chapter 8's tiered radix mode when the engine's options ask for host or disk tiers, else None."""
    from kvlearn.tiers.manager import make_tiered_kv

    return make_tiered_kv(options, pool, model)


def _part_guards() -> dict:
    """kvlearn.parts' guards, by part name."""
    from kvlearn.parts.guard import GUARDS

    return GUARDS


def _quantized(name: str):
    """Chapter 10's format `name` (kvlearn.quant), imported when a pool first asks for it."""
    def make(dtype, head_dim):
        from kvlearn.quant import FORMATS

        return FORMATS[name](dtype, head_dim)
    return make


def _kivi(dtype, head_dim):
    """Chapter 10's kv_cache_dtype "int4" (kvlearn.kivi), imported when a pool first asks for it."""
    from kvlearn.kivi import KiviFormat

    return KiviFormat(dtype, head_dim)


def _chapter_10_parts() -> list:
    """Chapter 10's part: the int8 format's quantize and dequantize (kvlearn.parts.QuantizerPart)."""
    from kvlearn.quant import Int8Format
    from kvlearn.serving.cache_modes import CACHE_MODES
    from kvlearn.serving.part_registry import PartRecord

    return [PartRecord("quantizer", (10,), "MyQuantizer", CACHE_MODES, Int8Format)]


for _name in ("fp8_e4m3", "int8"):   # kvlearn.quant.FORMATS
    register_kv_cache_dtype(_name, _quantized(_name))
register_kv_cache_dtype("int4", _kivi)
register_kv_factory(_tiered_kv)
register_part_guards(_part_guards)
register_part_records(_chapter_10_parts)


def __getattr__(name):
    if name == "parts":   # kvlearn.parts: the learner's parts and their checks
        return import_module("kvlearn.parts")
    if name in _EXPORTS:
        return getattr(import_module(f"kvlearn.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kvlearn' has no attribute {name!r}")
