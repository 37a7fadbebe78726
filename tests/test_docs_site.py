"""The documentation site in a real browser: `mkdocs build --strict` (broken links and anchors fail the
build), a local HTTP server over the built site, and headless Chromium on every page of the nav. Each
page must render its title and body, and every link between pages must lead to a page that exists.

Marked `slow` and `browser`; `make test-browser` runs it with `make docs`'s packages installed.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import shutil
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.browser]
ROOT = Path(__file__).parents[1]
CHROMIUM = shutil.which("chromium")


def nav_pages(nav: list) -> list[str]:
    """The markdown files of mkdocs.yml's nav, in order."""
    out = []
    for entry in nav:
        for value in entry.values():
            out += nav_pages(value) if isinstance(value, list) else [value]
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: `make docs` installs it")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()


def browse(url: str) -> str:
    """The page's DOM after its scripts ran, in headless Chromium."""
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--virtual-time-budget=5000",
        "--dump-dom",
    ]
    proc = subprocess.run([*cmd, url], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


class Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.h1: list[str] = []
        self._in_h1 = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a" and (href := dict(attrs).get("href")):
            self.hrefs.append(href)
        self._in_h1 = self._in_h1 or tag == "h1"

    def handle_endtag(self, tag: str) -> None:
        self._in_h1 = self._in_h1 and tag != "h1"

    def handle_data(self, data: str) -> None:
        if self._in_h1 and data.strip():
            self.h1.append(data.strip())


def test_every_page_of_the_nav_renders_and_its_links_resolve(site, server):
    pages = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert len(pages) >= 10
    for page in pages:
        path = "" if page == "index.md" else page.removesuffix(".md") + "/"
        dom = browse(server + path)
        parsed = Links()
        parsed.feed(dom)
        first_heading = next(
            line[2:].strip()
            for line in (ROOT / "docs" / page).read_text().splitlines()
            if line.startswith("# ")
        )
        assert parsed.h1 and parsed.h1[0].startswith(first_heading.split("`")[0].strip()[:20]), (
            page,
            parsed.h1,
        )
        assert len(dom) > 5000, page  # the theme's layout and the page's body, not an error page
        for href in parsed.hrefs:
            target = urllib.parse.urlsplit(urllib.parse.urljoin(server + path, href))
            if target.netloc != urllib.parse.urlsplit(server).netloc:
                continue  # links out of the site (the theme's, the repository's)
            local = site / urllib.parse.unquote(target.path).lstrip("/")
            assert local.is_file() or (local / "index.html").is_file(), (page, href)
