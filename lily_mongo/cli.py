"""The ``lily-mongo`` command (docs/operations.md): its entry point; the commands live in ``lily_mongo._cli``.

``--version``, given to the command or to any of its subcommands, is answered here, before the
commands (typer, rich and the whole package) are imported: it costs the interpreter's start.
"""

from __future__ import annotations

import importlib.metadata
import sys

__all__ = ["main"]


def _asks_for_version(arguments: list[str]) -> bool:
    """``--version`` among the options (before a ``--`` that ends them)."""
    options = arguments[: arguments.index("--")] if "--" in arguments else arguments
    return "--version" in options


def main() -> None:
    if _asks_for_version(sys.argv[1:]):
        sys.stdout.write(f"lily-mongo {importlib.metadata.version('lily-mongo')}\n")
        return
    from ._cli import main as commands  # the commands: typer, rich and the package

    commands()
