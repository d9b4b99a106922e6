"""The built documentation site: every public name has its anchor, internal links
resolve, and headless Chromium renders pages without console errors, shows the
performance charts, and its search reaches API names and guides first.

The site comes from the ``site`` fixture (conftest.py: built here, or CI's ``site/``).
The browser tests drive Debian's ``chromium`` through its ``chromedriver`` (packages
``chromium`` and ``chromium-driver``; .ci/run installs them) with selenium (the docs
extra); they skip, saying which is missing, where one is.
"""

from __future__ import annotations

import functools
import http.server
import importlib
import shutil
import threading
import types
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

import pytest

#: Each public namespace, with the page (under the site) that documents its names.
NAMESPACES = {
    "distribute": "api/distribute/index.html",
    "distribute.experimental": "api/experimental/index.html",
    "distribute.coordinator": "api/coordinator/index.html",
    "distribute.cluster_resolver": "api/cluster_resolver/index.html",
    "distribute.optimizers": "api/optimizers/index.html",
    "distribute.callbacks": "api/callbacks/index.html",
    "distribute.metrics": "api/metrics/index.html",
    "distribute.training.losses": "api/losses/index.html",
    "distribute.tpu": "api/tpu/index.html",
    "distribute.compat.v1": "api/compat_v1/index.html",
    "distribute.launch": "api/launch/index.html",
    "distribute.errors": "api/errors/index.html",
    "distribute.partitioners": "api/partitioners/index.html",
    "distribute.checkpoint": "api/checkpoint/index.html",
    "distribute.data": "api/data/index.html",
    "distribute.data.sharding": "api/data/index.html",
    "distribute.gradients": "api/gradients/index.html",
    "distribute.values": "api/values/index.html",
    "distribute.training": "api/training/index.html",
}


def _namespace(dotted: str) -> types.ModuleType:
    """``distribute.optimizers`` is an attribute (``distribute.training.optimizers``)."""
    module = importlib.import_module("distribute")
    for part in dotted.split(".")[1:]:
        module = getattr(module, part)
    return module


def public_names() -> list[tuple[str, str]]:
    """(namespace, name) for every name of every namespace's ``__all__`` that is not a
    module (modules have namespaces of their own)."""
    names = []
    for dotted in NAMESPACES:
        module = _namespace(dotted)
        for name in module.__all__:
            if not isinstance(getattr(module, name), types.ModuleType):
                names.append((dotted, name))
    return names


class _Page(HTMLParser):
    """The ids and the links of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get("id"):
            self.ids.add(str(values["id"]))
        for attribute in ("href", "src"):
            link = values.get(attribute)
            if link and (tag in ("a", "img", "script") or tag == "link"):
                self.links.append(link)


@functools.cache
def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def test_the_namespaces_hold_the_public_names() -> None:
    names = public_names()
    assert len({n for ns, n in names if ns != "distribute.data.sharding"}) > 120, names


def test_every_public_name_has_an_anchor_on_its_namespaces_page(site: Path) -> None:
    missing = [
        f"{dotted}.{name} (on {NAMESPACES[dotted]})"
        for dotted, name in public_names()
        if f"{dotted}.{name}" not in _parse(site / NAMESPACES[dotted]).ids
    ]
    assert not missing, f"{len(missing)} public names without an anchor: {missing}"


def test_private_modules_are_not_documented(site: Path) -> None:
    private = sorted(
        anchor
        for page in (site / "api").rglob("*.html")
        for anchor in _parse(page).ids
        if anchor.startswith("distribute.")
        and any(p.startswith("_") for p in anchor.split("."))
        and not anchor.split(".")[-1].startswith("__")
    )
    assert not private, private


def test_every_internal_link_resolves(site: Path) -> None:
    broken = []
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 30
    for page in pages:
        if page.name == "404.html":
            continue  # served at any depth, so its links are absolute by design
        for link in _parse(page).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
                continue
            target, anchor = urldefrag(link)
            path = page if not target else (page.parent / unquote(parts.path)).resolve()
            if path.is_dir():
                path = path / "index.html"
            if not path.exists():
                broken.append(f"{page.relative_to(site)}: {link}")
            elif anchor and path.suffix == ".html" and unquote(anchor) not in _parse(path).ids:
                broken.append(f"{page.relative_to(site)}: {link} (no such anchor)")
    assert not broken, f"{len(broken)} broken links: {broken[:20]}"


def test_the_performance_page_shows_the_charts(site: Path) -> None:
    links = _parse(site / "guide" / "performance" / "index.html").links
    for chart in ("speed.png", "sharded_memory.png"):
        assert any(link.endswith(f"assets/charts/{chart}") for link in links), links
        assert (site / "assets" / "charts" / chart).stat().st_size > 10_000


# -- the browser -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    """The site over HTTP (the search runs in a web worker, which file:// forbids)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (the docs extra)")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.skip(
            "headless Chromium needs Debian's chromium and chromium-driver packages "
            f"(found chromium={binary}, chromedriver={driver_path}): "
            "apt-get install -y chromium chromium-driver"
        )
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


PAGES = {
    "home": ("", "distribute"),
    "api": ("api/distribute/", "ds: the top-level namespace"),
    "guide": ("guide/mirrored/", "MirroredStrategy"),
}


@pytest.mark.parametrize("name", sorted(PAGES))
def test_a_page_renders_without_console_errors(
    name: str, server: str, browser: object, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    path, heading = PAGES[name]
    browser.get(f"{server}/{path}")  # type: ignore[attr-defined]
    h1 = browser.find_element(By.TAG_NAME, "h1").text  # type: ignore[attr-defined]
    assert h1 == heading
    assert browser.find_elements(By.CSS_SELECTOR, ".md-nav__link")  # type: ignore[attr-defined]
    errors = [
        entry
        for entry in browser.get_log("browser")  # type: ignore[attr-defined]
        if entry["level"] in ("SEVERE", "ERROR")
    ]
    assert not errors, errors
    browser.save_screenshot(str(tmp_path / f"{name}.png"))  # type: ignore[attr-defined]


#: A query, and the page and anchor its first result must reach: API entries by their
#: short names (docs/hooks/search.py titles them by dotted path and ranks a base class's
#: method above its overrides), and a guide above the API for a guide's subject.
SEARCHES = {
    "MirroredStrategy": "guide/mirrored/",  # the guide named for it
    "MirroredVariable": "api/distribute/#distribute.MirroredVariable",
    "SyncOnReadVariable": "api/distribute/#distribute.SyncOnReadVariable",
    "run": "api/distribute/#distribute.Strategy.run",
    "fit": "guide/keras_fit/",
}


@pytest.mark.parametrize("query", sorted(SEARCHES))
def test_the_search_reaches_the_entry_first(query: str, server: str, browser: object) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{server}/?q={query}")  # type: ignore[attr-defined]
    items = WebDriverWait(browser, 30).until(  # type: ignore[arg-type]
        lambda b: b.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
    )
    links = [a.get_attribute("href") for a in items[0].find_elements(By.TAG_NAME, "a")]
    page, _, anchor = SEARCHES[query].partition("#")
    assert links and all(link.startswith(f"{server}/{page}") for link in links), links
    if anchor:
        # The first result is the page; its first section is the entry.
        sections = [link for link in links if "#" in link]
        assert sections and sections[0].endswith(f"#{anchor}"), links
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]  # type: ignore[attr-defined]
    assert not errors, errors


def test_the_performance_page_shows_its_charts_and_generated_tables_in_the_browser(
    server: str, browser: object
) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{server}/guide/performance/")  # type: ignore[attr-defined]
    widths = {
        image.get_attribute("src").rsplit("/", 1)[-1]: browser.execute_script(  # type: ignore[attr-defined]
            "return arguments[0].complete && arguments[0].naturalWidth", image
        )
        for image in browser.find_elements(By.CSS_SELECTOR, "article img")  # type: ignore[attr-defined]
    }
    assert widths.get("speed.png", 0) > 400 and widths.get("sharded_memory.png", 0) > 400, widths
    text = browser.find_element(By.TAG_NAME, "article").text  # type: ignore[attr-defined]
    # benchmarks/results/figures.md, included: the run's command and date, then the tables
    assert "Generated by python benchmarks/run_all.py" in text, text[:500]
    assert text.count("Median (range of the runs)") >= 3, text[:500]
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]  # type: ignore[attr-defined]
    assert not errors, errors
