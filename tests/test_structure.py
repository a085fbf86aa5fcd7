"""The shape of the package, held: few modules at the top (the folders say what lives where),
no file over 500 lines, no function over 60 lines, and one `Stages` class whatever the
placement (ports change where work runs, never the stage methods)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "src" / "rollwise"
MAX_TOP_LEVEL = 8
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def _sources() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def test_few_modules_at_the_top_and_every_folder_says_what_it_holds():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
    for folder in (p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"):
        init = folder / "__init__.py"
        assert init.exists(), folder.name
        assert ast.get_docstring(ast.parse(init.read_text())), f"{folder.name}/__init__.py"


def test_no_file_over_the_line_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, long


def test_no_function_over_the_line_limit():
    long = [f"{p.relative_to(PACKAGE)}:{node.lineno} {node.name} "
            f"({node.end_lineno - node.lineno + 1} lines)"
            for p, tree in _sources().items() for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_one_stages_class_for_every_placement():
    defined, subclasses = [], []
    for p, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                if node.name == "Stages":
                    defined.append(p.relative_to(PACKAGE))
                if any(ast.unparse(b).split(".")[-1] == "Stages" for b in node.bases):
                    subclasses.append(f"{p.relative_to(PACKAGE)}:{node.name}")
    assert defined == [Path("pipeline/stages.py")] and not subclasses, (defined, subclasses)
