"""The ``lily-mongo`` command: one module per command group (docs/operations.md)."""

from __future__ import annotations

from .app import app, main

__all__ = ["app", "main"]
