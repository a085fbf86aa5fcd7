"""The import graph runs one way: no module of rollwise imports a module that imports it
back, at load time or lazily inside a function (type-checking-only imports left out)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "src"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """rollwise modules `path` imports anywhere (TYPE_CHECKING blocks left out)."""
    out: set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import module` names a module too
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known}


def test_no_import_cycles():
    files = {_module(p): p for p in ROOT.joinpath("rollwise").rglob("*.py")}
    # a package's __init__ re-exporting its own modules is not a cycle
    graph = {m: {n for n in _imports(p, set(files)) if n != m and not n.startswith(m + ".")}
             for m, p in files.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert "rollwise.engine.native" not in graph["rollwise.rollout.scheduler"]
    # the engine composes its admission and verifier; they never reach back into it
    for part in ("rollwise.engine.admission", "rollwise.engine.verifier"):
        assert "rollwise.engine.native" not in graph[part], part
    assert "rollwise.pipeline.build" not in graph["rollwise.pipeline.loop"]
