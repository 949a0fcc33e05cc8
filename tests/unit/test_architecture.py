"""The package's shape, held against what the guides say of it (CONTRIBUTING.md, docs/design.md, docs/).

* the layer map in CONTRIBUTING.md is the one the import-linter contracts define;
* the import graph has no circle at all, imports made only for type checking included;
* docs/design.md, section 2, names exactly the public surface (``__all__``);
* every name the documentation imports, or names as ``lily_mongo.module.name``, exists.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import runpy
from pathlib import Path

import grimp
import pytest

import lily_mongo
import lily_mongo.envelope
import lily_mongo.testing

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_contributing_layer_map_is_the_contracts() -> None:
    generated = runpy.run_path(str(ROOT / "scripts" / "layer_map.py"))["layer_map"]()
    guide = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    assert generated in guide, "CONTRIBUTING.md's layer map differs: run `uv run python scripts/layer_map.py`"


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert circles(graph) == [["p.a", "p.b", "p.c"]]


def test_the_import_graph_has_no_circle_type_checking_imports_included() -> None:
    graph = grimp.build_graph("lily_mongo", exclude_type_checking_imports=False)
    assert circles(graph) == []


def design_section_two() -> str:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return text.split("## 2. The public surface", 1)[1].split("\n## 3.", 1)[0]


def imported_names(code: str) -> dict[str, set[str]]:
    """``from X import a, b`` statements of ``code``: module -> names."""
    names: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return names


def test_design_section_two_names_exactly_the_public_surface() -> None:
    (block,) = re.findall(r"```python\n(.*?)```", design_section_two(), flags=re.S)
    named = imported_names(block)
    assert named["lily_mongo"] == set(lily_mongo.__all__)
    assert named["lily_mongo.testing"] == set(lily_mongo.testing.__all__)
    assert named["lily_mongo.envelope"] <= set(lily_mongo.envelope.__all__)


def documented_names() -> set[tuple[str, str]]:
    """(module, name) for every ``from lily_mongo... import name`` in a Python block of the docs, and every
    ``lily_mongo.module.Name`` written in their text."""
    found: set[tuple[str, str]] = set()
    for page in DOCS:
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
            try:
                statements = imported_names(block)
            except SyntaxError:  # a fragment (a signature, a call): its imports are read below
                statements = {}
            for module, names in statements.items():
                if module.split(".")[0] == "lily_mongo":
                    found.update((module, name) for name in names)
        for dotted in re.findall(r"\blily_mongo(?:\.[A-Za-z_]\w*)+", text):
            module, _, name = dotted.rpartition(".")
            found.add((module, name))
    return found


@pytest.mark.parametrize(("module", "name"), sorted(documented_names()), ids=lambda value: value)
def test_every_documented_name_exists(module: str, name: str) -> None:
    imported = importlib.import_module(module)  # a module the docs name must exist
    assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}") is not None, f"{module}.{name}"
