"""The course's static site as a reader meets it: served by `python -m http.server`, read in headless
Chromium (the launch of tests/test_browser.py: Debian's `chromium` driven by Playwright, skipped
with the reason when either is missing; without Sphinx the site fixture skips too).

From the landing page, "next" leads through chapters 0 to 9 in order; every page shows its title,
every picture has loaded, the console shows no error and no request leaves 127.0.0.1. The search
finds chapter 3 for "radix", a chapter's glossary link for "slot" lands on its definition, and a
chapter's "student copy" link downloads its student notebook.
Marked slow (the site is built once per session: 20-40 s).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import nbformat
import pytest

from kvlearn.workshop.site import chapter_title
from kvlearn.workshop.student import student_copy
from tests.test_browser import browser, free_port  # noqa: F401  (browser: the shared Chromium fixture)

pytestmark = [pytest.mark.slow, pytest.mark.thorough]   # the site in a browser

CHAPTERS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LOCAL = {"127.0.0.1"}

IMAGES_JS = """() => [...document.images].filter(i => !(i.complete && i.naturalWidth > 0))
                                        .map(i => i.getAttribute('src'))"""


@pytest.fixture(scope="module")
def server(built_site, tmp_path_factory):
    """http://127.0.0.1:PORT/ serving the built site."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("site-server") / "http.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(built_site)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"python -m http.server did not answer on {url} (see {log.name})")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture
def page(browser, server):  # noqa: F811  (browser is the imported fixture)
    """A page that records its console errors, uncaught exceptions and requests that leave 127.0.0.1."""
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.errors, page.remote = [], []
    page.on("console", lambda m: page.errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(f"uncaught: {e}"))
    page.on("response", lambda r: page.errors.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    page.on("request", lambda r: page.remote.append(r.url)
            if urlparse(r.url).scheme not in ("data", "blob") and urlparse(r.url).hostname not in LOCAL else None)
    page.server = server
    try:
        yield page
    finally:
        page.close()


def assert_clean(page, where: str) -> None:
    page.wait_for_load_state("load")
    broken = page.evaluate(IMAGES_JS)
    assert not broken, f"{where}: pictures that did not load: {broken}"
    assert not page.errors, f"{where}: {page.errors}"
    assert not page.remote, f"{where}: requests that leave localhost: {page.remote}"


def test_next_leads_through_every_chapter(page):
    page.goto(page.server + "index.html")
    assert_clean(page, "landing page")
    assert page.locator("main h1").first.inner_text().strip().startswith("kvlearn")
    for path in CHAPTERS:
        page.locator(".prev-next-area a.right-next").click()
        page.wait_for_url(f"**/chapters/{path.stem}.html")
        title = chapter_title(nbformat.read(path, as_version=4))
        heading = page.locator("main h1").first.inner_text().strip().rstrip("#").strip()
        assert heading == title, f"{path.stem}: the page's heading is {heading!r}, not {title!r}"
        assert page.title().startswith(title), f"{path.stem}: the window title is {page.title()!r}"
        assert_clean(page, path.stem)
    print(f"next led through {len(CHAPTERS)} chapters")


def test_search_for_radix_finds_chapter_3(page):
    page.goto(page.server + "search.html?q=radix")
    results = page.locator("#search-results li a")
    results.first.wait_for(timeout=30_000)
    found = [results.nth(i).get_attribute("href") for i in range(results.count())]
    assert any("chapters/03_radix_tree.html" in href for href in found), f"search for radix found {found}"
    assert_clean(page, "search")


def test_glossary_link_of_slot_lands_on_its_definition(page):
    page.goto(page.server + "chapters/04_kv_pool.html")
    link = page.locator('main a[href$="glossary.html#term-slot"]').first
    assert re.fullmatch(r"slots?", link.inner_text().strip(), re.IGNORECASE), link.inner_text()
    link.click()
    page.wait_for_url("**/glossary.html#term-slot")
    entry = page.locator("#term-slot")
    assert entry.inner_text().startswith("slot (ch. 1, 4). The place of one token"), entry.inner_text()[:80]
    top = entry.evaluate("e => e.getBoundingClientRect().top")
    assert 0 <= top < page.viewport_size["height"], f"the definition is not in view (top at {top}px)"
    assert_clean(page, "glossary")


def test_a_chapter_page_downloads_its_student_notebook(page, tmp_path):
    path = CHAPTERS[4]
    page.goto(page.server + f"chapters/{path.stem}.html")
    link = page.locator("main a.kvlearn-download", has_text="student copy")
    with page.expect_download(timeout=30_000) as download:
        link.click()
    saved = tmp_path / download.value.suggested_filename
    download.value.save_as(saved)
    assert saved.name == path.name, f"the download is named {saved.name!r}"
    nb = nbformat.read(saved, as_version=4)
    nbformat.validate(nb)
    assert nb == student_copy(nbformat.read(path, as_version=4)), "the download is not the chapter's student copy"
    assert_clean(page, f"{path.stem} download")
