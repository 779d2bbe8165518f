"""A part's module, read, imported and checked with bounds (for `kvlearn.exercises.parts`).

`read_part` refuses what is not a part's file (a directory, a device, over MAX_PART_BYTES, not
UTF-8) without blocking; `Zygote.get().check(...)` imports and checks a module's text in a fresh
process, a fork of a clean Python that has loaded the check and never runs a part's code, killed
at its time limits: a part that loops, sleeps, exits or changes the check at import becomes a
verdict, never a hung or broken caller, and cannot change the check of the next part.
`building_chain()` is the parts whose modules are being run, so that `earlier_part` refuses a part
building on itself. POSIX (fork, process groups): Linux and macOS.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.machinery
import importlib.util
import inspect
import json
import math
import os
import queue
import resource
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvlearn.exercises import NOT_YET

FOLDER = "my_parts"   # where a %%part cell saves its module, beside the notebook

# Bounds on reading a part. A part's module is one cell: far under MAX_PART_BYTES. Importing it may
# check an earlier part it builds on (`earlier_part`, in a process of its own): IMPORT_LIMIT_S covers
# that. STARTUP_LIMIT_S is a fresh Python importing kvlearn.parts (torch) on a loaded machine.
MAX_PART_BYTES = 1 << 20
IMPORT_LIMIT_S = 60.0
STARTUP_LIMIT_S = 120.0
CHECK_LIMIT_S = 10.0                  # `check`'s own limit; the check and its shrinking take at most twice that
CHAIN_VARIABLE = "KVLEARN_PARTS_BUILDING"   # set in a check's process: the parts being built by those above it
_building: list[str] = []             # the parts whose module (or %%part cell) this process is running


def part_path(name: str, folder: str | Path = FOLDER) -> Path:
    """folder/name.py, the module of part `name` (a Python identifier, checked)."""
    if not name.isidentifier():
        raise ValueError(f"%%part {name!r}: give the part's module name, a Python identifier such as "
                         "block_manager (the cell is saved as my_parts/<name>.py).")
    return Path(folder) / f"{name}.py"


def fresh_package(folder: Path) -> None:
    """Make `folder` the package named after it, forgetting every module of it imported before."""
    package = folder.name
    if not package.isidentifier():
        raise ValueError(f"{folder}: the parts folder's name must be a Python identifier, such as my_parts.")
    for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
        del sys.modules[key]
    spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
    spec.submodule_search_locations = [str(folder.resolve())]
    sys.modules[package] = importlib.util.module_from_spec(spec)


def building_chain() -> list[str]:
    """The parts being built, outermost first: by the processes that started this one, then here."""
    return [p for p in os.environ.get(CHAIN_VARIABLE, "").split(",") if p] + _building


@contextlib.contextmanager
def building_part(name: str):
    _building.append(name)
    try:
        yield
    finally:
        _building.pop()


def import_part(folder: Path, name: str, text: str):
    """Run `text`, the module folder/name.py, as the module `<folder name>.<name>` (compiled from the
    text, never from a cached .pyc, which a cell saved twice within a second could leave stale)."""
    path = part_path(name, folder)
    spec = importlib.util.spec_from_file_location(f"{folder.name}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        with building_part(name):
            exec(compile(text, str(path), "exec"), vars(module))
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def read_part(path: Path) -> str:
    """The text of a part's file. FileNotFoundError when there is none; ValueError saying why when
    it is not a regular file, is over MAX_PART_BYTES, or is not UTF-8. Never blocks (a FIFO, a device)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))   # a directory opens too, and says so
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a device, pipe or socket"
        raise ValueError(f"{path.parent.name}/{path.name} is {kind}, not a file: remove it and run the "
                         f"part's %%part cell again")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_PART_BYTES + 1)
    if len(data) > MAX_PART_BYTES:
        raise ValueError(f"{path.parent.name}/{path.name} is over {MAX_PART_BYTES:,} bytes, far more than a "
                         "part's cell: it is not a part's module; run the part's %%part cell again")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path.parent.name}/{path.name} is not UTF-8 text ({error.reason} at byte "
                         f"{error.start}): run the part's %%part cell again") from None


def import_failure(path: Path, error: BaseException) -> str:
    """The table's line for a module that raised `error` at import (a SyntaxError names its line)."""
    where = (f" ({Path(error.filename).name}, line {error.lineno})"
             if isinstance(error, SyntaxError) and error.filename else "")
    said = str(getattr(error, "msg", error))
    return f"importing {path.name} raised {type(error).__name__}{': ' + said if said else ''}{where}"


def defined(impl):
    """What a module defined to make `impl`: a Triton kernel's function (`@triton.jit` wraps it), else `impl`."""
    return impl.fn if type(impl).__module__.startswith("triton.") and callable(getattr(impl, "fn", None)) else impl


def not_its_own(impl, module, attribute: str, path: Path) -> str | None:
    """Why `impl` (the module's `attribute`) is not a class or function the module defines, or None."""
    if impl is None:
        return f"{path.name} defines no {attribute}"
    impl = defined(impl)
    owner = getattr(impl, "__module__", None)
    if owner != module.__name__:
        what = f"{owner}.{impl.__qualname__}" if owner and hasattr(impl, "__qualname__") else type(impl).__name__
        return f"{attribute} in {path.name} is {what}, not a class or function {path.name} defines"
    return None


# (part, attribute, sha-256 of its module's text) -> (passed, note, checked __qualname__): the verdicts
# of the gather_parts or earlier_part call running, which `earlier_part` inside a part's module reuses.
_verdicts: dict[tuple, tuple[bool, str, str]] | None = None


@contextlib.contextmanager
def gather_verdicts():
    """The verdicts of the call running, or new ones for this call."""
    global _verdicts
    if _verdicts is not None:
        yield _verdicts
        return
    _verdicts = {}
    try:
        yield _verdicts
    finally:
        _verdicts = None


# What ends a process by a signal, and what in a learner's part usually causes it.
SIGNAL_CAUSES = {
    "SIGSEGV": "a read or write outside the process's memory: in a part, usually native code given a bad address, "
               "a Triton kernel's pointer outside its tensors run where kvlearn's address checks do not watch",
    "SIGBUS": "a read of memory that is mapped but cannot be read, e.g. a file that shrank under it",
    "SIGABRT": "native code aborted (a failed check inside a C++ library, or memory it found corrupted)",
    "SIGFPE": "an integer division by zero in native code",
    "SIGKILL": "killed from outside: most often the system, out of memory (a part that allocates without end)",
}


def ended(status: str) -> str:
    """A process's exit status in words: "exit status 3", or a signal by name with its usual cause."""
    if not status.lstrip("-").isdigit() or int(status) >= 0:
        return f"exit status {status}"
    try:
        name = signal.Signals(-int(status)).name
    except ValueError:
        return f"signal {-int(status)}"
    cause = SIGNAL_CAUSES.get(name)
    return f"signal {-int(status)}, {name}" + (f": {cause}" if cause else "")


class Zygote:
    """Checks of parts, each in a fresh process: a fork of a clean Python, the zygote, that has
    imported the check and never runs a part's code. A fork costs milliseconds where a new Python
    costs seconds (torch), and it shares nothing with the part checked before. One zygote serves
    the process (started at the first check, stopped at exit); one check at a time."""

    _running: Zygote | None = None

    @classmethod
    def get(cls) -> Zygote:
        if cls._running is None or cls._running.process.poll() is not None:
            cls._running = cls()
            atexit.register(cls._running.close)
        return cls._running

    def __init__(self):
        import kvlearn

        self.nested = CHAIN_VARIABLE in os.environ   # inside a check's process: killed with it
        self.lock = threading.Lock()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(kvlearn.__file__).parent.parent),
                                                           *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-c",
             "import kvlearn.exercises.parts   # a part's module imports it (earlier_part)\n"
             "from kvlearn.exercises.part_modules import serve_zygote; serve_zygote()"],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
            start_new_session=not self.nested)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pass_on, args=(self.process.stdout, self.lines), daemon=True).start()
        try:
            self.ready = self.lines.get(timeout=STARTUP_LIMIT_S) == "ready"
        except queue.Empty:
            self.ready = False
        if not self.ready:
            self.close()

    def check(self, name: str, attribute: str, folder: Path, text: str,
              import_limit_s: float) -> tuple[bool, str, str]:
        """Import `text` as folder/name.py and check its `attribute` in a fork of the zygote (run in the
        folder's parent): (passed, the note for the table, the checked object's __qualname__). The
        fork is killed after `import_limit_s` to import the module, or twice CHECK_LIMIT_S and a
        minute to check it; whatever it does, it changes nothing here."""
        with self.lock:
            self.pid = None
            try:
                return self._check(name, attribute, folder, text, import_limit_s)
            except BaseException:   # a Ctrl-C meanwhile: the fork and the zygote go, the next check starts anew
                self._kill(self.pid)
                self.close()
                raise

    def _check(self, name: str, attribute: str, folder: Path, text: str,
               import_limit_s: float) -> tuple[bool, str, str]:
        path = part_path(name, folder)
        if not self.ready:
            return False, f"starting Python for the check failed or took over {STARTUP_LIMIT_S:g} s", ""
        job = {"name": name, "attribute": attribute, "folder": str(folder), "text": text, "limit_s": import_limit_s,
               "chain": building_chain(), "known": [[*k, *v] for k, v in (_verdicts or {}).items()]}
        self.stderr.seek(0, os.SEEK_END)
        said_from = self.stderr.tell()
        try:
            self.process.stdin.write((json.dumps(job) + "\n").encode("utf-8"))
            self.process.stdin.flush()
        except OSError:   # the zygote ended: start another next time
            self._stop(None)
            return False, f"the check's Python ended before importing {path.name}", ""
        doing, limit, pid, verdict = f"importing {path.name}", import_limit_s, None, None
        deadline = time.monotonic() + limit
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._stop(pid)
                return False, (f"{doing} did not finish within {limit:g} s (a loop or a wait at import? a "
                               "part's module only defines its class)"), ""
            if line is None:   # the zygote ended: a part cannot do that, but say so and start another next time
                self._stop(None)
                return False, f"the check's Python ended while {doing}", ""
            word, _, rest = line.partition(" ")
            if word == "pid" and pid is None and rest.isdigit():
                pid = self.pid = int(rest)
            elif word == "imported" and verdict is None:
                doing, limit = f"checking {attribute}", 2 * CHECK_LIMIT_S + 60
                deadline = time.monotonic() + limit
            elif word == "result" and verdict is None:
                verdict = _verdict(rest, path)
            elif word == "end" and pid is not None:
                if verdict is not None:
                    return verdict
                self.stderr.seek(said_from)
                said = self.stderr.read().decode("utf-8", "replace").strip().splitlines()
                return False, (f"Python ended ({ended(rest)}) while {doing}, with no verdict"
                               + (f": {said[-1][-200:]}" if said else "")), ""
            else:
                verdict = (False, f"while checking {path.name}, its process said {line[:80]!r}: a part writes "
                                  "only to files it opened", "")

    def _kill(self, pid: int | None) -> None:
        """Kill the fork `pid` with whatever it started (its process group)."""
        if pid is not None:
            if not self.nested:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _stop(self, pid: int | None) -> None:
        """Kill the fork `pid`, then wait for the zygote to say it ended; without a pid, or if the
        zygote does not say so, stop the zygote itself."""
        if pid is not None:
            self._kill(pid)
            with contextlib.suppress(queue.Empty):
                while (line := self.lines.get(timeout=30)) is not None:
                    if line.startswith("end "):
                        return
        self.close()

    def close(self) -> None:
        self.ready = False
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process.stdin.close()
        self.stderr.close()


def _pass_on(stream, lines: queue.Queue) -> None:
    """Put each line read from `stream` on `lines`, then None at its end."""
    for line in stream:
        lines.put(line.decode("utf-8", "replace").rstrip("\n"))
    lines.put(None)


def _verdict(said: str, path: Path) -> tuple[bool, str, str]:
    """(passed, note, qualname) from the JSON a check's process said."""
    try:
        passed, note, checked = json.loads(said)
        if isinstance(passed, bool) and isinstance(note, str) and isinstance(checked, str):
            return passed, note, checked
    except (ValueError, TypeError):   # not JSON, or not three values
        pass
    return (False, f"while checking {path.name}, its process said {said[:80]!r}: a part writes only to files it "
                   "opened", "")


def serve_zygote() -> None:
    """The clean Python of `Zygote`: imports the check, says "ready", then for each job (a JSON
    line on stdin) forks a process that runs it (`_check_job`), says "pid N", waits for it and says
    "end STATUS". Nothing but the forks runs a part's code."""
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)

    def say(line: str) -> None:
        channel.write(line + "\n")
        channel.flush()

    from kvlearn.kernels import interpret_here

    interpret_here()   # the decode kernel's check, in Triton's interpreter where there is no GPU
    import kvlearn.parts.conformance  # noqa: F401  (the check, loaded once for every fork)

    say("ready")
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                _check_job(job, say)
            except BaseException:   # a kvlearn bug: its traceback goes to the zygote's stderr
                sys.excepthook(*sys.exc_info())
            finally:
                os._exit(1)
        say(f"pid {pid}")
        say(f"end {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}")


def _check_job(job: dict, say) -> None:
    """In a fork of the zygote: import the job's module text as folder/name.py, check its attribute
    and say "imported", then "result [passed, note, qualname]"; the part's own output goes nowhere.
    The check is taken before the module runs; a module that changes kvlearn or torch (the check's
    code) or rebinds its part during the check fails, whatever the check said."""
    global _verdicts
    if CHAIN_VARIABLE not in os.environ:   # (else it stays in the group of the check that asked)
        os.setpgid(0, 0)   # a group of its own: killing it kills what the part started
    cpu_s = math.ceil(job["limit_s"] + 2 * CHECK_LIMIT_S + 60)   # even if nobody is left to kill it
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)   # the next jobs are the zygote's to read
    sys.stdin = open(os.devnull)
    os.environ[CHAIN_VARIABLE] = ",".join(job["chain"])
    _verdicts = {tuple(k[:3]): tuple(k[3:]) for k in job["known"]}   # for earlier_part in the module
    name, attribute, folder = job["name"], job["attribute"], Path(job["folder"])
    os.chdir(folder.parent)

    def result(passed: bool, note: str, checked: str = "") -> None:
        say("result " + json.dumps([passed, note, checked]))
        os._exit(0)   # threads the module started do not hold the process

    from kvlearn.parts.conformance import check

    machinery = _machinery()
    fresh_package(folder)
    path = part_path(name, folder)
    try:
        module = import_part(folder, name, job["text"])
    except BaseException as error:   # SystemExit and KeyboardInterrupt too: the module raised them
        result(False, import_failure(path, error))
    say("imported")
    impl = getattr(module, attribute, None)
    problem = not_its_own(impl, module, attribute, path)
    if problem:
        result(False, problem)
    try:
        report = check(name, impl, time_limit_s=CHECK_LIMIT_S)
    except BaseException as error:
        result(False, f"checking {attribute} raised {type(error).__name__}: {error}")
    changed = [label for label, owner, key, value in machinery if vars(owner).get(key) is not value]
    if changed:
        result(False, f"{path.name} changed {', '.join(changed[:3])}: a part may not change kvlearn or torch")
    if getattr(module, attribute, None) is not impl:
        result(False, f"{path.name} rebound {attribute} while it was checked: the part is the class it defines")
    result(report.passed, report.message.splitlines()[0].removeprefix(NOT_YET).strip(), defined(impl).__qualname__)


def _machinery() -> list[tuple[str, object, str, object]]:
    """(label, owner, key, value) for every function, class and module that torch and kvlearn's loaded
    modules hold, and every method and property of their classes: what a part's module must leave."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module_name not in ("torch", "kvlearn") and not module_name.startswith("kvlearn."):
            continue
        for key, value in list(vars(module).items()):
            if not (callable(value) or inspect.ismodule(value)):
                continue
            found.append((f"{module_name}.{key}", module, key, value))
            if inspect.isclass(value) and value.__module__ == module_name:
                found += [(f"{module_name}.{key}.{member}", value, member, attr) for member, attr in vars(value).items()
                          if callable(attr) or isinstance(attr, (property, classmethod, staticmethod))]
    return found
