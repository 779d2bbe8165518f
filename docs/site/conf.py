"""Sphinx configuration of the course's site (`make site`; the sources are staged by
kvlearn/workshop/site.py, which passes this folder as the configuration directory).

Offline to read: no page loads anything from the network. The notebooks carry no math, the widget
state is dropped when they are staged (so MyST-NB adds no require.js or widget scripts from a CDN),
the theme's fonts and icons are its own files, and nothing else is configured to load.

At build time the chapters' words are linked to the glossary: in each chapter, the first use of
each glossary word (outside code, titles and links) links to its entry, and the engine map that
opens the chapter links each part's words to the glossary and each `ch. N` to chapter N. In every
page, code that names `docs/glossary.md` or `docs/instructor.md` links to that page, and code that
names a file of figures/ links to the site's copy of it. Each chapter's two notebooks (instructor
and student copy), staged in extra/ with the figures, are copied into the site as they are.
"""

import sys
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms import SphinxTransform

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: kvlearn.workshop.site

from kvlearn.workshop.site import EXTRA, MAP_LINE, entry_of, glossary_entries, is_engine_map, words_pattern  # noqa: E402

project = "kvlearn"
author = "the kvlearn authors"
copyright = "the kvlearn authors"
html_title = "kvlearn: the KV cache, chapter by chapter"

extensions = ["myst_nb"]
nb_execution_mode = "off"          # the committed outputs, never re-executed
nb_ipywidgets_js = {}              # never the widget scripts from a CDN (the views are gone anyway)
nb_merge_streams = True
myst_heading_anchors = 3
exclude_patterns = ["**/.ipynb_checkpoints", EXTRA]

html_theme = "sphinx_book_theme"
html_theme_options = {
    "use_download_button": False,  # it would offer the staged page's source; each chapter links its two notebooks
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "home_page_in_toc": True,
}
html_context = {"default_mode": "light"}   # else the theme logs an error for an unset mode
html_favicon = "_static/favicon.svg"   # else the browser asks for /favicon.ico and logs its 404
html_static_path = ["_static"]
html_css_files = ["kvlearn.css"]
html_copy_source = False           # the notebooks are in the repository; the site stays small
html_show_sourcelink = False
html_last_updated_fmt = None

# The repository's Markdown files the pages name in code (`docs/glossary.md`): linked to their pages.
PAGES = {"docs/glossary.md": "/glossary", "docs/instructor.md": "/instructor"}

# Where no link is added: code, titles, existing links, raw output, and the cells' outputs.
SKIP = (nodes.literal, nodes.literal_block, nodes.title, nodes.reference, nodes.raw, nodes.target,
        nodes.FixedTextElement, addnodes.pending_xref, nodes.rubric)


def _chapters(env) -> dict[int, str]:
    """Chapter number -> its document name (chapters/NN_name)."""
    return {int(doc.split("/")[1][:2]): doc for doc in env.found_docs if doc.startswith("chapters/")}


def _entries(env):
    if not hasattr(env, "kvlearn_glossary"):
        entries = glossary_entries((Path(env.srcdir) / "glossary.md").read_text())
        env.kvlearn_glossary = (entries, words_pattern(entries))
    return env.kvlearn_glossary


def _xref(target: str, reftype: str, text: str, literal: bool = False) -> addnodes.pending_xref:
    """A link to a label (`reftype` "ref") or a document ("doc"), showing `text` (as code if `literal`)."""
    ref = addnodes.pending_xref("", refdomain="std", reftype=reftype, reftarget=target, refexplicit=True,
                                refwarn=True)
    ref += (nodes.literal if literal else nodes.inline)(text, text,
                                                        classes=["kvlearn-glossary"] if reftype == "ref" else [])
    return ref


def _linked(text: str, entries, pattern, used: set | None) -> list[nodes.Node]:
    """`text` as nodes, each glossary word linked (only its first use when `used` is a set)."""
    out, last = [], 0
    for found in pattern.finditer(text):
        entry = entry_of(found, entries)
        if used is not None:
            if entry.label in used:
                continue
            used.add(entry.label)
        out += [nodes.Text(text[last:found.start()]), _xref(entry.label, "ref", found[0])]
        last = found.end()
    return out + [nodes.Text(text[last:])] if out else [nodes.Text(text)]


class GlossaryLinks(SphinxTransform):
    """In the chapters and the landing page: the engine map's words and chapter numbers linked; in
    the chapters, the first use of each glossary word linked to its entry."""

    default_priority = 500

    def apply(self, **kwargs) -> None:
        doc = self.env.docname
        self._link_files(doc)
        if not (doc.startswith("chapters/") or doc == "index"):
            return
        entries, pattern = _entries(self.env)
        chapters = _chapters(self.env)
        for block in list(self.document.findall(nodes.literal_block)):
            if is_engine_map(block.astext()):
                block.replace_self(self._map(block.astext().splitlines(), entries, pattern, chapters))
        if not doc.startswith("chapters/"):
            return
        used: set = set()
        for text in list(self.document.findall(nodes.Text)):
            parent = text.parent
            if any(isinstance(a, SKIP) for a in _ancestors(text)) or "cell_output" in _classes(text):
                continue
            linked = _linked(str(text), entries, pattern, used)
            if len(linked) > 1:
                index = parent.index(text)
                parent.remove(text)
                for offset, node in enumerate(linked):
                    parent.insert(index + offset, node)

    def _link_files(self, doc: str) -> None:
        """In every page, code that names a page of the site (`docs/glossary.md`) or a file of figures/
        (`figures/ch3_steps.png`, copied into the site) becomes a link to it."""
        extra = Path(self.env.srcdir) / EXTRA
        for literal in list(self.document.findall(nodes.literal)):
            text = literal.astext()
            if any(isinstance(a, (nodes.reference, addnodes.pending_xref)) for a in _ancestors(literal)):
                continue
            if text in PAGES:
                literal.replace_self(_xref(PAGES[text], "doc", text, literal=True))
            elif text.startswith("figures/") and (extra / text).is_file():
                literal.replace_self(nodes.reference("", "", nodes.literal(text, text),
                                                     refuri="../" * doc.count("/") + text))

    def _map(self, lines, entries, pattern, chapters) -> nodes.literal_block:
        """The map as a parsed literal block: each line's name linked to the glossary, `ch. N` to chapter
        N, and the first glossary word of the descriptions (one slot per token) to its entry."""
        # rawsource "" (not the text): Sphinx then writes the children, links included, unhighlighted.
        new, used = nodes.literal_block("", "", classes=["kvlearn-engine-map"]), set()
        for line in lines:
            found = MAP_LINE.match(line)
            if not found:
                new += nodes.Text(line + "\n")
                continue
            chapter = int(found["chapter"])
            new += nodes.Text(found["mark"] + found["indent"])
            new += _linked(found["name"], entries, pattern, None)
            dots = line[found.end("name"):found.start("chapter")]   # " ..... ch. "
            new += nodes.Text(dots[:-len("ch. ")])
            label = f"ch. {chapter}"
            new += _xref("/" + chapters[chapter], "doc", label) if chapter in chapters else nodes.Text(label)
            new += _linked(found["rest"] + "\n", entries, pattern, used)
        return new


def _ancestors(node):
    node = node.parent
    while node is not None:
        yield node
        node = node.parent


def _classes(node) -> set:
    return {c for a in _ancestors(node) for c in a.get("classes", [])} if node.parent is not None else set()


def _extra_files(app) -> None:
    """What kvlearn.workshop.site staged in EXTRA (figures/, the notebooks to download) is copied
    into the site as it is."""
    app.config.html_extra_path = [str(Path(app.srcdir) / EXTRA)]


def setup(app):
    app.connect("builder-inited", _extra_files)
    app.add_transform(GlossaryLinks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
