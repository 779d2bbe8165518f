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
  write: before it, the least recently used entries are deleted until the new one fits;
- an entry is opened without following a link and without blocking, must be a regular file, and
  is read no further than a header and a page of this store: a link, a FIFO, a device or a folder
  under an entry's name is a miss (reason "link" or "not_regular"), in bounded time and memory;
- the store is a cache, never a reason to fail: an OS error on any operation (write, rename, stamp,
  read, listing, delete: a read-only or full file system, a folder gone or replaced by a file, a
  folder under an entry's name, no permission, an I/O error) drops the page or makes the read a
  miss. It is counted in `stats` (`errors`, and `errors_<kind>` by errno, `ERROR_KINDS`) and
  reported once per store by a warning that names the folder and the error; every call tries
  again, so writes resume when the folder works again.

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

import errno
import json
import os
import stat
import struct
import tempfile
import time
import warnings
from functools import cached_property
from pathlib import Path

import torch
import xxhash

from kvlearn.blocks import hash_block_tokens
from kvlearn.errors import check_int, check_positive_int, fault_point

MAGIC = b"KVLEARN-KV1\n"
_HEADER_LEN = struct.Struct("<I")
MISS_REASONS = ("missing", "truncated", "corrupt", "foreign", "link", "not_regular")
# OS errors counted by kind (errno name, lower case in `stats`); any other errno counts as "other"
ERROR_KINDS = ("EROFS", "ENOSPC", "EISDIR", "ENOTDIR", "EACCES", "EPERM", "EIO", "ENOENT", "other")
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def model_identity(model) -> str:
    """What must match for KV to be reusable: the model's name and its KV shape."""
    c = model.config
    name = Path(str(getattr(c, "_name_or_path", "") or c.model_type)).name
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return f"{name}/{c.model_type}/layers={c.num_hidden_layers}/kv_heads={c.num_key_value_heads}/head_dim={head_dim}"


class DiskStore:
    """Pages of KV in files under `folder`, for one model identity, dtype and page shape.

    shape: (num_layers, num_kv_heads, row) of the pool the pages come from and go to (row: head_dim, or
    a quantized row with its scale, chapter 10).
    max_bytes: the most bytes the entries' files may take (at least one entry); None: no limit.
    The folder must exist and be writable: the error at construction says what to do otherwise.

    `stats`: pages_written, pages_read, pages_evicted (deleted to make room), misses by reason
    (`miss_<reason>`, MISS_REASONS), and OS errors (`errors`, and `errors_<kind>`, ERROR_KINDS).
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
        self.stats = ({"pages_written": 0, "pages_read": 0, "pages_evicted": 0, "errors": 0}
                      | {f"miss_{r}": 0 for r in MISS_REASONS} | {f"errors_{k.lower()}": 0 for k in ERROR_KINDS})
        self._bad: set[int] = set()  # keys whose file this store found bad: rewritten at the next put
        self._stamp = 0              # the last LRU stamp given (ns), to keep stamps increasing
        self._warned = False         # an OS error was reported (once per store)

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

    @cached_property
    def max_entry_bytes(self) -> int:
        """The largest file one entry can be (token ids of 19 digits): a capacity holds at least one."""
        return self.entry_bytes([2**63 - 1] * self.page_tokens)

    # --- keys -------------------------------------------------------------------------------------
    def entry_keys(self, tokens) -> list[int]:
        """The key of the entry of every full page of `tokens`: key i is the chained xxh64 hash of
        tokens[:(i+1)*P] (chapter 2's `hash_block_tokens`), the file's name in any process."""
        hashes, h, p = [], None, self.page_tokens
        for start in range(0, len(tokens) - p + 1, p):
            h = hash_block_tokens(h, list(tokens[start:start + p]))
            hashes.append(h)
        return hashes

    def path(self, key: int) -> Path:
        return self.folder / f"{key:016x}.kv"

    def files(self) -> list[Path]:
        """The entries' files (not temporary files of writes in progress, nor other files), by name;
        none if the folder cannot be listed (an OS error, counted)."""
        return sorted(path for _, _, _, path in self._listed())

    def used_bytes(self) -> int:
        """Bytes the entries' files take now."""
        return sum(size for _, _, size, _ in self._listed())

    def lru_order(self) -> list[int]:
        """The keys on disk, least recently used (next to be evicted) first."""
        return [int(path.stem, 16) for _, _, _, path in sorted(self._listed())]

    def contains(self, key: int) -> bool:
        """Query: whether a regular file exists under this key that this store has not found bad
        (not whether it is valid: `get` checks). An OS error is a no, and counts nothing."""
        try:
            return key not in self._bad and stat.S_ISREG(os.lstat(self.path(key)).st_mode)
        except OSError:
            return False

    def touch(self, key: int) -> None:
        """Mark an entry as just used (a write of the same page that found it already there)."""
        try:
            self._stamp_file(self.path(key))
        except OSError as e:
            self._failed("stamp", e)

    # --- reading and writing ---------------------------------------------------------------------
    def put(self, key: int, tokens, kv: torch.Tensor) -> bool:
        """Write one page (`kv` of shape page_shape) atomically: temporary file, then rename.
        Returns whether it was written: False when the file system refused (an OS error, counted
        and reported; the page is dropped, as a cache may)."""
        kv = kv.detach().to("cpu", self.dtype).contiguous()
        if tuple(kv.shape) != self.page_shape or len(tokens) != self.page_tokens:
            raise ValueError(f"a page is {self.page_tokens} tokens and KV of shape {list(self.page_shape)}; "
                             f"got {len(tokens)} tokens and {list(kv.shape)}.")
        data = self._encode(tokens, kv.view(torch.uint8).numpy().tobytes())
        try:
            if self.max_bytes is not None:
                self._make_room(len(data), keep=key)
        except OSError as e:
            self._failed("making room (list, delete)", e)
            return False
        try:
            self._write(self.path(key), data)
        except OSError as e:
            self._failed("write", e)
            return False
        self._bad.discard(key)
        self.stats["pages_written"] += 1
        return True

    def _write(self, path: Path, data: bytes) -> None:
        """Write `data` to a temporary file, stamp it, rename it to `path`; leaves no temporary file."""
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".kv")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self._stamp_file(tmp)  # stamped before it appears: the newest entry from the start
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:  # (the folder may be gone or read-only by now: nothing more to do)
                pass
            raise

    def _encode(self, tokens, payload: bytes) -> bytes:
        header = json.dumps({"model": self.model_id, "dtype": str(self.dtype).removeprefix("torch."),
                             "shape": list(self.page_shape), "tokens": list(map(int, tokens)),
                             "payload_bytes": len(payload), "xxh64": xxhash.xxh64_hexdigest(payload)}).encode()
        return MAGIC + _HEADER_LEN.pack(len(header)) + header + payload

    # --- capacity: least recently used first -----------------------------------------------------
    def _listed(self) -> list[tuple[int, str, int, Path]]:
        """`_entries`, or none if the folder cannot be listed (counted and reported)."""
        try:
            return self._entries()
        except OSError as e:
            self._failed("list", e)
            return []

    def _entries(self) -> list[tuple[int, str, int, Path]]:
        """(stamp, name, bytes, path) of every entry's file now: regular files only (a link or a folder
        under an entry's name is neither counted nor evicted); a file gone meanwhile is skipped."""
        out = []
        with os.scandir(self.folder) as it:
            for e in it:
                if _is_entry(e.name):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode):
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
        """Set the file's modification time to a fresh stamp (strictly later than this store's last);
        a file gone meanwhile is skipped, other OS errors raise."""
        self._stamp = max(time.time_ns(), self._stamp + 1)
        try:
            os.utime(path, ns=(self._stamp, self._stamp))
        except FileNotFoundError:  # evicted or replaced by another process meanwhile
            pass

    def sweep_temporary(self, older_than_s: float = 3600.0) -> int:
        """Delete temporary files left by writers killed before their rename, if older than
        `older_than_s` (a younger one may be a write in progress); return how many."""
        gone, now = 0, time.time()
        try:
            for path in self.folder.glob(".tmp-*.kv"):
                try:
                    if now - path.lstat().st_mtime > older_than_s:
                        path.unlink()
                        gone += 1
                except FileNotFoundError:
                    pass
        except OSError as e:
            self._failed("delete", e)
        return gone

    def get(self, key: int, tokens) -> torch.Tensor | None:
        """The page stored under `key` for exactly these tokens, or None (a miss, counted by reason,
        or an OS error, counted by kind)."""
        header, payload, reason = self._load(key, payload=True)
        if header is None:  # a miss, or an OS error (counted)
            return None if reason is None else self._refuse(key, reason)
        if header["tokens"] != list(map(int, tokens)):
            reason = "foreign"  # same hash, other tokens: a collision, never KV for these tokens
        elif xxhash.xxh64_hexdigest(payload) != header["xxh64"]:
            reason = "corrupt"
        if reason is not None:
            return self._refuse(key, reason)
        self.touch(key)
        self.stats["pages_read"] += 1
        return torch.frombuffer(bytearray(payload), dtype=self.dtype).reshape(self.page_shape)

    def holds(self, key: int, tokens) -> bool:
        """Whether an entry for exactly these tokens that looks whole is on disk, reading only its
        header: this store's kind, these tokens, the right size. (A flipped bit in the KV is found
        by `get`'s checksum.) A file that fails is counted as a miss and remembered as bad."""
        if key in self._bad:
            return False
        header, _, reason = self._load(key, payload=False)
        if header is not None and header["tokens"] != list(map(int, tokens)):
            reason = "foreign"
        if reason is not None:
            self._refuse(key, reason)
            return False
        return header is not None  # (None: an OS error, counted)

    def _load(self, key: int, payload: bool) -> tuple[dict | None, bytes | None, str | None]:
        """The entry's header and, if asked, its payload: (header, payload or None, None) for a file
        of this store's kind and the right size; (None, None, reason) for a miss; (None, None, None)
        after an OS error (counted). The file is opened without following a link or blocking, must
        be a regular file, and is read no further than a header and this store's page."""
        try:
            fd = os.open(self.path(key), _OPEN_FLAGS)
        except FileNotFoundError:
            return None, None, "missing"
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symbolic link under an entry's name
                return None, None, "link"
            self._failed("read", e)
            return None, None, None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO, a device, a folder
                return None, None, "not_regular"
            with os.fdopen(fd, "rb", closefd=False) as f:
                n = len(MAGIC) + _HEADER_LEN.size
                head = f.read(n)
                if len(head) == n and head.startswith(MAGIC):
                    header_bytes = _HEADER_LEN.unpack(head[len(MAGIC):])[0]
                    if header_bytes > self._max_header_bytes:
                        return None, None, "corrupt"
                    head += f.read(header_bytes)
                header, _, reason = self._parse_head(head, st.st_size)
                if reason is not None or not payload:
                    return header, None, reason
                return header, f.read(self.payload_bytes), None
        except OSError as e:
            self._failed("read", e)
            return None, None, None
        finally:
            os.close(fd)

    @cached_property
    def _max_header_bytes(self) -> int:
        """The longest header read: this store's longest, or 1 MiB (other stores' headers, foreign)."""
        return max(self.max_entry_bytes - len(MAGIC) - _HEADER_LEN.size - self.payload_bytes, 1 << 20)

    def _refuse(self, key: int, reason: str) -> None:
        """A miss for `reason`; a file that is there but unusable is remembered as bad."""
        if reason != "missing":
            self._bad.add(key)
        return self._miss(reason)

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
        if payload_bytes != self.payload_bytes:  # this store's kind, its shape: never another size
            return None, None, "corrupt"
        if file_size - n - size != payload_bytes:
            return None, None, "truncated" if file_size - n - size < payload_bytes else "corrupt"
        return header, n + size, None

    def _miss(self, reason: str) -> None:
        self.stats[f"miss_{reason}"] += 1
        return None

    def _failed(self, operation: str, error: OSError) -> None:
        """Count an OS error by kind and report the first one (a warning naming the folder and the
        error); the caller drops the page or misses."""
        name = errno.errorcode.get(error.errno, "")
        kind = name if name in ERROR_KINDS else "other"
        self.stats["errors"] += 1
        self.stats[f"errors_{kind.lower()}"] += 1
        if not self._warned:
            self._warned = True
            warnings.warn(f"kvlearn disk tier: {operation} in {str(self.folder)!r} failed ({name or 'OSError'}: "
                          f"{error.strerror or error}); the disk tier drops pages and misses while this lasts "
                          "(counted in stats: the engine's 'disk_errors'), and resumes when the folder works "
                          "again.", RuntimeWarning, stacklevel=3)


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
