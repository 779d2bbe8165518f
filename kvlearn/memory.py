"""How many bytes of K and V one token costs, and how many tokens fit in a memory budget.

Every layer keeps, for every token, one key and one value vector per KV head:

    MHA / GQA:  bytes_per_token = 2 (K and V) * num_layers * num_kv_heads * head_dim * dtype_bytes
    MLA:        bytes_per_token = num_layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes

MHA has as many KV heads as query heads; GQA lets several query heads share one KV head; MLA
(DeepSeek) caches one compressed latent vector per token and layer, plus a small decoupled RoPE key,
and rebuilds K and V from the latent inside attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlearn.errors import check_int, check_positive_int

GiB = 1 << 30


@dataclass(frozen=True)
class KVConfig:
    """The few numbers of a model config that decide the size of its KV cache."""

    name: str
    attention: str  # "MHA", "GQA" or "MLA"
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # K/V heads (MLA: not used, it caches a latent instead)
    head_dim: int
    kv_lora_rank: int = 0  # MLA: width of the cached latent
    qk_rope_head_dim: int = 0  # MLA: width of the cached RoPE key
    v_head_dim: int = 0  # when V heads are narrower than K heads (DeepSeek); 0 means head_dim
    source: str = ""

    def __post_init__(self):
        if self.attention not in ("MHA", "GQA", "MLA"):
            raise ValueError(f"attention must be 'MHA', 'GQA' or 'MLA', got {self.attention!r}.")
        sizes = {"num_layers": self.num_layers, "num_heads": self.num_heads,
                 "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
        if self.attention == "MLA":
            sizes.update(kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)
        for field, value in sizes.items():
            check_positive_int(f"{self.name}: {field}", value)
        if self.attention != "MLA" and self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads}).")

    @classmethod
    def from_hf(cls, config, name: str | None = None) -> KVConfig:
        """Read a transformers config (Llama-like GQA/MHA, or DeepSeek-like MLA)."""
        name = name or getattr(config, "name_or_path", "") or type(config).__name__
        layers, heads = config.num_hidden_layers, config.num_attention_heads
        if getattr(config, "kv_lora_rank", None):
            return cls(name, "MLA", layers, heads, heads, config.qk_nope_head_dim + config.qk_rope_head_dim,
                       kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim,
                       v_head_dim=config.v_head_dim)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(name, "MHA" if kv_heads == heads else "GQA", layers, heads, kv_heads, head_dim)

    @property
    def values_per_token(self) -> int:
        """Numbers stored in the KV cache for one token, all layers together."""
        if self.attention == "MLA":
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return self.num_layers * self.num_kv_heads * (self.head_dim + (self.v_head_dim or self.head_dim))

    @property
    def mha_values_per_token(self) -> int:
        """What the same model would cache with one KV head per query head (plain MHA)."""
        return self.num_layers * self.num_heads * (self.head_dim + (self.v_head_dim or self.head_dim))


# Numbers from each model's published config.json (Hugging Face model cards).
KNOWN_CONFIGS: dict[str, KVConfig] = {c.name: c for c in [
    KVConfig("Llama-2-7B", "MHA", 32, 32, 32, 128, source="meta-llama/Llama-2-7b-hf config.json"),
    KVConfig("Llama-3-8B", "GQA", 32, 32, 8, 128, source="meta-llama/Meta-Llama-3-8B config.json"),
    KVConfig("DeepSeek-V3", "MLA", 61, 128, 128, 192, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128,
             source="deepseek-ai/DeepSeek-V3 config.json (kv_lora_rank, qk_rope_head_dim)"),
    KVConfig("SmolLM2-135M", "GQA", 30, 9, 3, 64, source="HuggingFaceTB/SmolLM2-135M-Instruct config.json"),
]}


def get_config(config) -> KVConfig:
    """Accept a KVConfig, the name of a known config, or a transformers config."""
    if isinstance(config, KVConfig):
        return config
    if isinstance(config, str):
        if config not in KNOWN_CONFIGS:
            raise ValueError(f"Unknown config name {config!r}. Known: {', '.join(KNOWN_CONFIGS)}; "
                             "or pass a KVConfig / transformers config.")
        return KNOWN_CONFIGS[config]
    if hasattr(config, "num_hidden_layers"):
        return KVConfig.from_hf(config)
    raise TypeError(f"Expected a KVConfig, a known config name or a transformers config, got {type(config).__name__}.")


def kv_bytes_per_token(config, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of KV cache one token occupies across all layers."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}.")
    return get_config(config).values_per_token * dtype.itemsize


def tokens_that_fit(config, budget_bytes: int, dtype: torch.dtype = torch.float32) -> int:
    """How many tokens' KV fit in `budget_bytes` (whole tokens only)."""
    check_int("budget_bytes", budget_bytes)
    return budget_bytes // kv_bytes_per_token(config, dtype)


def kv_table(names=None, dtype: torch.dtype = torch.bfloat16, budget_bytes: int = GiB) -> str:
    """A text table: KV bytes per token, tokens that fit in the budget, and the size relative to MHA."""
    budget = f"tokens/{budget_bytes / GiB:g} GiB"
    rows = [f"{'model':<14}{'attention':>10}{'KiB/token':>11}{budget:>16}{'vs MHA':>8}"]
    for name in names or KNOWN_CONFIGS:
        cfg = get_config(name)
        per_token = kv_bytes_per_token(cfg, dtype)
        fit = tokens_that_fit(cfg, budget_bytes, dtype)
        ratio = cfg.values_per_token / cfg.mha_values_per_token
        rows.append(f"{cfg.name:<14}{cfg.attention:>10}{per_token / 1024:>11.1f}{fit:>16,}{ratio:>8.3f}")
    return "\n".join(rows)
