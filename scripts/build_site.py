"""`python scripts/build_site.py OUT_DIR`: the course as a static HTML site (Jupyter Book 1, `make site`).

The pages are the committed, executed notebooks as they are (nothing is re-executed, so the site takes
seconds and shows the outputs the notebooks were checked with) and the README. The front page is the
README's course map, each notebook's name a link to its page. The book's sources are assembled in a
scratch folder (OUT_DIR/_src), so the repository gets no book config of its own; the pages land in
OUT_DIR/_build/html (index.html,
notebooks/NN_topic.html, README.html).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"  # the course notebooks; notebooks/exercises/ are learner copies
MAP_HEADING = "## Course map"

CONFIG = """\
title: radarlab
author: the radarlab authors
only_build_toc_files: true
execute:
  execute_notebooks: "off"
html:
  use_repository_button: false
sphinx:
  config:
    html_show_copyright: false
    suppress_warnings: ["myst.header", "myst.xref_missing", "misc.highlighting_failure"]
"""


def course_map(readme: str) -> str:
    """The README's "Course map" section: its heading down to the next heading of the same level."""
    start = readme.find(MAP_HEADING + "\n")
    if start < 0:
        raise ValueError(f"README.md has no {MAP_HEADING!r} section to make the front page from")
    end = readme.find("\n## ", start + len(MAP_HEADING))
    return readme[start:] if end < 0 else readme[start:end + 1]


def link_notebooks(section: str, notebooks: list[Path]) -> str:
    """Each map row `| 01 | memory_wall |` gets its name linked to notebooks/01_memory_wall.ipynb
    (MyST turns that link into the page's); rows of notebooks not written yet stay plain text."""
    names = {nb.stem: nb.name for nb in notebooks}

    def link(m: re.Match) -> str:
        number, topic = m.group(1), m.group(2)
        name = names.get(f"{number}_{topic}")
        return m.group(0) if name is None else f"| {number} | [{topic}](notebooks/{name}) |"

    return re.sub(r"^\| (\d\d) \| (\w+) \|", link, section, flags=re.M)


def front_page(readme: str, notebooks: list[Path]) -> str:
    intro = ("# radarlab: LLM inference acceleration, built from scratch\n\n"
             "The executed notebooks, as committed; the [README](README.md) says how to run them.\n\n")
    return intro + link_notebooks(course_map(readme), notebooks).replace(MAP_HEADING, "## Course map", 1)


def assemble(src: Path, root: Path = ROOT) -> list[Path]:
    """Copy the README, the notebooks and images/ into src with the book's config, toc and front page."""
    notebooks = sorted((root / "notebooks").glob(NOTEBOOK_GLOB))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks matching {NOTEBOOK_GLOB} in {root / 'notebooks'}")
    shutil.rmtree(src, ignore_errors=True)
    (src / "notebooks").mkdir(parents=True)
    for nb in notebooks:
        shutil.copy2(nb, src / "notebooks" / nb.name)
    shutil.copytree(root / "images", src / "images")
    readme = (root / "README.md").read_text()
    (src / "README.md").write_text(readme)
    (src / "index.md").write_text(front_page(readme, notebooks))
    (src / "_config.yml").write_text(CONFIG)
    chapters = "".join(f"- file: notebooks/{nb.stem}\n" for nb in notebooks)
    (src / "_toc.yml").write_text(f"format: jb-book\nroot: index\nchapters:\n{chapters}- file: README\n")
    return notebooks


def build(out: Path, root: Path = ROOT) -> Path:
    """Build the site into out/html and return that folder (jupyter-book's errors are raised)."""
    out = Path(out).resolve()
    src = out / "_src"
    assemble(src, root)
    jb = Path(sys.executable).with_name("jupyter-book")
    if not jb.exists():
        raise FileNotFoundError(f"{jb} not found: install the test extra (pip install -e '.[test]')")
    subprocess.run([str(jb), "build", "--quiet", "--path-output", str(out), str(src)], check=True)
    return out / "_build" / "html"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output folder (the pages go to OUT/_build/html)")
    html = build(parser.parse_args(argv).out)
    print(f"site: {html / 'index.html'}")


if __name__ == "__main__":
    main()
