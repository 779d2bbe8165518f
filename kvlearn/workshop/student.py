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
    Nothing is written if any notebook has a marker error. Nothing else needs copying: notebooks
    write figures through `kvlearn.viz.plots.figures_dir()` (the nearest figures/ folder up the tree),
    and their markdown links to `../figures/` resolve as long as `dest` sits next to `src`, as student/ does."""
    src, dest = Path(src), Path(dest)
    if dest.resolve() == src.resolve():
        raise ValueError(f"dest is src ({src}): student copies would overwrite the instructor notebooks.")
    paths = sorted(src.glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no notebooks named [0-9][0-9]_*.ipynb in {src}/")
    copies = {}
    for path in paths:
        try:
            copies[dest / path.name] = student_copy(nbformat.read(path, as_version=4))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    dest.mkdir(parents=True, exist_ok=True)
    for path, nb in copies.items():
        nbformat.write(nb, path)
    return list(copies)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlearn student",
                                     description="Write the student copies: every solution becomes a stub.")
    parser.add_argument("--src", default="notebooks", help="the instructor notebooks (default notebooks/)")
    parser.add_argument("--dest", default="student", help="where the student copies go (default student/)")
    args = parser.parse_args(argv)
    for path in write_student_copies(args.src, args.dest):
        print(path)
    return 0
