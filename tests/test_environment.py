"""environment.yml (conda) must list what pyproject.toml lists, with the same pins.

Two files that state the same dependencies drift apart unless a test holds them together. PyYAML is
not a dependency of the course, so the file is read with a small reader for the subset of YAML it
uses (mappings, lists, scalars, comments); where PyYAML happens to be installed, the reader is
checked against it too.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
# Lines of the conda pip section that are not dependencies of the package: the package itself.
PROJECT_ITSELF = {"-e ."}


def _strip_comment(line: str) -> str:
    """Drop a `# comment` that is not inside quotes (enough for this file's plain scalars)."""
    if line.lstrip().startswith("#"):
        return ""
    return re.sub(r"\s+#.*$", "", line)


def _scalar(text: str):
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def read_simple_yaml(text: str):
    """Parse block-style YAML made of mappings, `- ` lists and plain scalars.

    Each node is parsed by indentation: a line deeper than its parent opens the parent's value.
    Flow style, anchors and multi-line scalars are not supported and raise ValueError.
    """
    lines = []
    for raw in text.splitlines():
        line = _strip_comment(raw).rstrip()
        if not line.strip() or line.strip() == "---":
            continue
        if "\t" in line[: len(line) - len(line.lstrip())]:
            raise ValueError(f"tab indentation is not YAML: {raw!r}")
        lines.append((len(line) - len(line.lstrip()), line.strip()))

    pos = 0

    def parse_node(indent: int):
        nonlocal pos
        if lines[pos][1].startswith("- ") or lines[pos][1] == "-":
            return parse_list(indent)
        return parse_mapping(indent)

    def parse_value(rest: str, indent: int):
        """The value after `key:` or `- `: inline, or a nested block on the following lines."""
        nonlocal pos
        if rest[:1] in ("{", "[", "&", "*", "|", ">", "!"):
            raise ValueError(f"unsupported YAML construct: {rest!r}")
        if rest:
            return _scalar(rest)
        if pos < len(lines) and lines[pos][0] > indent:
            return parse_node(lines[pos][0])
        return None

    def parse_mapping(indent: int):
        nonlocal pos
        out = {}
        while pos < len(lines) and lines[pos][0] == indent and not lines[pos][1].startswith("- "):
            key, sep, rest = lines[pos][1].partition(":")
            if not sep or (rest and not rest.startswith(" ")):
                raise ValueError(f"expected `key: value`, got {lines[pos][1]!r}")
            pos += 1
            out[_scalar(key)] = parse_value(rest.strip(), indent)
        return out

    def parse_list(indent: int):
        nonlocal pos
        out = []
        while pos < len(lines) and lines[pos][0] == indent and (lines[pos][1].startswith("- ")
                                                                or lines[pos][1] == "-"):
            item = lines[pos][1][1:].strip()
            pos += 1
            key, sep, rest = item.partition(":")
            if sep and (not rest or rest.startswith(" ")) and not item.startswith(("-", "'", '"')):
                # `- key: value` opens a mapping whose first key sits on the dash line.
                value = parse_value(rest.strip(), indent + 2)
                entry = {_scalar(key): value}
                if pos < len(lines) and lines[pos][0] > indent and not lines[pos][1].startswith("- "):
                    entry.update(parse_mapping(lines[pos][0]))
                out.append(entry)
            else:
                out.append(parse_value(item, indent))
        return out

    if not lines:
        return None
    result = parse_node(lines[0][0])
    if pos != len(lines):
        raise ValueError(f"could not parse line {lines[pos][1]!r} (inconsistent indentation?)")
    return result


def _canonical(requirement: str) -> str:
    """PEP 503-normalized name plus the version spec without spaces: `Foo_Bar == 1.0` -> `foo-bar==1.0`."""
    requirement = requirement.replace(" ", "")
    match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(.*)$", requirement)
    assert match, f"not a requirement: {requirement!r}"
    name, spec = match.groups()
    return re.sub(r"[-_.]+", "-", name).lower() + spec


@pytest.fixture(scope="module")
def pyproject():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


@pytest.fixture(scope="module")
def environment():
    return read_simple_yaml((ROOT / "environment.yml").read_text(encoding="utf-8"))


def _conda_and_pip(environment):
    conda, pip = [], None
    for dep in environment["dependencies"]:
        if isinstance(dep, dict):
            assert set(dep) == {"pip"}, f"unexpected nested dependency block {dep}"
            pip = dep["pip"]
        else:
            conda.append(str(dep))
    assert pip is not None, "environment.yml has no `pip:` section"
    return conda, pip


def test_reader_handles_the_shapes_used():
    text = """
# comment
name: x   # trailing comment
list:
  - a
  - b: 1
    c: 2
  - nested:
      - "-e ."
      - y==1
"""
    assert read_simple_yaml(text) == {
        "name": "x",
        "list": ["a", {"b": "1", "c": "2"}, {"nested": ["-e .", "y==1"]}],
    }
    with pytest.raises(ValueError):
        read_simple_yaml("deps: [a, b]\n")


def test_reader_agrees_with_pyyaml_when_available():
    yaml = pytest.importorskip("yaml")
    text = (ROOT / "environment.yml").read_text(encoding="utf-8")
    assert read_simple_yaml(text) == yaml.safe_load(text)


def test_pip_section_mirrors_pyproject(pyproject, environment):
    project = pyproject["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    _, pip = _conda_and_pip(environment)
    listed = [str(p) for p in pip if str(p) not in PROJECT_ITSELF]

    want = {_canonical(r) for r in wanted}
    have = {_canonical(r) for r in listed}
    assert len(have) == len(listed), f"environment.yml lists a requirement twice: {sorted(listed)}"
    missing, extra = sorted(want - have), sorted(have - want)
    assert not missing and not extra, (
        f"environment.yml and pyproject.toml disagree.\n  only in pyproject.toml: {missing}\n"
        f"  only in environment.yml: {extra}"
    )


def test_every_pin_is_exact(pyproject):
    """Pins are what make the course reproducible; a range in either file would let them drift."""
    project = pyproject["project"]
    loose = [r for r in [*project["dependencies"],
                         *project["optional-dependencies"]["test"]] if "==" not in r]
    assert not loose, f"unpinned dependencies in pyproject.toml: {loose}"


def test_conda_level_is_only_python_and_pip(pyproject, environment):
    """Everything else comes from pip, so conda cannot pick a second, different version of a package."""
    conda, pip = _conda_and_pip(environment)
    names = {re.split(r"[=<>!~ ]", c, maxsplit=1)[0] for c in conda}
    assert names == {"python", "pip"}, f"conda-level dependencies should be python and pip only, got {conda}"
    assert "-e ." in [str(p) for p in pip], "the pip section should install the course package itself (-e .)"

    python = next(c for c in conda if c.startswith("python"))
    version = tuple(int(x) for x in re.findall(r"\d+", python)[:2])
    floor = tuple(int(x) for x in re.findall(r"\d+", pyproject["project"]["requires-python"])[:2])
    assert version >= floor, (f"environment.yml's {python} is older than requires-python "
                              f"{pyproject['project']['requires-python']}")
    assert environment["name"] == "radarlab"
