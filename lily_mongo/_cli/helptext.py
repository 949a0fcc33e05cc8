"""The commands' ``--help`` as sentences: paragraphs reflowed, flags without a ``<bool>`` type, long
defaults (URLs) said in a paragraph of the command's help, at the full width, never cut."""

from __future__ import annotations

import re
from typing import Any

_LONG_DEFAULT = 16  # a default longer than this (a URL) is said in the command's help, whole


def reflow(text: str | None) -> str | None:
    """Single line breaks inside a paragraph become spaces; blank lines between paragraphs stay."""
    if not text:
        return text
    paragraphs = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def tidy(command: Any) -> None:
    """Tidy ``command``'s help, its options' and every subcommand's, in place (typer's own click
    objects, read by their attributes)."""
    command.help = reflow(command.help)
    command.epilog = reflow(command.epilog)
    defaults: list[str] = []
    for param in command.params:
        if getattr(param, "param_type_name", None) != "option":
            continue
        param.help = reflow(param.help)
        if param.is_flag:
            param.metavar = ""  # no "<bool>" type column for a flag
        default: Any = param.default
        if param.show_default is not False and isinstance(default, str) and len(default) > _LONG_DEFAULT:
            param.show_default = False
            param.help = f"{(param.help or '').rstrip('.')}; its default is in the text above.".lstrip("; ")
            defaults.append(f"{param.opts[0]} {default}")
    if defaults:
        said = "Defaults: " + "; ".join(defaults)
        command.help = f"{command.help}\n\n{said}" if command.help else said
    make_help = command.get_help_option

    def help_option(ctx: Any) -> Any:
        option = make_help(ctx)
        if option is not None:
            option.metavar = ""  # --help is a flag too
        return option

    command.get_help_option = help_option
    for sub in getattr(command, "commands", {}).values():
        tidy(sub)
