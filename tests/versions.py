"""Faking an installed version for the version-guarded patches (the library itself untouched)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from lily_mongo._amqp import patches


@contextlib.contextmanager
def untested(monkeypatch: pytest.MonkeyPatch, distribution: str, version: str = "8.0.0") -> Iterator[None]:
    """The version lookup reports ``distribution`` at ``version``; the frame path is chosen again
    inside the block and once more after it."""
    real: Callable[[str], str | None] = vars(patches)["installed_version"]  # the lookup patches makes now

    def reported(name: str) -> str | None:
        return version if name == distribution else real(name)

    monkeypatch.setattr(patches, "installed_version", reported)
    patches.active.cache_clear()
    try:
        yield
    finally:
        monkeypatch.setattr(patches, "installed_version", real)
        patches.active.cache_clear()
