"""The distributions: the license they declare is shipped, and the sdist takes an explicit file list."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# Tracked files that are not part of the project's distributions: CI wiring and git's own settings.
NOT_DISTRIBUTED = (".ci/", ".gitignore")


def test_the_mit_license_is_shipped_under_the_contributors_copyright() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License\n")
    assert "Copyright (c) lily_mongo contributors" in text


def sdist_patterns() -> list[str]:
    include: list[str] = PYPROJECT["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    return [pattern.lstrip("/") for pattern in include]


def test_the_sdist_include_list_names_files_not_directories() -> None:
    # A bare directory would take in whatever an untracked file left there.
    for pattern in sdist_patterns():
        assert (ROOT / pattern).is_file() or "*" in PurePosixPath(pattern).name, pattern


def tracked_files() -> list[str]:
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [path for path in listed.splitlines() if path and not path.startswith(NOT_DISTRIBUTED)]


def test_every_tracked_file_is_in_the_sdist_include_list() -> None:
    patterns = sdist_patterns()
    # PurePath.full_match is Python 3.13's, the tests' version; mypy reads them as the package's 3.12.
    missing = [
        path
        for path in tracked_files()
        if not any(PurePosixPath(path).full_match(pattern) for pattern in patterns)  # type: ignore[attr-defined]
    ]
    assert missing == []


def locked_version(package: str) -> str:
    lock = tomllib.loads((ROOT / "uv.lock").read_text(encoding="utf-8"))
    (version,) = [p["version"] for p in lock["package"] if p["name"] == package]
    return str(version)


def requirement_of(requirement_list: tuple[str, ...], package: str) -> str:
    requirements: Any = PYPROJECT["project"]
    for key in requirement_list:
        requirements = requirements[key]
    (requirement,) = [r for r in requirements if r.split(">=")[0].strip() == package]
    return str(requirement)


@pytest.mark.parametrize(
    ("requirement_list", "package"),
    [
        (("optional-dependencies", "cli"), "typer"),
        (("dependencies",), "aiormq"),
        (("dependencies",), "pamqp"),
        (("dependencies",), "aio-pika"),
    ],
)
def test_lower_bounds_are_the_locked_tested_versions(requirement_list: tuple[str, ...], package: str) -> None:
    # The command relies on typer's pretty_exceptions_show_locals=False; the connections on
    # aiormq's transport factory reaching it through aio-pika, the frame decoding on pamqp's
    # objects: only the locked versions are tested.
    requirement = requirement_of(requirement_list, package)
    assert requirement.split(",")[0] == f"{package}>={locked_version(package)}"


@pytest.mark.parametrize("package", ["aiormq", "pamqp"])
def test_libraries_reached_into_stop_before_their_next_major_version(package: str) -> None:
    major = int(locked_version(package).split(".")[0])
    assert requirement_of(("dependencies",), package).split(",")[1:] == [f"<{major + 1}"]


# -- the unit tier needs no extra -------------------------------------------------------------------

# The top-level modules each optional extra's distributions install (the OpenTelemetry SDK,
# a development dependency, shares the API's top-level package).
EXTRA_MODULES = {
    "typer": "typer",
    "rich": "rich",
    "pyyaml": "yaml",
    "mongoeco": "mongoeco",
    "opentelemetry-api": "opentelemetry",
    "aiohttp": "aiohttp",
    "prometheus-client": "prometheus_client",
    "watchfiles": "watchfiles",
}
LOCAL = ("lily_mongo", "tests")


def distribution(requirement: str) -> str:
    """The normalized distribution name a requirement line starts with (PEP 503)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match is not None, requirement
    return re.sub(r"[-_.]+", "-", match.group()).lower()


def test_the_extras_table_names_every_optional_distribution() -> None:
    declared = {distribution(r) for group in PYPROJECT["project"]["optional-dependencies"].values() for r in group}
    assert declared == set(EXTRA_MODULES)


def source_of(module: str) -> Path | None:
    """The file of a module of this repository (``lily_mongo``, ``tests``), None for anything else."""
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if module.split(".")[0] in LOCAL and candidate.is_file():
            return candidate
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class Imports(ast.NodeVisitor):
    """The absolute names a module imports when it runs.

    Skipped: imports under ``if TYPE_CHECKING:``, and in the body of a ``try`` that handles
    ``ImportError`` (an optional import with a fallback). Function bodies are read only
    with ``functions`` (a test module's functions are the tests: they run).
    """

    def __init__(self, package: str, *, functions: bool) -> None:
        self.package = package  # what a relative import starts from
        self.functions = functions
        self.names: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        checking = isinstance(node.test, ast.Name | ast.Attribute) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for statement in node.orelse if checking else [node.test, *node.body, *node.orelse]:
            self.visit(statement)

    def visit_Try(self, node: ast.Try) -> None:
        handled = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
        optional = bool(handled & {"ImportError", "ModuleNotFoundError", "(ImportError, ModuleNotFoundError)"})
        for statement in [*([] if optional else node.body), *node.handlers, *node.orelse, *node.finalbody]:
            self.visit(statement)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if self.functions:
            self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        self.names.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            origin = ".".join([*base, *([node.module] if node.module else [])])
        else:
            origin = node.module or ""
        self.names.add(origin)
        self.names.update(f"{origin}.{alias.name}" for alias in node.names)  # maybe submodules

    def visit_Call(self, node: ast.Call) -> None:
        # importlib.import_module("x") and pytest.importorskip("x") import as well.
        called = ast.unparse(node.func)
        if called.endswith(("import_module", "importorskip")) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self.names.add(first.value)
        self.generic_visit(node)


def tier_imports(tier: Path) -> dict[str, list[str]]:
    """Every top-level third-party module a test tier imports, with the chain of modules that leads there.

    The tier is its test modules, the conftest file above them and the package's pytest plugin; from
    there the imports are followed through this repository's modules (the package, tests.support).
    """
    roots = [*sorted(tier.rglob("*.py")), ROOT / "tests" / "conftest.py", ROOT / "lily_mongo" / "pytest_plugin.py"]
    chains: dict[Path, list[str]] = {path: [module_name(path)] for path in roots}
    queue = list(roots)
    found: dict[str, list[str]] = {}
    while queue:
        path = queue.pop()
        module = module_name(path)
        visitor = Imports(
            module if path.name == "__init__.py" else module.rpartition(".")[0], functions=path.is_relative_to(tier)
        )
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        for name in sorted(visitor.names):
            top = name.split(".")[0]
            if top in LOCAL:
                source = source_of(name)
                if source is not None and source not in chains:
                    chains[source] = [*chains[path], name]
                    queue.append(source)
            elif top and top not in sys.stdlib_module_names:
                found.setdefault(top, chains[path])
    return found


@pytest.mark.parametrize("tier", ["unit", "property"])
def test_the_tiers_that_need_nothing_import_no_optional_extra(tier: str) -> None:
    # CONTRIBUTING.md: the unit and property tiers need no server and no extra; what needs
    # an extra lives in tests/extras/.
    imported = tier_imports(ROOT / "tests" / tier)
    extras = {module: distribution for distribution, module in EXTRA_MODULES.items()}
    offending = [f"{m} ({extras[m]}), imported by {' -> '.join(imported[m])}" for m in sorted(imported) if m in extras]
    assert not offending, f"the {tier} tier imports optional extras:\n" + "\n".join(offending)
    # The walk reaches the package's own dependencies, so an empty result is not a blind walk.
    assert {"pymongo", "aio_pika", "pydantic", "orjson"} <= set(imported)


def test_the_import_walk_sees_an_import_of_an_extra() -> None:
    # The walk itself: a top-level, a function-local, a guarded and a type-checking import.
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import aiohttp.web\n"
        "from ..support import amqp_url\n"
        "if TYPE_CHECKING:\n    import rich\n"
        "try:\n    import yaml\nexcept ImportError:\n    yaml = None\n"
        "def f():\n    import typer\n    return importlib.import_module('mongoeco')\n"
    )
    in_tests, in_modules = Imports("tests.unit", functions=True), Imports("tests.unit", functions=False)
    for visitor in (in_tests, in_modules):
        visitor.visit(tree)
    assert {n.split(".")[0] for n in in_tests.names} == {"typing", "aiohttp", "tests", "typer", "mongoeco"}
    assert {n.split(".")[0] for n in in_modules.names} == {"typing", "aiohttp", "tests"}
    assert "tests.support.amqp_url" in in_modules.names
