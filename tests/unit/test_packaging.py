"""The distributions: the license they declare is shipped, and the sdist takes an explicit file list."""

from __future__ import annotations

import subprocess
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
    missing = [
        path for path in tracked_files() if not any(PurePosixPath(path).full_match(pattern) for pattern in patterns)
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
