"""One home per name: the package's layout, read with ast (nothing is imported).

A learner reads `from radarlab.x import y` in a notebook and looks for y in one file. These tests keep
that true: module file names are unique, no module reaches into another's private names, a name the
notebooks import is defined once, and README's package map lists every module.
"""
from __future__ import annotations

import ast
import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "radarlab"
NOT_NAMES = {"__init__", "__main__"}  # every package has them; they are named by their folder


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _dotted(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str | None, level: int, importer: Path) -> str:
    """The dotted name an ImportFrom refers to, relative imports resolved against the importer."""
    if not level:
        return module or ""
    package = _dotted(importer).split(".")
    if importer.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _is_radarlab_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _top_level_defs(path: Path) -> set[str]:
    return {node.name for node in _tree(path).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _notebook_imports() -> dict[str, set[str]]:
    """{name: notebooks} for every `from radarlab... import name` in a course notebook's code cells,
    names that are modules themselves left out."""
    found: dict[str, set[str]] = defaultdict(set)
    for nb_path in sorted((ROOT / "notebooks").glob("0*.ipynb")):
        for cell in json.loads(nb_path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"])
            magic = ("%", "!")  # IPython's magics and shell lines are not Python
            source = "\n".join("" if line.lstrip().startswith(magic) else line
                               for line in source.splitlines())
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "radarlab":
                    for alias in node.names:
                        if not _is_radarlab_module(f"{node.module}.{alias.name}"):
                            found[alias.name].add(nb_path.name)
    return found


def test_the_walk_sees_the_package():
    """Guards the tests below against passing on an empty walk."""
    names = {_dotted(p) for p in _modules()}
    assert {"radarlab", "radarlab.util", "radarlab.lab.roofline", "radarlab.lab.kernel_bench"} <= names
    assert len(_notebook_imports()) > 20


def test_module_file_names_are_unique():
    """Module file names, and package folder names beside them: `from radarlab.attention import bench`
    next to `from radarlab import bench` would be two homes for one name."""
    by_name = defaultdict(list)
    for path in _modules():
        if path.stem not in NOT_NAMES:
            by_name[path.stem].append(str(path.relative_to(ROOT)))
        elif path.stem == "__init__" and path.parent != PACKAGE:
            by_name[path.parent.name].append(str(path.parent.relative_to(ROOT)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"modules sharing a file name: {clashes}"


def test_no_module_imports_another_modules_private_names():
    """A _name is its module's own business: used from elsewhere, it is public in all but name."""
    bad = []
    for path in _modules():
        here = _dotted(path)
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _absolute(node.module, node.level, path)
            # another project's internals are its business
            if source == here or source.split(".")[0] != "radarlab":
                continue
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {source}"
                    for alias in node.names if _is_private(alias.name)]
    assert not bad, ("private names imported across modules (make them public, or move them):\n"
                     + "\n".join(bad))


def test_names_notebooks_import_have_one_home():
    defined = defaultdict(list)
    for path in _modules():
        for name in _top_level_defs(path):
            defined[name].append(_dotted(path))
    imported = _notebook_imports()
    twice = {name: defined[name] for name in sorted(imported) if len(defined[name]) > 1}
    assert not twice, f"names the notebooks import, defined in more than one module: {twice}"


def _package_map() -> dict[str, str]:
    """README's "The package" block as {folder: its text}, "" for modules directly under radarlab/."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## The package\n.*?```\n(.*?)```", text, re.S)
    assert block, "README.md has no ``` block under '## The package'"
    sections: dict[str, str] = defaultdict(str)
    current = ""
    for line in block.group(1).splitlines()[1:]:  # the first line is radarlab/ itself
        folder = re.match(r"^  ([\w/]+)/\s", line + " ")
        if folder:
            current = folder.group(1)
        elif re.match(r"^  \S", line):  # a module directly under radarlab/
            current = ""
        sections[current] += line + "\n"
    return sections


def test_readme_package_map_lists_every_module():
    sections = _package_map()
    missing = []
    for path in _modules():
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(PACKAGE)
        folder = "/".join(rel.parts[:-1])
        if not re.search(rf"(?<![\w/]){re.escape(path.name)}", sections.get(folder, "")):
            missing.append(str(rel))
    assert not missing, f"modules README's package map does not list (under their folder): {missing}"


@pytest.mark.parametrize("importer, module, level, expected", [
    ("radarlab/engine/engine.py", "kvcache.kv_cache_manager", 2, "radarlab.kvcache.kv_cache_manager"),
    ("radarlab/engine/engine.py", "scheduler", 1, "radarlab.engine.scheduler"),
    ("radarlab/engine/__init__.py", "llm_engine", 1, "radarlab.engine.llm_engine"),
    ("radarlab/util.py", "radarlab.device", 0, "radarlab.device"),
])
def test_relative_imports_resolve(importer, module, level, expected):
    assert _absolute(module, level, ROOT / importer) == expected


@pytest.mark.parametrize("module", ["radarlab.sample.rejection_sampler", "radarlab.spec_decode.draft_model",
                                    "radarlab.spec_decode.speculative_config", "radarlab.sample.sampler",
                                    "radarlab.engine.llm_engine"])
def test_modules_import_first_in_a_fresh_interpreter(module):
    """The engine uses the spec package and the spec package uses the engine's sampler: whichever a
    learner imports first must load (no circular import)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


# --- rooms: the package graph ------------------------------------------------------------------
# The core a learner reads, bottom room first; the instruments sit above it and the core imports
# none of them (README's reading order follows CORE).
CORE = ("util", "device", "corpus", "quant", "cpu_ops", "kvcache", "attention", "models",
        "sample", "spec_decode", "engine")
INSTRUMENTS = ("lab", "validate", "bench", "train", "viz", "checks", "exercises")


def _room(dotted: str) -> str:
    """radarlab.kvcache.block_pool -> kvcache; radarlab.util -> util; radarlab itself -> ''."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every radarlab module the file imports, at any depth (imports inside functions count: they
    tie the rooms together just the same), with its line."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names
                      if alias.name.split(".")[0] == "radarlab"]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node.module, node.level, path)
            if source.split(".")[0] != "radarlab":
                continue
            for alias in node.names:  # `from radarlab import bench` names a room, not a name
                target = f"{source}.{alias.name}"
                found.append((target if _is_radarlab_module(target) else source, node.lineno))
    return found


def _room_edges() -> dict[tuple[str, str], list[str]]:
    """{(room, room it imports): ["file:line", ...]} between different rooms of radarlab."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in _modules():
        here = _room(_dotted(path))
        for target, line in _imports(path):
            there = _room(target)
            if here and there and here != there:
                edges[here, there].append(f"{path.relative_to(ROOT)}:{line}")
    return edges


def _cycles(edges) -> list[list[str]]:
    """The strongly connected components with more than one room (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    """Guards the test below: a made-up graph with one cycle of three rooms and a tail."""
    edges = {("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("c", "d"): []}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({("a", "b"): []}) == []


def test_no_import_cycles_between_rooms():
    """A room (a package, or a module directly under radarlab/) never imports, even inside a
    function, a room that imports it back: then each can be read, and replaced, from below."""
    edges = _room_edges()
    assert ("engine", "kvcache") in edges  # the walk sees imports at all
    bad = []
    for component in _cycles(edges):
        ties = [f"  {a} -> {b}: {', '.join(edges[a, b][:3])}" for a in component for b in component
                if (a, b) in edges]
        bad.append(" <-> ".join(component) + "\n" + "\n".join(ties))
    assert not bad, "import cycles between radarlab's rooms:\n" + "\n".join(bad)


def test_every_room_is_core_or_instrument():
    rooms = {_room(_dotted(p)) for p in _modules()} - {""}
    unknown = rooms - set(CORE) - set(INSTRUMENTS)
    assert not unknown, ("rooms neither in CORE nor in INSTRUMENTS (tests/test_package_layout.py): "
                         f"{sorted(unknown)}")


def test_the_core_imports_no_instrument():
    """Benchmarks, validation, plots, checkers and training sit above the engine; the engine a
    learner reads never needs them."""
    bad = [f"{a} -> {b}: {', '.join(where[:3])}" for (a, b), where in sorted(_room_edges().items())
           if a in CORE and b in INSTRUMENTS]
    assert not bad, "the core imports instruments:\n" + "\n".join(bad)


def test_rooms_import_only_rooms_below_them():
    """CORE, then INSTRUMENTS, are listed bottom room first: a room imports only rooms listed
    before it, so the package reads from the bottom up."""
    order = {room: i for i, room in enumerate(CORE + INSTRUMENTS)}
    bad = [f"{a} -> {b}: {', '.join(where[:3])}" for (a, b), where in sorted(_room_edges().items())
           if a in order and b in order and order[b] > order[a]]
    assert not bad, "rooms importing a room above them (the order of CORE + INSTRUMENTS):\n" + "\n".join(bad)


def test_readme_reading_order_lists_the_core_with_its_line_counts():
    """README's "The core, file by file": every core module once, in rooms' order, its line count
    within 20% (or 10 lines) of the file, so the reading order cannot quietly go stale."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"### The core, file by file\n(.*?)\n\n(?=\S)(?!\d+\.)", text + "\n\nEND", re.S)
    assert section, "README.md has no '### The core, file by file' section"
    listed = re.findall(r"`([\w/]+\.py)` \((\d+)\)", section.group(1))
    assert len(listed) > 40, "the walk sees the list"
    names = [name for name, _ in listed]
    core = sorted(str(p.relative_to(PACKAGE)) for p in _modules()
                  if _room(_dotted(p)) in CORE and (p.name != "__init__.py" or p.parent.name == "backends"))
    assert sorted(names) == core, ("core modules missing from README's reading order: "
                                   f"{sorted(set(core) - set(names))}; "
                                   f"listed but not core modules: {sorted(set(names) - set(core))}")
    rooms = [CORE.index(_room("radarlab." + name.split("/")[0].removesuffix(".py"))) for name in names]
    assert rooms == sorted(rooms), "README's reading order follows CORE's order of rooms"
    stale = []
    for name, count in listed:
        actual = len((PACKAGE / name).read_text(encoding="utf-8").splitlines())
        if abs(actual - int(count)) > max(10, 0.2 * actual):
            stale.append(f"{name}: README says {count}, the file has {actual}")
    assert not stale, "README's line counts are stale:\n" + "\n".join(stale)
