"""JSON Lines files, read for checking: every line parsed on its own, every bad one reported.

`json_lines(path, errors)` yields `(line number, parsed object)` for each non-empty line of a
file, gzipped or not (known by its magic bytes, not its name); a line that is not UTF-8 or not
JSON is appended to `errors` as "path:number: why" instead. `bad_lines(errors, ...)` turns the
collected errors into one `TraceError`-ready message.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def open_lines(path: Path):
    """The file's lines as bytes, gunzipped when it starts with gzip's magic bytes."""
    with path.open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else path.open("rb")


def json_lines(path: Path, errors: list[str]):
    """(number, object) for each non-empty line that is UTF-8 JSON; the others go to `errors`."""
    with open_lines(path) as lines:
        for number, raw in enumerate(lines, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                errors.append(f"{path}:{number}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})")
                continue
            if not text.strip():
                continue
            try:
                yield number, json.loads(text)
            except json.JSONDecodeError as e:
                errors.append(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})")


def bad_lines(errors: list[str], max_errors: int, what: str) -> str:
    """'N bad line(s) in <what>; ...' followed by the first `max_errors` errors, one a line."""
    shown = errors[:max_errors] + ([f"... and {len(errors) - max_errors} more"] if len(errors) > max_errors else [])
    return f"{len(errors)} bad line(s) in {what}:\n  " + "\n  ".join(shown)
