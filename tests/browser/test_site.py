"""The course site (`make site`) in headless Chromium: the front page is the course map, and every notebook
has a page with its title and its outputs, figures included. The site is built afresh into a temporary
folder (scripts/build_site.py, ~15 s), so no earlier `make site` is needed."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
BUILD_TIMEOUT_S = 300  # ~15 s on a 2-core machine; Sphinx is single-threaded and the machine may be busy


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if not Path(sys.executable).with_name("jupyter-book").exists():
        pytest.skip("jupyter-book is not installed: pip install -e '.[test]' (make setup)")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_site.py"), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, f"the site did not build:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out / "_build" / "html"


def has_figure(notebook: Path) -> bool:
    nb = json.loads(notebook.read_text())
    return any("image/png" in out.get("data", {}) for cell in nb["cells"] for out in cell.get("outputs", []))


def test_front_page_is_the_course_map(page, site):
    page.goto((site / "index.html").as_uri())
    assert page.locator("h2", has_text="Course map").count() == 1
    table = page.locator("table").first
    for nb in NOTEBOOKS:
        number, topic = nb.stem.split("_", 1)
        link = table.locator(f"a[href$='notebooks/{nb.stem}.html']")
        assert link.count() == 1 and link.inner_text() == topic, f"the course map has no link to {nb.name}"
    IMAGES.mkdir(exist_ok=True)
    page.screenshot(path=str(IMAGES / "browser_site_index.png"))
    page.locator(f"a[href$='notebooks/{NOTEBOOKS[1].stem}.html']").first.click()
    assert page.url.endswith(f"notebooks/{NOTEBOOKS[1].stem}.html"), "the course map's link leads elsewhere"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_page(page, site, notebook):
    """Its title (the notebook's first heading, "NN · ..."), its code outputs, and its figures."""
    page.goto((site / "notebooks" / f"{notebook.stem}.html").as_uri())
    number = notebook.stem[:2]
    title = page.locator("h1").first.inner_text()
    assert re.match(rf"{number}\b", title), f"{notebook.stem}'s page is titled {title!r}"
    assert page.locator(".cell_output").count() > 0, f"{notebook.stem}'s page shows no outputs"
    if has_figure(notebook):
        figures = page.locator(".cell_output img")
        assert figures.count() > 0, f"{notebook.stem}'s page shows none of its figures"
        assert figures.first.evaluate("img => img.complete && img.naturalWidth > 0"), "a figure did not load"
