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
  counted in `stats` by reason, and never becomes KV. The store remembers the key as bad: it no
  longer `contains` or `holds` it, so the next write of that page replaces the file with a good
  one. (`holds`, which the tree asks before writing a page, reads the header only: it finds a
  truncated or foreign file, a flipped bit in the KV waits for `get`'s checksum);
- with a capacity (`max_bytes`), the entries' files never take more than `max_bytes` after a
  write: before it, the least recently used entries are deleted until the new one fits.

Least recently used, across restarts: every write and every valid read stamps the file's
modification time (`os.utime`, nanoseconds, strictly increasing within one process), so the order
lives in the folder itself and a later process evicts in the same order. Eviction scans the folder
(one `stat` per file) at each write: simple, and right even when other processes write too.

What a crash or a race can leave (each harmless):
- killed between the temporary file and its rename: a `.tmp-*` file, never read and not counted
  against the capacity (delete it by hand, or `sweep_temporary`);
- killed between deleting old entries and renaming the new one: the folder is below capacity;
- killed between a read and its stamp: that entry looks older than it is, and may go first;
- two processes writing at once each make room for their own entry: together they can exceed the
  capacity by one entry per concurrent writer, until the next write makes room again;
- no fsync: after a power cut a renamed file may be empty or partial; the checks make it a miss
  (and the next write of that page replaces it).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import time
from pathlib import Path

import torch
import xxhash

from kvlearn.blocks import hash_block_tokens
from kvlearn.errors import check_int, check_positive_int, fault_point

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
    max_bytes: the most bytes the entries' files may take (at least one entry); None: no limit.
    The folder must exist and be writable: the error at construction says what to do otherwise.

    `stats`: pages_written, pages_read, pages_evicted (deleted to make room), and misses by reason.
    """

    def __init__(self, folder, model_id: str, dtype: torch.dtype, shape: tuple[int, int, int],
                 page_tokens: int = 16, max_bytes: int | None = None):
        check_positive_int("page_tokens", page_tokens)
        self.folder = check_folder(folder)
        self.model_id, self.dtype, self.page_tokens = model_id, dtype, page_tokens
        layers, kv_heads, head_dim = shape
        self.page_shape = (layers, 2, page_tokens, kv_heads, head_dim)
        if max_bytes is not None:
            check_int("max_bytes", max_bytes, what=" (bytes the disk tier may use)")
            if max_bytes < self.max_entry_bytes:
                raise ValueError(f"max_bytes of the disk tier ({max_bytes}) must hold at least one entry of "
                                 f"{self.max_entry_bytes} bytes (a page of {page_tokens} tokens' KV "
                                 "and its header), or be None for no limit.")
        self.max_bytes = max_bytes
        self.stats = {"pages_written": 0, "pages_read": 0, "pages_evicted": 0} | {f"miss_{r}": 0 for r in MISS_REASONS}
        self._bad: set[int] = set()  # keys whose file this store found bad: rewritten at the next put
        self._stamp = 0              # the last LRU stamp given (ns), to keep stamps increasing

    def __repr__(self) -> str:
        limit = "" if self.max_bytes is None else f", max_bytes={self.max_bytes}"
        return (f"DiskStore({self.folder}, page_tokens={self.page_tokens}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}{limit}, files={len(self.files())})")

    @property
    def payload_bytes(self) -> int:
        """Bytes of one page's KV."""
        return torch.Size(self.page_shape).numel() * torch.empty(0, dtype=self.dtype).element_size()

    def entry_bytes(self, tokens) -> int:
        """Bytes of the file that holds one page for these tokens: its KV and its header."""
        return len(self._encode(tokens, bytes(self.payload_bytes)))

    @property
    def max_entry_bytes(self) -> int:
        """The largest file one entry can be (token ids of 19 digits): a capacity holds at least one."""
        return self.entry_bytes([2**63 - 1] * self.page_tokens)

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
        """The entries' files (not temporary files of writes in progress, nor other files), by name."""
        return sorted(p for p in self.folder.glob("*.kv") if _is_entry(p.name))

    def used_bytes(self) -> int:
        """Bytes the entries' files take now."""
        return sum(size for _, _, size, _ in self._entries())

    def lru_order(self) -> list[int]:
        """The keys on disk, least recently used (next to be evicted) first."""
        return [int(path.stem, 16) for _, _, _, path in sorted(self._entries())]

    def contains(self, key: int) -> bool:
        """Query: whether a file exists under this key that this store has not found bad (not
        whether it is valid: `get` checks)."""
        return key not in self._bad and self.path(key).is_file()

    def touch(self, key: int) -> None:
        """Mark an entry as just used (a write of the same page that found it already there)."""
        self._stamp_file(self.path(key))

    # --- reading and writing ---------------------------------------------------------------------
    def put(self, key: int, tokens, kv: torch.Tensor) -> None:
        """Write one page (`kv` of shape page_shape) atomically: temporary file, then rename."""
        kv = kv.detach().to("cpu", self.dtype).contiguous()
        if tuple(kv.shape) != self.page_shape or len(tokens) != self.page_tokens:
            raise ValueError(f"a page is {self.page_tokens} tokens and KV of shape {list(self.page_shape)}; "
                             f"got {len(tokens)} tokens and {list(kv.shape)}.")
        data = self._encode(tokens, kv.view(torch.uint8).numpy().tobytes())
        if self.max_bytes is not None:
            self._make_room(len(data), keep=key)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".kv")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self._stamp_file(tmp)  # stamped before it appears: the newest entry from the start
            os.replace(tmp, self.path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._bad.discard(key)
        self.stats["pages_written"] += 1

    def _encode(self, tokens, payload: bytes) -> bytes:
        header = json.dumps({"model": self.model_id, "dtype": str(self.dtype).removeprefix("torch."),
                             "shape": list(self.page_shape), "tokens": list(map(int, tokens)),
                             "payload_bytes": len(payload), "xxh64": xxhash.xxh64_hexdigest(payload)}).encode()
        return MAGIC + _HEADER_LEN.pack(len(header)) + header + payload

    # --- capacity: least recently used first -----------------------------------------------------
    def _entries(self) -> list[tuple[int, str, int, Path]]:
        """(stamp, name, bytes, path) of every entry's file now (a file gone meanwhile is skipped)."""
        out = []
        with os.scandir(self.folder) as it:
            for e in it:
                if _is_entry(e.name):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    out.append((st.st_mtime_ns, e.name, st.st_size, Path(e.path)))
        return out

    def _make_room(self, size: int, keep: int) -> None:
        """Delete least recently used entries until one of `size` bytes fits (the file under `keep`
        is about to be replaced: it does not count)."""
        fault_point("disk.make_room")
        entries = sorted(e for e in self._entries() if e[3] != self.path(keep))
        used = sum(e[2] for e in entries)
        for _, _, nbytes, path in entries:
            if used + size <= self.max_bytes:
                break
            try:
                path.unlink()
                self.stats["pages_evicted"] += 1
            except FileNotFoundError:  # another process took it first
                pass
            used -= nbytes
            self._bad.discard(int(path.stem, 16))

    def _stamp_file(self, path) -> None:
        """Set the file's modification time to a fresh stamp (strictly later than this store's last)."""
        self._stamp = max(time.time_ns(), self._stamp + 1)
        try:
            os.utime(path, ns=(self._stamp, self._stamp))
        except FileNotFoundError:  # evicted or replaced by another process meanwhile
            pass

    def sweep_temporary(self, older_than_s: float = 3600.0) -> int:
        """Delete temporary files left by writers killed before their rename, if older than
        `older_than_s` (a younger one may be a write in progress); return how many."""
        gone, now = 0, time.time()
        for path in self.folder.glob(".tmp-*.kv"):
            try:
                if now - path.stat().st_mtime > older_than_s:
                    path.unlink()
                    gone += 1
            except FileNotFoundError:
                pass
        return gone

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
            self._bad.add(key)
            return self._miss(reason)
        self._stamp_file(self.path(key))
        self.stats["pages_read"] += 1
        return torch.frombuffer(bytearray(payload), dtype=self.dtype).reshape(self.page_shape)

    def holds(self, key: int, tokens) -> bool:
        """Whether an entry for exactly these tokens that looks whole is on disk, reading only its
        header: this store's kind, these tokens, the right size. (A flipped bit in the KV is found
        by `get`'s checksum.) A file that fails is counted as a miss and remembered as bad."""
        if key in self._bad:
            return False
        try:
            with open(self.path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(len(MAGIC) + _HEADER_LEN.size)
                if len(head) == len(MAGIC) + _HEADER_LEN.size and head.startswith(MAGIC):
                    head += f.read(_HEADER_LEN.unpack(head[len(MAGIC):])[0])
        except OSError:
            return False
        header, _, reason = self._parse_head(head, size)
        if reason is None and header["tokens"] != list(map(int, tokens)):
            reason = "foreign"
        if reason is not None:
            self._bad.add(key)
            self._miss(reason)
            return False
        return True

    def _parse(self, data: bytes):
        """(header, payload, None) for a file of this store's kind, else (None, None, reason)."""
        header, start, reason = self._parse_head(data, len(data))
        return (None, None, reason) if reason else (header, data[start:], None)

    def _parse_head(self, head: bytes, file_size: int):
        """From a file's first bytes (at least its header) and its size: (header, where the payload
        starts, None) for a file of this store's kind and the right size, else (None, None, reason)."""
        n = len(MAGIC) + _HEADER_LEN.size
        if len(head) < n:
            return None, None, "truncated"
        if not head.startswith(MAGIC):
            return None, None, "corrupt"
        (size,) = _HEADER_LEN.unpack(head[len(MAGIC):n])
        if len(head) < n + size:
            return None, None, "truncated"
        try:
            header = json.loads(head[n:n + size])
            mine = (header["model"], header["dtype"], header["shape"]) == \
                (self.model_id, str(self.dtype).removeprefix("torch."), list(self.page_shape))
            payload_bytes = int(header["payload_bytes"])
        except (ValueError, KeyError, TypeError):
            return None, None, "corrupt"
        if not mine:
            return None, None, "foreign"
        if file_size - n - size != payload_bytes:
            return None, None, "truncated" if file_size - n - size < payload_bytes else "corrupt"
        return header, n + size, None

    def _miss(self, reason: str) -> None:
        self.stats[f"miss_{reason}"] += 1
        return None


def _is_entry(name: str) -> bool:
    """Whether a file name is an entry's: 16 hex digits and ".kv"."""
    stem, dot, ext = name.partition(".")
    return dot == "." and ext == "kv" and len(stem) == 16 and all(c in "0123456789abcdef" for c in stem)


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
