"""The ``lily-mongo`` command (docs/operations.md): its entry point; the commands live in ``lily_mongo._cli``."""

from __future__ import annotations

from ._cli import main

__all__ = ["main"]
