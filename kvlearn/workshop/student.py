"""Student copies of the notebooks. The committed notebooks are the instructor version: every
exercise holds a worked solution between `### BEGIN SOLUTION` and `### END SOLUTION` lines. A student
copy replaces each such block, markers included, by a stub:

- an indented block (a function body) becomes `<indent>...  # your code here`: the function returns
  None, and the checker answers "Not yet" with its hint;
- a top-level block may hold only assignments `name = value`; each becomes
  `name = ...  # your answer here`, and the checker answers "Not yet" to `...`.

A student copy shows nothing a solution produced. A code cell is *solved*, and loses its outputs and
execution count, when
- it holds a solution block, or is a build exercise (`%%part NAME`), or
- it calls one of SOLVED_CALLS (`check_part`, `use`, `earlier_part`, `gather`, `gather_parts`: what
  they print depends on the learner's part), or
- it reads a name that a solved cell bound (by assignment, `def`, `class`, a loop variable; not by
  an import) and that no cell bound anew since (an unsolved cell's binding, or any import, frees
  the name); calling a function counts as reading the names its body reads, so a function defined
  earlier does not hide a solved name.
Cells are read in order with `ast` (magic lines left out), so this is transitive: a cell that
reads MyRadixCache is solved, and so is every cell that reads what it computed. Not followed: a
solved cell that only changes an object an unsolved cell made (a method call on it); the notebooks
keep what a solved cell computes in names of its own (tests/test_student.py checks the copies
against names listed by hand). Every other cell (markdown, code, outputs) is copied unchanged.
`python -m kvlearn student` writes the copies to student/, with student/figures/ where their cells
write figures (never the course's figures/).
"""

import argparse
import ast
import copy
import os
import sys
import tempfile
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
PART_MAGIC = "%%part"
SOLVED_CALLS = frozenset({"check_part", "use", "earlier_part", "gather", "gather_parts"})


def student_copy(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The student version of `nb` (which is not modified). Raises ValueError, naming the cell
    (counted from 1), for a marker without its partner, nested markers, a top-level solution
    block that is not simple assignments, or a code cell that is not Python."""
    nb = copy.deepcopy(nb)
    solved = solved_cells(nb)
    for number, cell in enumerate(nb.cells, 1):
        if cell.cell_type == "code" and (BEGIN in cell.source or END in cell.source):
            cell.source = _stub_solutions(cell.source, f"cell {number}")
        if number in solved:
            cell.outputs, cell.execution_count = [], None
    return nb


def solved_cells(nb: nbformat.NotebookNode) -> list[int]:
    """The numbers (from 1) of the code cells of `nb` whose outputs depend on a solution, by the
    rule in the module docstring."""
    solved, tainted, bodies = [], set(), {}   # bodies: function or class -> the names its body reads
    for number, cell in enumerate(nb.cells, 1):
        if cell.cell_type != "code":
            continue
        names = _Names.of(cell.source, f"cell {number}")
        reads, todo = set(), list(names.reads)
        while todo:   # a call reads what the function's body reads
            name = todo.pop()
            if name not in reads:
                reads.add(name)
                todo += bodies.get(name, ())
        is_solved = (BEGIN in cell.source or END in cell.source or cell.source.startswith(PART_MAGIC)
                     or bool(names.calls & SOLVED_CALLS) or bool(reads & tainted))
        if is_solved:
            solved.append(number)
        for name, imported in names.bound.items():
            (tainted.add if is_solved and not imported else tainted.discard)(name)
            bodies.pop(name, None)
        bodies.update(names.bodies)
    return solved


class _Names(ast.NodeVisitor):
    """What one scope of a cell reads before binding it (`reads`), binds (`bound`: name -> bound by
    an import?), calls by name (`calls`), and what the body of each function or class it defines
    reads (`bodies`). Visits in evaluation order: a value before its targets, a loop's iterable
    before its variable."""

    def __init__(self, bound=()):
        self.reads, self.calls, self.bodies = set(), set(), {}
        self.bound = dict.fromkeys(bound, False)

    @classmethod
    def of(cls, source: str, cell: str) -> "_Names":
        python = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n"))
        try:
            tree = ast.parse(python)
        except SyntaxError as e:
            raise ValueError(f"{cell}: not Python (line {e.lineno}: {e.msg}); a student copy follows the names "
                             "each code cell reads, so every code cell must parse (magic lines aside).") from None
        names = cls()
        names.visit(tree)
        return names

    def bind(self, name, imported=False):
        self.bound.pop(name, None)   # the last binding is the one that counts
        self.bound[name] = imported
        self.bodies.pop(name, None)

    def scope(self, bound, *nodes) -> "_Names":
        """Visit `nodes` in a new scope where `bound` are bound; what it reads from outside, this reads."""
        inner = _Names(bound)
        for node in nodes:
            inner.visit(node)
        self.reads |= inner.reads - set(self.bound)
        self.calls |= inner.calls
        return inner

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Store):
            self.bind(node.id)
        elif isinstance(node.ctx, ast.Load) and node.id not in self.bound:
            self.reads.add(node.id)

    def visit_Call(self, node):
        func = node.func
        self.calls.add(getattr(func, "id", getattr(func, "attr", "")))   # f(...) or x.f(...)
        self.generic_visit(node)

    def visit_Assign(self, node):
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AugAssign(self, node):
        self.visit(node.value)
        if isinstance(node.target, ast.Name) and node.target.id not in self.bound:
            self.reads.add(node.target.id)
        self.visit(node.target)

    def visit_For(self, node):
        self.visit(node.iter)
        self.visit(node.target)
        for statement in node.body + node.orelse:
            self.visit(statement)

    visit_AsyncFor = visit_For

    def comprehension(self, node, *results):
        parts = [part for gen in node.generators for part in (gen.iter, gen.target, *gen.ifs)]
        self.scope((), *parts, *results)

    def visit_ListComp(self, node):
        self.comprehension(node, node.elt)

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node):
        self.comprehension(node, node.key, node.value)

    def function(self, node, body):
        arguments = node.args
        for default in arguments.defaults + [d for d in arguments.kw_defaults if d is not None]:
            self.visit(default)
        params = [a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs]
        params += [a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None]
        return self.scope(params, *body)

    def visit_Lambda(self, node):
        self.function(node, [node.body])

    def visit_FunctionDef(self, node):
        for decorator in node.decorator_list:
            self.visit(decorator)
        body = self.function(node, node.body)
        self.bind(node.name)
        self.bodies[node.name] = body.reads

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        for part in node.decorator_list + node.bases + node.keywords:
            self.visit(part)
        body = self.scope((), *node.body)
        self.bind(node.name)
        self.bodies[node.name] = body.reads

    def visit_Import(self, node):
        for alias in node.names:
            self.bind((alias.asname or alias.name).split(".")[0], imported=True)

    def visit_ImportFrom(self, node):
        for alias in node.names:
            if alias.name != "*":
                self.bind(alias.asname or alias.name, imported=True)

    def visit_ExceptHandler(self, node):
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bind(node.name)
        for statement in node.body:
            self.visit(statement)


def _stub_solutions(source: str, cell: str) -> str:
    out, block = [], None  # block: the lines of the open solution block, None outside one
    for line in source.split("\n"):
        marker = line.strip()
        if marker == BEGIN:
            if block is not None:
                raise ValueError(f"{cell}: nested '{BEGIN}'; close the first block with '{END}' first.")
            block, indent = [], line[:len(line) - len(line.lstrip())]
        elif marker == END:
            if block is None:
                raise ValueError(f"{cell}: '{END}' without a '{BEGIN}' before it.")
            out += _stub(block, indent, cell)
            block = None
        elif block is None:
            out.append(line)
        else:
            block.append(line)
    if block is not None:
        raise ValueError(f"{cell}: '{BEGIN}' without an '{END}' after it.")
    return "\n".join(out)


def _stub(block: list[str], indent: str, cell: str) -> list[str]:
    if indent:  # inside a function: an empty body, so it returns None
        return [f"{indent}...  # your code here"]
    statements = ast.parse("\n".join(block)).body
    names = [s.targets[0].id for s in statements
             if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)]
    if not statements or len(names) != len(statements):
        raise ValueError(f"{cell}: a top-level solution block may hold only assignments `name = value` (the "
                         "answers the checker receives); move other code into a function or outside the markers.")
    return [f"{name} = ...  # your answer here" for name in names]


def write_student_copies(src="notebooks", dest="student") -> list[Path]:
    """Write the student copy of every `[0-9][0-9]_*.ipynb` in `src` to `dest`, and `dest/figures/`
    (`copy_figures`); return the notebooks' paths. Nothing is written if any notebook has a marker
    error, or if `dest`, `dest/figures` or any copy's path is a symbolic link (dangling or not):
    writing through it could overwrite the instructor notebooks or a file anywhere. Each copy is
    written to a new file that then replaces the old one, so a hard link at that path is replaced,
    never written through."""
    src, dest = Path(src), Path(dest)
    if not src.is_dir():
        raise (NotADirectoryError if src.exists() else FileNotFoundError)(
            f"--src {src} is not a folder of notebooks: pass the folder that holds NN_*.ipynb (default notebooks/)")
    if dest.is_symlink():
        raise ValueError(f"--dest {dest} is a symbolic link: refusing to write student copies through it; "
                         "pass a plain folder")
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(f"--dest {dest} is a file, not a folder: remove it or pass another --dest")
    if dest.resolve() == src.resolve():
        raise ValueError(f"dest is src ({src}): student copies would overwrite the instructor notebooks.")
    paths = sorted(src.glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no notebooks named [0-9][0-9]_*.ipynb in {src}/")
    copies = {}
    for path in paths:
        if (dest / path.name).is_symlink():
            raise ValueError(f"{dest / path.name} is a symbolic link: refusing to write through it (it may point "
                             "at an instructor notebook); remove the link, then run again")
        try:
            copies[dest / path.name] = student_copy(nbformat.read(path, as_version=4))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    figures = dest / "figures"
    if figures.is_symlink():
        raise ValueError(f"{figures} is a symbolic link: refusing to write the copies' figures through it (it may "
                         "point at the course's figures/); remove the link, then run again")
    dest.mkdir(parents=True, exist_ok=True)
    for path, nb in copies.items():
        replace_file(path, nbformat.writes(nb) + "\n")
    copy_figures(src.resolve().parent / "figures", figures)
    return list(copies)


def copy_figures(course: Path, figures: Path) -> Path:
    """Make `figures` (student/figures/) a copy of the course's committed `course` folder. The copies'
    cells write their figures through `kvlearn.viz.plots.figures_dir()`, the nearest figures/ folder
    up from where they run: this one, so a learner's run never changes the course's tracked files,
    and a cell that shows a committed figure (chapter 6's bench plot) finds it here. Each file is
    written anew and renamed into place (a link there is replaced, never written through)."""
    figures.mkdir(exist_ok=True)
    for path in sorted(course.iterdir()) if course.is_dir() else []:
        if path.is_file() and not path.name.startswith("."):
            replace_file(figures / path.name, path.read_bytes())
    return figures


def replace_file(path: Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8) to a new file in `path`'s folder, then rename it over `path`
    (which is replaced itself, whatever it was: the rename never follows a link)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)  # mkstemp made it private
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlearn student",
                                     description="Write the student copies: every solution becomes a stub.")
    parser.add_argument("--src", default="notebooks", help="the instructor notebooks (default notebooks/)")
    parser.add_argument("--dest", default="student", help="where the student copies go (default student/)")
    args = parser.parse_args(argv)
    try:
        paths = write_student_copies(args.src, args.dest)
    except (OSError, ValueError) as err:
        print(f"python -m kvlearn student: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
