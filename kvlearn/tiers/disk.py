"""Chapter 8: the disk tier, KV pages in files that any later process can find again.

An entry is one page of `page_tokens` tokens: their K and V in every layer. Its file name is the
chained hash of the whole token prefix up to the end of that page (chapter 2's `hash_block_tokens`,
stable across processes), so a key means the same thing in any process that runs the same model.

Invariants:
- a file is written under a temporary name and renamed into place (`os.replace`, atomic on one
  file system): a reader sees no file or a whole file, and two writers of one entry leave one of
  their two whole files;
- a file is loaded only if its header names this store's model, dtype and page shape, its token
  ids are the page's, and the payload has the stated length and checksum; anything else is a miss,
  counted in `stats` by reason, and never becomes KV.
(No fsync: after a power cut a renamed file may be empty or partial; the checks make it a miss.)
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import torch
import xxhash

from kvlearn.blocks import hash_block_tokens
from kvlearn.errors import check_positive_int

MAGIC = b"KVLEARN-KV1\n"
_HEADER_LEN = struct.Struct("<I")
MISS_REASONS = ("missing", "truncated", "corrupt", "foreign")


def model_identity(model) -> str:
    """What must match for KV to be reusable: the model's name and its KV shape."""
    c = model.config
    name = Path(str(getattr(c, "_name_or_path", "") or c.model_type)).name
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return f"{name}/{c.model_type}/layers={c.num_hidden_layers}/kv_heads={c.num_key_value_heads}/head_dim={head_dim}"


class DiskStore:
    """Pages of KV in files under `folder`, for one model identity, dtype and page shape.

    shape: (num_layers, num_kv_heads, head_dim) of the pool the pages come from and go to.
    The folder must exist and be writable: the error at construction says what to do otherwise.
    """

    def __init__(self, folder, model_id: str, dtype: torch.dtype, shape: tuple[int, int, int],
                 page_tokens: int = 16):
        check_positive_int("page_tokens", page_tokens)
        self.folder = check_folder(folder)
        self.model_id, self.dtype, self.page_tokens = model_id, dtype, page_tokens
        layers, kv_heads, head_dim = shape
        self.page_shape = (layers, 2, page_tokens, kv_heads, head_dim)
        self.stats = {"pages_written": 0, "pages_read": 0} | {f"miss_{r}": 0 for r in MISS_REASONS}

    def __repr__(self) -> str:
        return (f"DiskStore({self.folder}, page_tokens={self.page_tokens}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}, files={len(self.files())})")

    # --- keys -------------------------------------------------------------------------------------
    def page_hashes(self, tokens) -> list[int]:
        """Chained hash of every full page of `tokens`: entry i is the key of tokens[:(i+1)*P]."""
        hashes, h, p = [], None, self.page_tokens
        for start in range(0, len(tokens) - p + 1, p):
            h = hash_block_tokens(h, list(tokens[start:start + p]))
            hashes.append(h)
        return hashes

    def path(self, key: int) -> Path:
        return self.folder / f"{key:016x}.kv"

    def files(self) -> list[Path]:
        return sorted(self.folder.glob("*.kv"))

    def contains(self, key: int) -> bool:
        """Query: whether a file exists under this key (not whether it is valid: `get` checks)."""
        return self.path(key).is_file()

    # --- reading and writing ---------------------------------------------------------------------
    def put(self, key: int, tokens, kv: torch.Tensor) -> None:
        """Write one page (`kv` of shape page_shape) atomically: temporary file, then rename."""
        kv = kv.detach().to("cpu", self.dtype).contiguous()
        if tuple(kv.shape) != self.page_shape or len(tokens) != self.page_tokens:
            raise ValueError(f"a page is {self.page_tokens} tokens and KV of shape {list(self.page_shape)}; "
                             f"got {len(tokens)} tokens and {list(kv.shape)}.")
        payload = kv.view(torch.uint8).numpy().tobytes()
        header = json.dumps({"model": self.model_id, "dtype": str(self.dtype).removeprefix("torch."),
                             "shape": list(self.page_shape), "tokens": list(map(int, tokens)),
                             "payload_bytes": len(payload), "xxh64": xxhash.xxh64_hexdigest(payload)}).encode()
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".kv")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + _HEADER_LEN.pack(len(header)) + header + payload)
            os.replace(tmp, self.path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.stats["pages_written"] += 1

    def get(self, key: int, tokens) -> torch.Tensor | None:
        """The page stored under `key` for exactly these tokens, or None (a miss, counted by reason)."""
        try:
            data = self.path(key).read_bytes()
        except OSError:  # gone, or unreadable: either way not KV we can use
            return self._miss("missing")
        header, payload, reason = self._parse(data)
        if reason is None and header["tokens"] != list(map(int, tokens)):
            reason = "foreign"  # same hash, other tokens: a collision, never KV for these tokens
        if reason is None and xxhash.xxh64_hexdigest(payload) != header["xxh64"]:
            reason = "corrupt"
        if reason is not None:
            return self._miss(reason)
        self.stats["pages_read"] += 1
        return torch.frombuffer(bytearray(payload), dtype=self.dtype).reshape(self.page_shape)

    def _parse(self, data: bytes):
        """(header, payload, None) for a file of this store's kind, else (None, None, reason)."""
        n = len(MAGIC) + _HEADER_LEN.size
        if len(data) < n:
            return None, None, "truncated"
        if not data.startswith(MAGIC):
            return None, None, "corrupt"
        (size,) = _HEADER_LEN.unpack(data[len(MAGIC):n])
        if len(data) < n + size:
            return None, None, "truncated"
        try:
            header = json.loads(data[n:n + size])
            mine = (header["model"], header["dtype"], header["shape"]) == \
                (self.model_id, str(self.dtype).removeprefix("torch."), list(self.page_shape))
            payload_bytes = int(header["payload_bytes"])
        except (ValueError, KeyError, TypeError):
            return None, None, "corrupt"
        if not mine:
            return None, None, "foreign"
        payload = data[n + size:]
        if len(payload) != payload_bytes:
            return None, None, "truncated" if len(payload) < payload_bytes else "corrupt"
        return header, payload, None

    def _miss(self, reason: str) -> None:
        self.stats[f"miss_{reason}"] += 1
        return None


def check_folder(folder) -> Path:
    """The folder as a Path if it exists and this process can create files in it; else ValueError
    saying what to do."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"disk_dir must be a folder path (str or Path), got {type(folder).__name__}.")
    path = Path(folder)
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise ValueError(f"disk_dir {str(path)!r} {what}: create the folder first (mkdir -p {path}) "
                         "or pass an existing one.")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"disk_dir {str(path)!r} is not writable ({e.strerror}): give a folder this "
                         "process may write to, or fix its permissions.") from None
    return path
