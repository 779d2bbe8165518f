"""Student copies of the notebooks. The committed notebooks are the instructor version: every
exercise holds a worked solution between `### BEGIN SOLUTION` and `### END SOLUTION` lines. A student
copy replaces each such block, markers included, by a stub:

- an indented block (a function body) becomes `<indent>...  # your code here`: the function returns
  None, and the checker answers "Not yet" with its hint;
- a top-level block may hold only assignments `name = value`; each becomes
  `name = ...  # your answer here`, and the checker answers "Not yet" to `...`.

Cells that held a solution lose their outputs and execution count; every other cell (markdown,
code, outputs) is copied unchanged. `python -m kvlearn student` writes the copies to student/.
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


def student_copy(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The student version of `nb` (which is not modified). Raises ValueError, naming the cell
    (counted from 1), for a marker without its partner, nested markers, or a top-level solution
    block that is not simple assignments."""
    nb = copy.deepcopy(nb)
    for number, cell in enumerate(nb.cells, 1):
        if cell.cell_type == "code" and (BEGIN in cell.source or END in cell.source):
            cell.source = _stub_solutions(cell.source, f"cell {number}")
            cell.outputs, cell.execution_count = [], None
    return nb


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
    """Write the student copy of every `[0-9][0-9]_*.ipynb` in `src` to `dest`; return the paths.
    Nothing is written if any notebook has a marker error, or if `dest` or any copy's path is a
    symbolic link (dangling or not): writing through it could overwrite the instructor notebooks or
    a file anywhere. Each copy is written to a new file that then replaces the old one, so a hard
    link at that path is replaced, never written through. Nothing else needs copying: notebooks
    write figures through `kvlearn.viz.plots.figures_dir()` (the nearest figures/ folder up the tree),
    and their markdown links to `../figures/` resolve as long as `dest` sits next to `src`, as student/ does."""
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
    dest.mkdir(parents=True, exist_ok=True)
    for path, nb in copies.items():
        replace_file(path, nbformat.writes(nb) + "\n")
    return list(copies)


def replace_file(path: Path, text: str) -> None:
    """Write `text` to a new file in `path`'s folder, then rename it over `path` (which is replaced
    itself, whatever it was: the rename never follows a link)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
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
