"""Installed versions of the dependencies whose internals the package reaches into.

A reach into another library's internals (``lily_mongo._amqp.patches``,
``lily_mongo.embedded``) is made only on the versions the test suite ran on:
:class:`VersionRange` names them, :func:`installed_version` reads what is installed.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

__all__ = ["VersionRange", "installed_version", "release"]

_RELEASE = re.compile(r"\d+(?:\.\d+)*")


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (its package metadata), or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"7.2.4"`` -> (7, 2, 4); ``"4.1.0rc1"`` -> (4, 1, 0)."""
    match = _RELEASE.match(version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


@dataclass(frozen=True, slots=True)
class VersionRange:
    """The versions of ``distribution`` the suite ran on: ``low`` (inclusive) up to ``high`` (exclusive)."""

    distribution: str
    low: tuple[int, ...]
    high: tuple[int, ...]

    def covers(self, version: str | None) -> bool:
        """True when ``version`` lies in the range (None, not installed, never does)."""
        return version is not None and self.low <= release(version) < self.high

    def __str__(self) -> str:
        return f"{self.distribution} {'.'.join(map(str, self.low))} up to {'.'.join(map(str, self.high))} (excluded)"
