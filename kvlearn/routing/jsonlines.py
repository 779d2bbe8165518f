"""JSON Lines files, read for checking: every line parsed on its own, every bad one reported, in
bounded memory and time.

`json_lines(path, errors)` yields `(line number, parsed object)` for each non-empty line of a
file, gzipped or not (known by its magic bytes, not its name); a line that is not UTF-8, not JSON,
nested too deeply to parse or longer than MAX_LINE_BYTES is appended to `errors` as
"path:number: why" instead. Reading stops, with such an error, at gzip data cut short or corrupt,
where the text read passes `budget.trace_text_limit()`, and once MAX_BAD_LINES errors are
collected. Runs of blank lines are skipped a buffer at a time. `bad_lines(errors, ...)` turns the
collected errors into one `TraceError`-ready message.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from pathlib import Path

from kvlearn.routing.budget import trace_text_limit

MAX_LINE_BYTES = 16 * 2**20     # one request's line; a 100,000-token prompt is under 1 MB of JSON
BUFFER_BYTES = 2**20             # read a file a buffer at a time
MAX_BAD_LINES = 1000            # errors collected before reading stops (a few are shown: `bad_lines`)
STOPPED = "reading stopped here"   # how an error that ends the reading ends
READ_ERRORS = (OSError, EOFError, zlib.error)   # gzip.BadGzipFile is an OSError, a stream cut short an EOFError


def open_lines(path: Path):
    """The file's lines as bytes, gunzipped when it starts with gzip's magic bytes, through a
    buffer of BUFFER_BYTES."""
    with path.open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return io.BufferedReader(gzip.GzipFile(path, "rb"), BUFFER_BYTES) if gzipped else path.open("rb", BUFFER_BYTES)


def json_lines(path: Path, errors: list[str]):
    """(number, object) for each non-empty line that is UTF-8 JSON; the others go to `errors`."""
    for number, raw in raw_lines(path, errors):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            errors.append(f"{path}:{number}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})")
            continue
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            errors.append(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})")
            continue
        except RecursionError:
            errors.append(f"{path}:{number}: JSON nested too deeply to parse (arrays or objects inside one "
                          "another, thousands deep); a trace line nests two levels")
            continue
        yield number, row


def raw_lines(path: Path, errors: list[str]):
    """(number, bytes) for each line of the file that is not blank. An overlong line, and what
    stops the reading (gzip data cut short or corrupt, the text limit, too many errors), are
    appended to `errors` instead."""
    limit, why = trace_text_limit()
    number = total = 0
    try:
        with open_lines(path) as f:
            while raw := f.readline(MAX_LINE_BYTES + 1):
                number += 1
                total += len(raw)
                overlong = len(raw) > MAX_LINE_BYTES
                while overlong and not raw.endswith(b"\n") and total <= limit:   # the rest of it, unkept
                    raw = f.readline(MAX_LINE_BYTES) or b"\n"
                    total += len(raw)
                if total > limit:
                    errors.append(f"{path}:{number}: the trace's text passes {limit:,} bytes here ({why}): split the "
                                  f"trace, or read a part of it; {STOPPED}")
                    return
                if len(errors) >= MAX_BAD_LINES:
                    errors.append(f"{path}:{number}: {MAX_BAD_LINES:,} bad lines before this one: is this a trace? "
                                  f"{STOPPED}")
                    return
                if overlong:
                    errors.append(f"{path}:{number}: the line is longer than {MAX_LINE_BYTES >> 20} MB, longer than "
                                  "any request's line: is this a trace?")
                elif raw.isspace():
                    number, total = _skip_blank_lines(f, number, total, limit)
                else:
                    yield number, raw
    except READ_ERRORS as e:
        errors.append(f"{path}:{number + 1}: cannot read further ({type(e).__name__}: {str(e) or 'no detail'}): a "
                      f"gzip file cut short or corrupted? {STOPPED}")


def _skip_blank_lines(f, number: int, total: int, limit: int) -> tuple[int, int]:
    """Skip the blank lines at the front of `f`'s buffer, and of the next buffers while they are
    blank and the bytes read are within `limit`: a run of them costs a call per buffer, not one
    per line. Returns (line number, bytes read) after them."""
    while total <= limit:
        ahead = f.peek(1)
        blank = len(ahead) - len(ahead.lstrip())
        end = ahead.rfind(b"\n", 0, blank) + 1      # up to the last newline of the blank run
        if not end:
            return number, total
        f.read(end)
        number += ahead.count(b"\n", 0, end)
        total += end
    return number, total


def bad_lines(errors: list[str], max_errors: int, what: str) -> str:
    """'N bad line(s) in <what>; ...' followed by the first `max_errors` errors, one a line, and
    the last one too when it says where reading stopped."""
    shown, hidden = errors[:max_errors], errors[max_errors:]
    if hidden:
        last = hidden[-1:] if hidden[-1].endswith(STOPPED) else []
        shown += [f"... and {len(hidden) - len(last)} more"] + last
    return f"{len(errors)} bad line(s) in {what}:\n  " + "\n  ".join(shown)
