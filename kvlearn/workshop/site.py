"""The course as a static site: `python -m kvlearn.workshop.site` (what `make site` runs).

The site is built from what is committed, offline, and never executes a notebook. First the Sphinx
sources are staged (in build/site/src/), then Sphinx with docs/site/conf.py writes site/:

- index.md: the README's opening (what the course is), its two commands and its chapter table
  (each notebook linked to its page), and the engine map that opens every chapter (chapter 0's,
  without its `>>` mark);
- chapters/NN_name.ipynb: each notebook with its committed outputs, less its widget views (only a
  kernel draws them: each becomes a line pointing at the cells around it, which show its steps) and the widget
  state (which would make the page load the widget scripts from the network); under its title, links
  to download its two notebooks;
- glossary.md: docs/glossary.md with a label before each entry, which the chapters' pages link to;
- instructor.md: docs/instructor.md;
- parts.md: "Check your parts", written from `kvlearn.exercises.parts.BUILD` and the conformance
  suites (`kvlearn.parts.conformance.SUITES`), so it says what the checker does today;
- extra/figures/: figures/ as committed, copied into the site, where each `figures/NAME` the
  pages name in code links to it (the guide lists the figures to project);
- extra/notebooks/ and extra/student/: each chapter's notebook to download, as a clone lays them
  out: the instructor copy (the committed notebook, byte for byte) and the student copy (written by
  `kvlearn.workshop.student`, the rule of `make student`). The chapter pages and "Check your parts"
  link to them.

The text helpers (glossary entries, the words that link to them, the engine map's lines) are used
by docs/site/conf.py too, which links the chapters' words to the glossary at build time.
"""

from __future__ import annotations

import argparse
import inspect
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from html import escape
from pathlib import Path

import nbformat

from kvlearn.workshop.student import write_student_copies

ROOT = Path(__file__).resolve().parents[2]   # the clone this module is in (an editable install)
CONF_DIR = Path("docs") / "site"
EXTRA = "extra"   # staged files the site carries as they are: figures/ (the guide names them to project)
DOWNLOADS = {"notebooks": "instructor copy", "student": "student copy"}   # the site's folder of each copy
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ("*In Jupyter a slider here steps through the run (a widget: only a running kernel draws it); "
               "on this page the cells around it show its steps as pictures or text.*")
MAP_LINE = re.compile(r"^(?P<mark>>>|  )(?P<indent> +)(?P<name>\S.*?) \.{3,} ch\. (?P<chapter>\d+)(?P<rest>.*)$")


# --- the glossary --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One glossary entry: `label` (the page's anchor, `term-<first word>`) and the `words` that link
    to it (the bold term or terms it opens with)."""

    label: str
    words: tuple[str, ...]


ENTRY = re.compile(r"^(?:\(term-[\w-]+\)=\n)?\*\*(?P<term>[^*]+)\*\*(?: \(\*\*(?P<alias>[^*]+)\*\*)?")


def glossary_entries(text: str) -> list[Entry]:
    """Every entry of docs/glossary.md: a paragraph that opens with its term in bold (`**slot** (ch. 1,
    4). ...`; `**a / b**` names two words; `**floor** (**unique-token floor**, ...)` an alias), with
    or without the label line `label_glossary` puts before it."""
    entries = []
    for paragraph in re.split(r"\n\s*\n", text):
        found = ENTRY.match(paragraph.strip())
        if found:
            words = [w.strip() for w in found["term"].split(" / ")] + ([found["alias"]] if found["alias"] else [])
            entries.append(Entry("term-" + re.sub(r"[^a-z0-9]+", "-", words[0].lower()).strip("-"), tuple(words)))
    if not entries:
        raise ValueError("glossary: no entry (a paragraph that opens with its **term**)")
    labels = [e.label for e in entries]
    duplicated = sorted({label for label in labels if labels.count(label) > 1})
    if duplicated:
        raise ValueError(f"glossary: two entries open with the same term ({', '.join(duplicated)}); "
                         "give each word one entry")
    return entries


def label_glossary(text: str) -> str:
    """docs/glossary.md with a MyST label line `(term-...)=` before each entry."""
    entries = iter(glossary_entries(text))
    return "\n\n".join(f"({next(entries).label})=\n{p}" if ENTRY.match(p.strip()) else p
                       for p in re.split(r"\n\s*\n", text))


def words_pattern(entries: list[Entry]) -> re.Pattern:
    """One pattern for every entry's words, longest first (so "block table" wins over "block"), whole
    words only, a plural `s`/`es` allowed, any case. A match's `lastgroup` is `e<i>_<k>`: the word
    belongs to `entries[i]`."""
    words = sorted(((w, f"e{i}_{k}") for i, e in enumerate(entries) for k, w in enumerate(e.words)),
                   key=lambda pair: len(pair[0]), reverse=True)
    alternatives = "|".join(f"(?P<{group}>{re.escape(word)}(?:e?s)?)" for word, group in words)
    return re.compile(rf"(?<![\w-])(?:{alternatives})(?![\w-])", re.IGNORECASE)


def entry_of(found: re.Match, entries: list[Entry]) -> Entry:
    """The entry whose word `words_pattern(entries)` found."""
    return entries[int(found.lastgroup[1:].split("_")[0])]


# --- the engine map ------------------------------------------------------------------------------

def is_engine_map(text: str) -> bool:
    """Whether a code block is the engine map: at least five `name ..... ch. N` lines."""
    return sum(bool(MAP_LINE.match(line)) for line in text.splitlines()) >= 5


def engine_map(nb: nbformat.NotebookNode) -> str:
    """The engine map in the chapter's opening cells (the ```text block whose lines name a chapter each)."""
    for cell in nb.cells[:3]:
        for block in re.findall(r"```text\n(.*?)```", cell.source, re.DOTALL):
            if is_engine_map(block):
                return block
    raise ValueError("no engine map (a ```text block of `name ..... ch. N` lines) in the chapter's first cells")


def unmarked(block: str) -> str:
    """The map without the `>>` that marks the chapter's own lines."""
    return "\n".join("  " + line[2:] if line.startswith(">>") else line for line in block.splitlines()) + "\n"


# --- the pages -----------------------------------------------------------------------------------

class Sections(dict):
    """The README's sections by heading; a missing one is a ValueError that names it."""

    def __missing__(self, heading: str) -> str:
        raise ValueError(f"README.md has no section '## {heading}': the site's landing page is made from it")


def readme_sections(text: str) -> Sections:
    """The README's `## ` sections by heading; "" is the text before the first one (title removed)."""
    sections, heading, lines = Sections(), "", []
    for line in text.splitlines():
        if line.startswith("## "):
            sections[heading], heading, lines = "\n".join(lines).strip() + "\n", line[3:].strip(), []
        elif not line.startswith("# "):
            lines.append(line)
    sections[heading] = "\n".join(lines).strip() + "\n"
    return sections


def chapter_title(nb: nbformat.NotebookNode) -> str:
    """The notebook's `# ` heading: the page's title."""
    found = re.match(r"#\s+(.+)", nb.cells[0].source.strip())
    if not found:
        raise ValueError("the chapter's first cell does not open with a `# ` title")
    return found[1].strip()


def chapter_table(readme: str, titles: dict[str, str]) -> str:
    """The README's chapter table, its notebook column replaced by a link to each chapter's page."""
    section = readme_sections(readme)["Opening the notebooks"]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    out = rows[:2]
    for row in rows[2:]:
        cells = row.split(" | ")
        name = re.search(r"`(\d\d_\w+)`", cells[1])
        if name is None or name[1] not in titles:
            raise ValueError(f"README's chapter table: no notebook in the row {row[:60]!r}")
        cells[1] = f"[{titles[name[1]]}](chapters/{name[1]}.ipynb)"
        out.append(" | ".join(cells))
    return "\n".join(out) + "\n"


def landing_page(readme: str, chapters: dict[str, nbformat.NotebookNode]) -> str:
    """index.md: the README's opening, its two commands and chapter table, and the engine map."""
    sections = readme_sections(readme)
    intro = (sections[""].replace("](docs/glossary.md)", "](glossary.md)")
             .replace("[docs/glossary.md]", "[the glossary]"))
    commands = re.search(r"```bash\n.*?```", sections["The two commands"], re.DOTALL)
    if commands is None:
        raise ValueError("README.md's '## The two commands' has no ```bash block: the landing page shows it")
    titles = {name: chapter_title(nb) for name, nb in chapters.items()}
    first = next(iter(chapters.values()))
    toc = "\n".join(f"chapters/{name}" for name in chapters)
    return f"""# kvlearn

{intro}
## The two commands

In a clone of the repository (Python >= 3.11, `make`, and the package index once; after that,
everything runs offline):

{commands[0]}

`make notebooks` opens the chapters in JupyterLab. This site shows the same notebooks with the
outputs they were committed with; nothing here runs code or loads anything from the network.

## The chapters

{chapter_table(readme, titles)}
Each chapter opens with this map of the engine, its own lines marked `>>`; the words link to the
[glossary](glossary.md), the chapter numbers to the chapters:

```text
{unmarked(engine_map(first))}```

Besides the chapters: the [glossary](glossary.md), [Check your parts](parts.md) (each build
exercise, its contract and how it is checked) and the [instructor guide](instructor.md).

```{{toctree}}
:caption: Chapters
:hidden:
:maxdepth: 1

{toc}
```

```{{toctree}}
:caption: Reference
:hidden:

glossary
parts
```

```{{toctree}}
:caption: Teaching
:hidden:

instructor
```
"""


def parts_page(chapters: list[str]) -> str:
    """"Check your parts": per build exercise, its %%part cell, its chapter's notebooks to download,
    contract, what the check judges and the command, all read from the code that checks it.
    `chapters`: the notebooks' names in order."""
    from kvlearn.exercises.parts import BUILD, FOLDER
    from kvlearn.parts.conformance import SUITES, contract_members

    lines = ["# Check your parts", "",
             "Chapters 1 to 6, and chapter 10's optional module, each end with a *build exercise*: you write one "
             "part of the engine in a cell that "
             "starts with `%%part NAME`. The cell runs as usual and is also saved as "
             f"`{FOLDER}/NAME.py` beside the notebooks; `check_part(NAME, impl)` runs that part's conformance "
             "suite (random programs, each call judged against a reference, never against your own checks) and "
             "prints `OK` or `Not yet` with the shortest failing program and a hint. Chapter 9 gathers the parts "
             "of chapters 1 to 6, checks each again and serves the model with the ones that pass; chapter 10's "
             "quantizer serves in its own chapter, with `kv_cache_dtype=\"int8\"`.", "",
             "From a shell, every part the chapters saved, checked again (one line each):", "",
             "```bash",
             ".venv/bin/python -c \"from kvlearn.exercises.parts import gather_parts, parts_table; "
             f"print(parts_table(gather_parts('notebooks/{FOLDER}')))\"",
             "```", "",
             "`make course` runs every chapter and prints the same table at the end.", ""]
    lines += ["| chapter | `%%part` | you write | contract |", "|---|---|---|---|"]
    for name, (chapter, attr) in BUILD.items():
        lines.append(f"| {chapter} | `{name}` | `{attr}` | `kvlearn.parts.{SUITES[name].contract.__name__}` |")
    for name, (chapter, attr) in BUILD.items():
        suite = SUITES[name]
        members = ", ".join(f"`{m}`" for m in contract_members(suite.contract))
        notebook = _chapter_file(chapter, chapters)
        lines += ["", f"## Chapter {chapter}: `{name}`", "",
                  f"In [chapter {chapter}](chapters/{notebook}.ipynb), the cell `%%part {name}` defines "
                  f"`{attr}`; it is saved as `{FOLDER}/{name}.py`.", "", download_links(notebook), "",
                  "**The command**, in the chapter's notebook:", "", "```python",
                  f"check_part({name!r}, {attr})", "```", "",
                  f"**The contract**: `kvlearn.parts.{suite.contract.__name__}`, members {members}.", "",
                  _quoted(inspect.getdoc(suite.contract)), "",
                  f"**What `check_part` judges** (by {suite.judge}):", "",
                  _quoted(inspect.getdoc(suite.module))]
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return "\n".join("> " + line if line else ">" for line in text.splitlines())


def _chapter_file(chapter: int, chapters: list[str]) -> str:
    found = [name for name in chapters if name.startswith(f"{chapter:02d}_")]
    if len(found) != 1:
        raise ValueError(f"chapter {chapter}: expected one notebook named {chapter:02d}_*, found {found}")
    return found[0]


def download_links(name: str, up: str = "") -> str:
    """A paragraph of HTML linking chapter `name`'s two notebooks for download; `up` leads from the
    page to the site's root ("../" from chapters/)."""
    links = [f'<a class="kvlearn-download" href="{up}{folder}/{escape(name)}.ipynb" download>{what}</a>'
             for folder, what in DOWNLOADS.items()]
    return (f'<p class="kvlearn-downloads">Download the notebook: {links[0]} (worked solutions and outputs) or '
            f'{links[1]} (exercises left for you, as <code>make student</code> writes them)</p>')


def site_notebook(nb: nbformat.NotebookNode, name: str | None = None) -> nbformat.NotebookNode:
    """The chapter as the site shows it: each widget view replaced by a line saying where its static
    pictures are, the widget state dropped, and, given the chapter's `name`, its `download_links`
    under the title. Everything else, outputs included, unchanged."""
    nb = nbformat.from_dict(nb)   # a copy
    nb.metadata.pop("widgets", None)
    if name is not None:
        chapter_title(nb)   # the links go under the title line: there must be one
        title, _, rest = nb.cells[0].source.strip().partition("\n")
        nb.cells[0].source = f"{title}\n\n{download_links(name, '../')}\n\n{rest.lstrip()}"
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": WIDGET_NOTE})
                            if WIDGET_VIEW in out.get("data", {}) else out for out in cell.outputs]
    return nb


def stage(root: Path, dest: Path) -> list[str]:
    """Write the Sphinx sources into `dest` (emptied first); returns the chapters' names in order."""
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "chapters").mkdir(parents=True)
    chapters = {p.stem: nbformat.read(p, as_version=4) for p in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))}
    if not chapters:
        raise ValueError(f"no chapters in {root / 'notebooks'}: run from the repository's root")
    (dest / EXTRA / "notebooks").mkdir(parents=True)
    for name, nb in chapters.items():
        nbformat.write(site_notebook(nb, name), dest / "chapters" / f"{name}.ipynb")
        shutil.copyfile(root / "notebooks" / f"{name}.ipynb", dest / EXTRA / "notebooks" / f"{name}.ipynb")
    write_student_copies(root / "notebooks", dest / EXTRA / "student")
    readme = (root / "README.md").read_text()
    (dest / "index.md").write_text(landing_page(readme, chapters))
    (dest / "glossary.md").write_text(label_glossary((root / "docs" / "glossary.md").read_text()))
    shutil.copyfile(root / "docs" / "instructor.md", dest / "instructor.md")
    shutil.copytree(root / "figures", dest / EXTRA / "figures")
    (dest / "parts.md").write_text(parts_page(list(chapters)))
    return list(chapters)


def build(root: Path, out: Path, work: Path, jobs: str = "auto", strict: bool = False) -> Path:
    """Stage the sources in `work`/src, run Sphinx there and move the HTML to `out` (replaced); returns
    the landing page. `strict`: any Sphinx warning (a link that leads nowhere, an output it cannot
    show) fails the build. Raises ImportError (with the install command) when Sphinx is missing,
    RuntimeError with Sphinx's output when it fails; `out` is then left as it was."""
    try:
        import myst_nb  # noqa: F401
        import sphinx  # noqa: F401  (only to say what is missing before Sphinx starts)
    except ImportError as missing:
        raise ImportError(f"{missing.name} is not installed (`make site` and `make thorough` install "
                          "requirements-site.txt; else: .venv/bin/pip install -r requirements-site.txt)") from missing
    html = work / "html"   # MyST-NB writes its own files beside the HTML folder: here, inside `work`
    stage(root, work / "src")
    shutil.rmtree(html, ignore_errors=True)
    command = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-j", jobs, "-E",
               *(["-W", "--keep-going"] if strict else []),
               "-c", str(root / CONF_DIR), "-d", str(work / "doctrees"), str(work / "src"), str(html)]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sphinx-build failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    if done.stderr.strip():
        print(done.stderr.strip(), file=sys.stderr)   # Sphinx's warnings
    shutil.rmtree(out, ignore_errors=True)
    shutil.move(html, out)
    return out / "index.html"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlearn.workshop.site", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="site", help="where the HTML goes (default: site)")
    parser.add_argument("--work", default="build/site", help="where the sources are staged and built")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        index = build(ROOT, Path(args.out).resolve(), Path(args.work).resolve())
    except (ImportError, RuntimeError, ValueError) as failed:
        print(f"site: {failed}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in index.parent.rglob("*") if p.is_file())
    print(f"site built in {time.monotonic() - start:.0f} s, {size / 2**20:.1f} MB: open {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
