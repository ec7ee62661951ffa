"""Headless Chromium for the browser tests: Debian's `chromium` driven by PyPI's playwright.

playwright's own browser downloads (`playwright install`) are not used: the browser is the system's,
found on PATH (or CHROMIUM=/path/to/chromium). Where it or playwright is missing, the tests skip and
say what to install; `make test` installs chromium with apt-get first where it can.
"""
from __future__ import annotations

import os
import shutil

import pytest

VIEWPORT = {"width": 1280, "height": 900}
BROWSER_NAMES = ("chromium", "chromium-browser")


def chromium_path() -> str | None:
    """The system Chromium: $CHROMIUM if set, else the first of BROWSER_NAMES on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    return next(filter(None, map(shutil.which, BROWSER_NAMES)), None)


@pytest.fixture(scope="session")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: pip install -e '.[test]' (make setup)")
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium found (looked for chromium, chromium-browser on PATH, $CHROMIUM): "
                    "apt-get install chromium")
    with sync_playwright() as p:
        # --no-sandbox: Chromium's sandbox refuses to start as root (CI runs as root).
        chrome = p.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        try:
            yield chrome
        finally:
            chrome.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.call_failed = report.failed  # read by the page fixture's teardown
    return report


@pytest.fixture
def page(browser, request, tmp_path):
    """A fresh page (own context: no cookies or storage shared between tests), closed afterwards; when
    the test fails, the page as it was is saved to tmp_path/failure.png to see why."""
    context = browser.new_context(viewport=VIEWPORT)
    try:
        page = context.new_page()
        yield page
        if getattr(request.node, "call_failed", False):
            page.screenshot(path=str(tmp_path / "failure.png"), full_page=False)
            print(f"screenshot of the failing page: {tmp_path / 'failure.png'}")
    finally:
        context.close()
