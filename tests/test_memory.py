"""KV memory arithmetic against values worked out by hand."""

import pytest
import torch

from kvlearn.memory import KNOWN_CONFIGS, GiB, KVConfig, get_config, kv_bytes_per_token, kv_table, tokens_that_fit


@pytest.mark.parametrize("name, bf16_bytes", [
    ("Llama-2-7B", 2 * 32 * 32 * 128 * 2),      # MHA: 512 KiB per token
    ("Llama-3-8B", 2 * 32 * 8 * 128 * 2),       # GQA, 8 KV heads: 128 KiB
    ("DeepSeek-V3", 61 * (512 + 64) * 2),       # MLA latent + RoPE key: 70,272 B
    ("SmolLM2-135M", 2 * 30 * 3 * 64 * 2),      # GQA, 3 KV heads: 23,040 B
])
def test_bytes_per_token_by_hand(name, bf16_bytes):
    assert kv_bytes_per_token(name, torch.bfloat16) == bf16_bytes
    assert kv_bytes_per_token(name, torch.float32) == 2 * bf16_bytes


def test_tokens_that_fit():
    assert tokens_that_fit("Llama-2-7B", GiB, torch.bfloat16) == 2048
    assert tokens_that_fit("Llama-3-8B", GiB, torch.bfloat16) == 8192
    assert tokens_that_fit("SmolLM2-135M", GiB, torch.float32) == GiB // 46_080 == 23_301
    assert tokens_that_fit("SmolLM2-135M", 46_079, torch.float32) == 0


def test_from_hf_config_matches_the_catalogue(model):
    cfg = KVConfig.from_hf(model.config)
    assert (cfg.attention, cfg.values_per_token) == ("GQA", KNOWN_CONFIGS["SmolLM2-135M"].values_per_token)
    assert kv_bytes_per_token(model.config) == 46_080  # float32 by default, like load_model


def test_from_hf_reads_mla():
    from types import SimpleNamespace
    hf = SimpleNamespace(num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
                         qk_nope_head_dim=128, v_head_dim=128, name_or_path="dsv3")
    assert KVConfig.from_hf(hf).values_per_token == KNOWN_CONFIGS["DeepSeek-V3"].values_per_token


def test_what_gqa_and_mla_buy():
    llama3 = KNOWN_CONFIGS["Llama-3-8B"]
    assert llama3.values_per_token * 4 == llama3.mha_values_per_token  # 32 query heads share 8 KV heads
    dsv3 = KNOWN_CONFIGS["DeepSeek-V3"]
    assert dsv3.mha_values_per_token == 61 * 128 * (192 + 128)
    assert dsv3.values_per_token / dsv3.mha_values_per_token < 0.015


def test_table_lists_every_config():
    table = kv_table()
    for name in KNOWN_CONFIGS:
        assert name in table
    assert "2,048" in table and "8,192" in table


def test_bad_input_is_explained():
    with pytest.raises(ValueError, match="Unknown config name 'GPT-5'.*Known: Llama-2-7B"):
        kv_bytes_per_token("GPT-5")
    with pytest.raises(TypeError, match="KVConfig"):
        kv_bytes_per_token(42)
    with pytest.raises(TypeError, match="dtype"):
        kv_bytes_per_token("Llama-2-7B", "bf16")
    with pytest.raises(ValueError, match="budget_bytes"):
        tokens_that_fit("Llama-2-7B", -1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVConfig("odd", "GQA", 2, 9, 2, 64)
    with pytest.raises(ValueError, match="num_layers"):
        KVConfig("empty", "MHA", 0, 8, 8, 64)
    assert get_config(KNOWN_CONFIGS["Llama-2-7B"]) is KNOWN_CONFIGS["Llama-2-7B"]
