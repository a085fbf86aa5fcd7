"""The import graph runs one way, and each part imports only the parts below it.

Every import of a rollwise module counts: at module level, deferred inside a function, and
under `if TYPE_CHECKING:` (a type-only import still ties the two modules together; the target
is no circle counting them all). An import is an edge to the module it names and to each
package above that module whose `__init__` runs on the way (the package face), except the
importer's own packages, which Python has loaded before the importer. `from rollwise.pkg
import name` is also an edge to the module that defines `name`, followed through the
re-exports of `pkg/__init__.py`; a package's `__init__` importing its own modules is an edge
like any other. The root `rollwise/__init__.py` names its lazy attributes as strings and
imports nothing, so it is left out.

`LAYERS` names, for each folder and top-level module of the package, the others it may
import; docs/architecture.md ("Allowed imports") shows the same table.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parents[1] / "src"
DOC = Path(__file__).parents[1] / "docs" / "architecture.md"

# the components and what they stand on
_COMPONENTS = ("types", "registry", "system", "algos", "models", "replay", "engine", "rewards",
               "control", "envs", "tasks", "learner", "rollout")
# part -> the parts it may import; each part after the parts it imports
LAYERS: dict[str, tuple[str, ...]] = {
    "types": (),
    "registry": (),
    "system": (),
    "algos": ("registry",),
    "models": ("types", "system"),
    "replay": ("types",),
    "observe": ("types", "system", "replay"),
    "engine": ("types", "registry", "system"),
    "rewards": ("types", "registry", "system"),
    "control": ("types", "registry"),
    "envs": ("types", "rewards"),
    "tasks": ("types", "registry", "rewards", "envs"),
    "learner": ("types", "system", "algos", "models", "engine"),  # engine: its attention
    "rollout": ("types", "system", "replay", "engine", "rewards", "envs"),
    "compose": (*_COMPONENTS, "observe"),  # observe: the logger sinks' names
    "run": (*_COMPONENTS, "observe", "compose"),
    "distributed": (*_COMPONENTS, "compose"),
    "pipeline": (*_COMPONENTS, "observe", "compose", "run", "distributed"),
    # the front ends: only a front end after them in this table imports them (the root
    # package reaches `api` lazily, by name)
    "serve": ("types", "system", "models", "engine", "envs", "run"),
    "api": ("types", "rewards", "compose", "pipeline"),
    "bench": (*_COMPONENTS, "observe", "compose", "run", "distributed", "pipeline", "serve"),
    "cli": (*_COMPONENTS, "observe", "compose", "run", "pipeline", "serve", "bench"),
    "__main__": ("cli",),
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _files() -> dict[str, Path]:
    paths = ROOT.joinpath("rollwise").rglob("*.py")
    return {m: p for m, p in ((_module(p), p) for p in paths) if m != "rollwise"}


def _part(module: str) -> str:
    """The folder or top-level module holding `module`: rollwise.engine.base -> engine."""
    return module.split(".")[1]


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_files()[module].read_text())


def _definer(module: str, name: str) -> str:
    """The module that defines `name` as read from `module`: re-exports of a package's
    `__init__` are followed to the module they come from."""
    if _files()[module].name != "__init__.py":
        return module
    for node in _tree(module).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in _files():
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _definer(node.module, alias.name)
    return module


def _named(tree: ast.Module) -> set[str]:
    """The rollwise modules an import anywhere in `tree` names or resolves to."""
    files = _files()
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in files:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in files:  # `from pkg import module`: pkg runs as the module's package
                    out.add(sub)
                else:  # a name: the module (a package's `__init__` too) must have bound it
                    out.update({node.module, _definer(node.module, alias.name)})
    return {m for m in out if m in files}


def _edges(module: str) -> set[str]:
    """`module`'s edges: what it names, and the packages above those, not above itself."""
    named = _named(_tree(module))
    faces = {face for target in named for face in _packages(target)}
    return (named | faces - _packages(module)) - {module}


def _packages(module: str) -> set[str]:
    """The packages above `module`, the root left out: rollwise.engine.base -> rollwise.engine."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))}


@cache
def _graph() -> dict[str, frozenset[str]]:
    return {m: frozenset(_edges(m)) for m in _files()}


def _cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """One cycle through each strongly connected set of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in sorted(graph[m]):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            members = set(stack[stack.index(m):])
            del stack[stack.index(m):]
            if len(members) > 1:
                found.append(_cycle_through(m, members, graph))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def _cycle_through(start: str, members: set[str], graph: dict[str, frozenset[str]]) -> list[str]:
    """The shortest path from `start` back to itself inside `members`."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        m = todo.pop(0)
        for n in sorted(graph[m] & members):
            if n == start:
                return paths[m] + [start]
            if n not in paths:
                paths[n] = paths[m] + [n]
                todo.append(n)
    raise AssertionError(f"{start} is in no cycle")


def test_no_import_cycles():
    cycles = [" -> ".join(c) for c in _cycles(_graph())]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_imports_follow_the_layers():
    upward = sorted(f"{m} -> {n}" for m, targets in _graph().items() for n in targets
                    if _part(n) != _part(m) and _part(n) not in LAYERS[_part(m)])
    assert not upward, "imports the layers do not allow:\n" + "\n".join(upward)


def test_layers_are_a_dag_in_order():
    order = list(LAYERS)
    for part, allowed in LAYERS.items():
        later = [p for p in allowed if order.index(p) >= order.index(part)]
        assert not later, f"{part} may import {later}, listed at or after it"


def test_every_part_has_a_layer():
    parts = {_part(m) for m in _files()}
    assert parts == set(LAYERS), (parts - set(LAYERS), set(LAYERS) - parts)


def _doc_layers() -> dict[str, tuple[str, ...]]:
    """The table of docs/architecture.md's section "Allowed imports": part -> may import."""
    section = DOC.read_text().split("\n## Allowed imports\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    table = {}
    for row in rows:
        part, allowed = (cell.strip() for cell in row.strip("|").split("|")[:2])
        table[part.strip("`")] = tuple(re.findall(r"`([^`]+)`", allowed))
    return table


def test_architecture_doc_shows_the_layers():
    assert _doc_layers() == LAYERS


def test_engine_parts_stay_apart():
    graph = _graph()
    assert "rollwise.engine.native" not in graph["rollwise.rollout.scheduler"]
    # the engine composes its admission and verifier; they never reach back into it
    for part in ("rollwise.engine.admission", "rollwise.engine.verifier"):
        assert "rollwise.engine.native" not in graph[part], part
    assert "rollwise.pipeline.build" not in graph["rollwise.pipeline.loop"]


def _face_imports(part: str) -> tuple[str, ...] | None:
    """What `part/__init__.py`'s docstring says the folder may import: its paragraph
    "May import: a, b, c." (or "May import: nothing from rollwise."), None if it has none."""
    doc = ast.get_docstring(_tree(f"rollwise.{part}")) or ""
    for paragraph in doc.split("\n\n"):
        text = " ".join(paragraph.split())
        if text.startswith("May import: "):
            names = text.removeprefix("May import: ").split(".")[0]
            return () if names.startswith("nothing") else tuple(
                n.strip().strip("`") for n in names.split(","))
    return None


def test_every_folder_face_says_what_it_may_import():
    """Each folder's `__init__` says what lives there (its docstring's first paragraph) and
    what the folder may import, in the words of `LAYERS` (same names, any order)."""
    folders = sorted(p.parent.name for p in ROOT.joinpath("rollwise").glob("*/__init__.py"))
    wrong = {part: (_face_imports(part), LAYERS[part]) for part in folders
             if _face_imports(part) is None
             or sorted(_face_imports(part)) != sorted(LAYERS[part])}
    assert not wrong, f"__init__ docstring -> LAYERS: {wrong}"
