"""Chapter 4's way in for the pool's formats: `kv_cache_dtype` name -> `make(dtype, head_dim)`, the
row format a `KVPool` stores (`kvlearn.pool.Cast` says what a format has). `kvlearn.pool` adds
"auto" and "bfloat16"; `kvlearn/__init__` adds chapter 10's quantized formats (`kvlearn.quant`),
imported when a pool first asks for one. This module imports nothing.
"""

KV_CACHE_DTYPES: dict = {}


def register_kv_cache_dtype(name: str, make) -> None:
    """Let `KVPool(..., kv_cache_dtype=name)` store rows in the format `make(dtype, head_dim)` returns,
    dtype being the model's (the dtype K and V arrive in)."""
    if not callable(make):
        raise TypeError(f"A format maker must be callable (dtype, head_dim) -> format, got {type(make).__name__}.")
    KV_CACHE_DTYPES[name] = make
