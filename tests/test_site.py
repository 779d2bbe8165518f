"""The course's static site (`make site`): what it is made of, and that no page loads anything from
the network. The pages are read from a build of this clone (the `built_site` fixture, once per
session; those tests are marked slow and skip, saying what to install, without Sphinx)."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from kvlearn.exercises.parts import BUILD
from kvlearn.parts.conformance import SUITES
from kvlearn.workshop.site import (
    DOWNLOADS,
    MAP_LINE,
    WIDGET_NOTE,
    WIDGET_VIEW,
    chapter_title,
    download_links,
    engine_map,
    entry_of,
    glossary_entries,
    label_glossary,
    landing_page,
    parts_page,
    site_notebook,
    stage,
    words_pattern,
)
from kvlearn.workshop.student import student_copy

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
GLOSSARY = (ROOT / "docs" / "glossary.md").read_text()
# A <link> with one of these rel values makes the browser fetch its href.
FETCHING_REL = {"stylesheet", "preload", "modulepreload", "prefetch", "icon", "manifest"}
NETWORK = re.compile(r"^\s*(?:https?:)?//", re.IGNORECASE)


class Loads(HTMLParser):
    """Every URL a page makes the browser fetch: src, srcset, and the href of a fetching <link>."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.urls += [attrs[a] for a in ("src", "data-src") if attrs.get(a)]
        self.urls += [part.split()[0] for part in (attrs.get("srcset") or "").split(",") if part.strip()]
        if tag == "link" and FETCHING_REL & set((attrs.get("rel") or "").lower().split()):
            self.urls.append(attrs.get("href") or "")


def css_urls(css: str) -> list[str]:
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.DOTALL)   # comments cite sources; they load nothing
    return re.findall(r"""url\(\s*['"]?([^'")]+)""", css) + re.findall(r"""@import\s+['"]([^'"]+)""", css)


@pytest.mark.thorough   # the build takes 20-40 s: `make thorough` (tests/README.md)
def test_no_page_loads_anything_from_the_network(built_site):
    pages = sorted(built_site.rglob("*.html"))
    assert len(pages) >= 14, f"only {len(pages)} pages in {built_site}"
    remote = []
    for page in pages:
        parser = Loads()
        html = page.read_text(errors="replace")
        parser.feed(html)
        inline_css = [u for block in re.findall(r"<style[^>]*>(.*?)</style>", html, re.DOTALL) for u in css_urls(block)]
        remote += [f"{page.relative_to(built_site)}: {url}" for url in parser.urls + inline_css if NETWORK.match(url)]
    for sheet in built_site.rglob("*.css"):
        remote += [f"{sheet.relative_to(built_site)}: {url}" for url in css_urls(sheet.read_text(errors="replace"))
                   if NETWORK.match(url)]
    assert not remote, "pages that load from the network:\n" + "\n".join(remote[:20])


@pytest.mark.thorough
def test_the_book_has_every_page(built_site):
    expected = ["index.html", "glossary.html", "instructor.html", "parts.html", "search.html"] + \
               [f"chapters/{p.stem}.html" for p in CHAPTERS]
    missing = [name for name in expected if not (built_site / name).is_file()]
    assert not missing, f"pages missing from the site: {missing}"
    assert len(CHAPTERS) == 11
    # the glossary page carries an anchor per entry, and the chapters link to them
    glossary = (built_site / "glossary.html").read_text()
    assert all(f'id="{e.label}"' in glossary for e in glossary_entries(GLOSSARY))
    assert "glossary.html#term-slot" in (built_site / "chapters" / "04_kv_pool.html").read_text()
    # the guide's figures to project are links to the site's copy of figures/
    assert 'href="figures/ch3_split.svg"' in (built_site / "instructor.html").read_text()


class Links(HTMLParser):
    """Every relative href and src of a page (what a reader can open or the browser fetches)."""

    def __init__(self):
        super().__init__()
        self.targets: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("href", "src") and value and not re.match(r"^(#|[a-z]+:|//)", value):
                self.targets.append(value)


@pytest.mark.thorough
def test_every_link_between_pages_leads_to_a_file(built_site):
    broken = []
    # _static/ holds the theme's template macros too (HTML files, not pages)
    for page in sorted(p for p in built_site.rglob("*.html") if "_static" not in p.relative_to(built_site).parts):
        parser = Links()
        parser.feed(page.read_text(errors="replace"))
        broken += [f"{page.relative_to(built_site)} -> {t}" for t in parser.targets
                   if not (page.parent / re.split(r"[?#]", t)[0]).exists()]
    assert not broken, "links to nothing:\n" + "\n".join(broken[:20])


def hrefs(html: str) -> set[str]:
    parser = Links()
    parser.feed(html)
    return set(parser.targets)


def assert_the_two_downloads(built_site: Path, name: str) -> None:
    """Both copies of chapter `name` are in the site: the instructor's is the committed notebook byte for
    byte, the student's is what `make student` writes (kvlearn.workshop.student)."""
    committed = ROOT / "notebooks" / f"{name}.ipynb"
    instructor, student = (built_site / folder / f"{name}.ipynb" for folder in DOWNLOADS)
    assert instructor.read_bytes() == committed.read_bytes(), f"{instructor} is not the committed notebook"
    assert nbformat.read(student, as_version=4) == student_copy(nbformat.read(committed, as_version=4)), \
        f"{student} is not the student copy"


@pytest.mark.thorough
def test_every_chapter_page_links_its_instructor_and_student_notebook(built_site):
    for path in CHAPTERS:
        links = hrefs((built_site / "chapters" / f"{path.stem}.html").read_text())
        wanted = {f"../{folder}/{path.stem}.ipynb" for folder in DOWNLOADS}
        assert wanted <= links, f"{path.stem}: its page does not link {sorted(wanted - links)}"
        assert_the_two_downloads(built_site, path.stem)


@pytest.mark.thorough
def test_check_your_parts_links_each_part_to_its_chapters_notebooks(built_site):
    links = hrefs((built_site / "parts.html").read_text())
    for name, (chapter, _) in BUILD.items():
        stem = CHAPTERS[chapter].stem
        wanted = {f"{folder}/{stem}.ipynb" for folder in DOWNLOADS}
        assert wanted <= links, f"parts page, {name}: no link to {sorted(wanted - links)}"


def test_a_chapter_page_opens_with_its_title_then_its_downloads():
    nb = nbformat.read(CHAPTERS[3], as_version=4)
    shown = site_notebook(nb, CHAPTERS[3].stem)
    title, links, rest = shown.cells[0].source.split("\n\n", 2)
    assert title == f"# {chapter_title(nb)}" and links == download_links(CHAPTERS[3].stem, "../")
    assert rest == nb.cells[0].source.split("\n\n", 1)[1] and shown.cells[1:] == site_notebook(nb).cells[1:]
    assert 'href="../student/03_radix_tree.ipynb" download' in links
    assert site_notebook(nb).cells[0].source == nb.cells[0].source   # no name: no links


def test_stage_puts_both_copies_of_every_chapter_beside_the_figures(tmp_path):
    names = stage(ROOT, tmp_path / "src")
    assert names == [p.stem for p in CHAPTERS]
    for name in names:
        assert_the_two_downloads(tmp_path / "src" / "extra", name)
    assert download_links(names[1]) in (tmp_path / "src" / "parts.md").read_text()


def test_parts_page_lists_every_build_exercise_from_the_checker():
    page = parts_page([p.stem for p in CHAPTERS])
    assert list(BUILD) == [name for name in SUITES if name in BUILD]
    for name, (chapter, attr) in BUILD.items():
        suite = SUITES[name]
        assert f"## Chapter {chapter}: `{name}`" in page
        assert f"](chapters/{CHAPTERS[chapter].stem}.ipynb)" in page
        assert f"`%%part {name}`" in page and f"check_part({name!r}, {attr})" in page
        assert f"kvlearn.parts.{suite.contract.__name__}" in page
        assert suite.module.__doc__.splitlines()[0] in page   # what the suite judges, in its own words


def test_every_part_of_the_engine_map_links_to_the_glossary():
    entries = glossary_entries(GLOSSARY)
    pattern = words_pattern(entries)
    block = engine_map(nbformat.read(CHAPTERS[0], as_version=4))
    names = [MAP_LINE.match(line)["name"] for line in block.splitlines() if MAP_LINE.match(line)]
    # "model" is SmolLM2, chapter 0's subject, not a word the course defines
    unlinked = [n for n in names if n != "model" and not pattern.search(n)]
    assert not unlinked, f"engine-map parts without a glossary entry: {unlinked}"
    assert entry_of(pattern.search("the block tables"), entries).label == "term-block-table"   # longest word wins
    assert entry_of(pattern.search("two Slots"), entries).label == "term-slot"
    assert pattern.search("page-aligned") is None


def test_glossary_labels_each_entry_once():
    labelled = label_glossary(GLOSSARY)
    entries = glossary_entries(GLOSSARY)
    assert [e.label for e in glossary_entries(labelled)] == [e.label for e in entries]
    assert labelled.count("(term-") == len(entries)
    with pytest.raises(ValueError, match="same term"):
        glossary_entries("**slot** (ch. 1). One.\n\n**slot** (ch. 4). Two.\n")


def test_widget_views_become_a_note_and_everything_else_stays():
    nb = nbformat.read(ROOT / "notebooks" / "03_radix_tree.ipynb", as_version=4)
    shown = site_notebook(nb)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    kept = [o for c in shown.cells if c.cell_type == "code" for o in c.outputs]
    views = [o for o in outputs if WIDGET_VIEW in o.get("data", {})]
    assert views and "widgets" in nb.metadata, "chapter 3 has no widget any more: pick another chapter"
    assert "widgets" not in shown.metadata
    assert not [o for o in kept if WIDGET_VIEW in o.get("data", {})]
    assert len(kept) == len(outputs)
    notes = [o for o in kept if o.get("data", {}).get("text/markdown") == WIDGET_NOTE]
    assert len(notes) == len(views)
    assert [o for o in kept if o not in notes] == [o for o in outputs if o not in views]


def test_landing_page_has_the_two_commands_the_table_and_the_map():
    chapters = {p.stem: nbformat.read(p, as_version=4) for p in CHAPTERS}
    page = landing_page((ROOT / "README.md").read_text(), chapters)
    assert "make demo" in page and "make test" in page
    for name in chapters:
        assert f"](chapters/{name}.ipynb)" in page
    assert ">>" not in page.split("```text")[1].split("```")[0]   # the map, no chapter marked


def test_the_offline_check_sees_what_a_browser_would_fetch():
    parser = Loads()
    parser.feed('<script src="https://cdn.example/x.js"></script><img srcset="//cdn.example/a.png 2x, b.png">'
                '<link rel="stylesheet" href="http://fonts.example/f.css"><link rel="next" href="https://x.example/">'
                '<a href="https://example.org/">a link loads nothing</a><img src="_images/local.png">')
    assert [u for u in parser.urls if NETWORK.match(u)] == \
        ["https://cdn.example/x.js", "//cdn.example/a.png", "http://fonts.example/f.css"]
    css = '/* see https://docs.example */ @import "https://fonts.example/g.css"; a { background: url(../x.png) }'
    assert [u for u in css_urls(css) if NETWORK.match(u)] == ["https://fonts.example/g.css"]


def test_landing_page_names_the_readme_section_it_misses():
    chapters = {p.stem: nbformat.read(p, as_version=4) for p in CHAPTERS[:1]}
    with pytest.raises(ValueError, match="'## The two commands'"):
        landing_page("# kvlearn\n\nA course.\n\n## Opening the notebooks\n", chapters)
