"""The notebooks' widgets in a real JupyterLab, in headless Chromium: they render, and they answer.

The unit tests (tests/viz/) move the controls in Python; this checks the rest of the chain, the widget
JavaScript in the lab, the comm to the kernel and back. JupyterLab serves a temporary copy of the
notebooks (outputs cleared, so nothing shown is left over from the committed run). In each notebook only
the cells the widget needs run, through the lab's UI (select the cell, Shift+Enter): the first code cell
(the imports), the cells that define the names the spec lists, and the widget's cell. Then one control
moves (a slider's handle takes ArrowRight, or a button is clicked) and the widget's output must change.
Each widget is photographed into images/browser_*.png (git-ignored: every run rewrites them).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from lab_server import free_port, start_lab, wait_until_serving

pytestmark = pytest.mark.browser
expect = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: make setup").expect

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"

START_TIMEOUT_S = 120  # a cold JupyterLab start is ~10-30 s, longer on a loaded 2-core machine
CELL_TIMEOUT_S = 180  # the imports cell loads torch and transformers: ~5-20 s, more when the machine is busy
UI_TIMEOUT_MS = 30_000  # a page, a click, a widget's update
NOT_STARTED_MS = 20_000  # how long a Shift+Enter may take to queue its cell ("[*]:")

# Per notebook: the widget cell (found by the call it makes), names whose defining cells must run first,
# the control to move, and the line of output text (a regex) that must change.
WIDGETS = {
    "01_memory_wall": dict(call="kv_calculator(", needs=("ARTICLE_GPU_GB",), move="slider",
                           watch=r"bytes/token", shot="browser_01_kv_calculator.png"),
    "03_paged_kv_cache": dict(call="block_pool_stepper(", needs=(), move="next",
                              watch=r"step \d+/\d+", shot="browser_03_block_pool_stepper.png"),
    "06_fp8_kv_cache": dict(call="fp8_code_walker(", needs=(), move="slider",
                            watch=r"^0x[0-9A-F]{2} = ", shot="browser_06_fp8_code_walker.png"),
}
# JupyterLab's settings for the run: no news or update toasts over the cells, and every cell in the DOM
# (no windowing), so the n-th .jp-Cell is the notebook's n-th cell.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def _source(cell) -> str:
    return "".join(cell["source"])


def cells_to_run(nb: dict, call: str, needs: tuple[str, ...]) -> list[int]:
    """Indices of the first code cell, the first cell assigning each of `needs`, and the cell calling
    `call`, in notebook order."""
    code = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]

    def first(matches, what: str) -> int:
        hits = [i for i in code if matches(_source(nb["cells"][i]))]
        if not hits:
            raise ValueError(f"no code cell {what}")
        return hits[0]

    chosen = {code[0], first(lambda src: call in src, f"calls {call!r}")}
    for name in needs:
        chosen.add(first(lambda src: re.search(rf"^{re.escape(name)}\s*=", src, re.M), f"assigns {name}"))
    return sorted(chosen)


def cleared(nb: dict) -> dict:
    """The notebook with every output, execution count and saved widget state removed."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    nb["metadata"].pop("widgets", None)
    return nb


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a free loopback port, serving cleared copies of the widget notebooks."""
    tmp = tmp_path_factory.mktemp("lab")
    notebooks = tmp / "notebooks"
    notebooks.mkdir()
    for name in WIDGETS:
        nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
        (notebooks / f"{name}.ipynb").write_text(json.dumps(cleared(nb)))
    for name, values in LAB_SETTINGS.items():
        path = tmp / "settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port = free_port()
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               "--ServerApp.port_retries=0", f"--ServerApp.root_dir={notebooks}"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    server = start_lab(command, ROOT, port, tmp, env={"JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings")})
    try:
        wait_until_serving(server, START_TIMEOUT_S, "jupyter lab")
        yield server
    finally:
        server.stop()


def run_cell(page, cell, timeout_s: float, tries: int = 3) -> None:
    """Select the cell by its prompt (command mode), Shift+Enter, and wait for its execution count.

    A Shift+Enter that lands while the notebook's kernel is still connecting moves the selection on but
    runs nothing: the prompt stays "[ ]:" (a queued or running cell shows "[*]:"). Only then is the
    key pressed again, so no cell runs twice."""
    prompt = cell.locator(".jp-InputPrompt").first
    for _ in range(tries):
        prompt.scroll_into_view_if_needed(timeout=UI_TIMEOUT_MS)
        prompt.click(timeout=UI_TIMEOUT_MS)
        page.keyboard.press("Shift+Enter")
        try:
            expect(prompt).not_to_have_text(re.compile(r"^\s*\[ \]:?\s*$"), timeout=NOT_STARTED_MS)
            break
        except AssertionError:
            continue
    expect(prompt).to_have_text(re.compile(r"\[\d+\]"), timeout=timeout_s * 1000)  # "[*]:" while running
    traceback = cell.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']")
    if traceback.count():
        pytest.fail(f"cell raised:\n{traceback.first.inner_text()[-2000:]}")


def watched_line(widget, pattern: str) -> str:
    """The first line of the widget's text matching pattern (fail if none: the widget did not render)."""
    lines = [ln for ln in widget.inner_text(timeout=UI_TIMEOUT_MS).splitlines() if re.search(pattern, ln)]
    assert lines, f"no line matching {pattern!r} in the widget:\n{widget.inner_text()}"
    return lines[0]


def wait_for_change(read, before, what: str) -> None:
    """Poll read() until it differs from before: the kernel's answer comes back asynchronously."""
    deadline = time.monotonic() + UI_TIMEOUT_MS / 1000
    while read() == before:
        assert time.monotonic() < deadline, f"{what} did not change: still {before!r}"
        time.sleep(0.2)


def images_src(widget) -> list[str]:
    return [img.get_attribute("src") or "" for img in widget.locator("img").all()]


@pytest.mark.parametrize("name", list(WIDGETS))
def test_widget_renders_and_answers(page, lab, name):
    spec = WIDGETS[name]
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    indices = cells_to_run(nb, spec["call"], spec["needs"])
    page.set_default_timeout(UI_TIMEOUT_MS)
    page.goto(lab.url(f"/lab/tree/{name}.ipynb"), timeout=UI_TIMEOUT_MS * 2)
    selector = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell"
    page.wait_for_function("([sel, n]) => document.querySelectorAll(sel).length === n",
                           arg=[selector, len(nb["cells"])], timeout=UI_TIMEOUT_MS * 2)
    cells = page.locator(selector)
    for i in indices:
        run_cell(page, cells.nth(i), CELL_TIMEOUT_S)
    cell = cells.nth(indices[-1])
    widget = cell.locator(".jp-OutputArea-output .jupyter-widgets").first
    widget.wait_for(state="visible", timeout=UI_TIMEOUT_MS)
    before, before_images = watched_line(widget, spec["watch"]), images_src(widget)
    if spec["move"] == "slider":
        handle = widget.locator(".widget-slider .noUi-handle").first
        handle.focus()
        handle.press("ArrowRight")
    else:
        widget.get_by_role("button", name=spec["move"]).click()
    wait_for_change(lambda: watched_line(widget, spec["watch"]), before, "the widget's text")
    if before_images:  # a widget that draws a picture must redraw it
        wait_for_change(lambda: images_src(widget), before_images, "the widget's picture")
    IMAGES.mkdir(exist_ok=True)
    cell.scroll_into_view_if_needed()
    cell.screenshot(path=str(IMAGES / spec["shot"]))
    assert Path(IMAGES / spec["shot"]).stat().st_size > 0
