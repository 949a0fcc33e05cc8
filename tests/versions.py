"""Faking an installed version for the version-guarded patches (the library itself untouched)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from lily_mongo._amqp import patches


@contextlib.contextmanager
def untested(monkeypatch: pytest.MonkeyPatch, distribution: str, version: str = "8.0.0") -> Iterator[None]:
    """The version lookup reports ``distribution`` at ``version``; the frame path is chosen again
    inside the block and once more after it."""
    real = patches.installed_version
    monkeypatch.setattr(patches, "installed_version", lambda name: version if name == distribution else real(name))
    patches.active.cache_clear()
    try:
        yield
    finally:
        monkeypatch.setattr(patches, "installed_version", real)
        patches.active.cache_clear()
