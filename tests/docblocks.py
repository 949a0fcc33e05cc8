"""The documentation's Python blocks: found, marked, run (CONTRIBUTING.md, "The documentation's code").

Every ```python block of README.md and docs/*.md is run by
tests/integration/test_docs_blocks.py, unless the line right above its fence is

    <!-- not runnable: <reason> -->

with a reason. A page runs one of two ways:

* a **script page**: its runnable blocks run in order in one namespace (a module of
  their own), as one plain script would: a block may use what an earlier one
  defined; a top-level ``await``, ``async with`` or ``async for`` is refused, as
  Python refuses it in a script (write ``async def main(): ...`` and
  ``asyncio.run(main())``); a block that calls ``asyncio.run(...)`` at its top level
  runs in a thread of its own, where no event loop runs yet, as in a script;
* a **test page**: when a runnable block defines a top-level ``test_*`` function,
  the page's runnable blocks together are a pytest module, run by pytest in a
  subprocess (the package's pytest plugin, ``asyncio_mode = "auto"``); every test
  in it must pass.

The documented servers, ``amqp://guest:guest@127.0.0.1/`` (or ``...:5672/``) and
``mongodb://127.0.0.1:27017/``, are rewritten to the test's own. Tracebacks name the
page and its line numbers.
"""

from __future__ import annotations

import ast
import asyncio
import re
import sys
import types
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Block",
    "MarkerError",
    "NotAScript",
    "blocks",
    "compile_block",
    "is_test_page",
    "module_source",
    "rewrite",
    "run_script",
    "tests_defined",
]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)")
_MARKER = re.compile(r"^<!--\s*not runnable\b(?P<rest>.*?)-->$")
_REASON = re.compile(r"^\s*:\s*(?P<reason>\S.*?)\s*$")
AMQP_URLS = ("amqp://guest:guest@127.0.0.1/", "amqp://guest:guest@127.0.0.1:5672/")
MONGO_URI = "mongodb://127.0.0.1:27017/"


class MarkerError(ValueError):
    """A page's blocks cannot be read: a marker without a reason, a marker away from a fence, an open fence."""


@dataclass(frozen=True, slots=True)
class Block:
    """One ```python block: where it is, its code, and why it is not run (None: it runs)."""

    page: str
    line: int  # the page's line number of the block's first code line (1-based)
    code: str
    not_runnable: str | None


def blocks(text: str, page: str) -> list[Block]:
    """The ```python blocks of one Markdown page, with their markers; :class:`MarkerError` if misused."""
    lines = text.splitlines()
    found: list[Block] = []
    pending: tuple[int, str] | None = None  # a marker on the line before: (its line number, its reason)
    n = 0
    while n < len(lines):
        line = lines[n]
        marker = _MARKER.match(line.strip())
        if marker is not None:
            reason = _REASON.match(marker.group("rest"))
            if reason is None:
                raise MarkerError(
                    f"{page}:{n + 1}: a not-runnable marker needs a reason: <!-- not runnable: <reason> -->"
                )
            pending = (n + 1, reason.group("reason"))
            n += 1
            continue
        fence = _FENCE.match(line)
        if fence is None:
            if pending is not None:
                raise MarkerError(f"{page}:{pending[0]}: a not-runnable marker must be right above a ```python fence")
            n += 1
            continue
        close = re.compile(rf"^[ \t]*{re.escape(fence.group('fence')[0])}{{{len(fence.group('fence'))},}}[ \t]*$")
        end = n + 1
        while end < len(lines) and close.match(lines[end]) is None:
            end += 1
        if end == len(lines):
            raise MarkerError(f"{page}:{n + 1}: a code fence that is never closed")
        if fence.group("info") == "python":
            indent = len(fence.group("indent"))
            code = "\n".join(body[indent:] if body[:indent].strip() == "" else body for body in lines[n + 1 : end])
            found.append(Block(page, n + 2, code + "\n", pending[1] if pending is not None else None))
        elif pending is not None:
            raise MarkerError(f"{page}:{pending[0]}: a not-runnable marker must be right above a ```python fence")
        pending = None
        n = end + 1
    if pending is not None:
        raise MarkerError(f"{page}:{pending[0]}: a not-runnable marker must be right above a ```python fence")
    return found


def rewrite(code: str, amqp_url: str, mongo_uri: str) -> str:
    """The documented servers replaced by the test's own (only where a URL is a whole string literal)."""
    for documented in AMQP_URLS:
        code = re.sub(re.escape(documented) + r"(?=[\"'])", amqp_url.replace("\\", "\\\\"), code)
    return re.sub(re.escape(MONGO_URI) + r"(?=[\"'])", mongo_uri.replace("\\", "\\\\"), code)


def tests_defined(page_blocks: list[Block]) -> list[str]:
    """The top-level ``test_*`` functions the runnable blocks define, in page order."""
    names: list[str] = []
    for block in page_blocks:
        if block.not_runnable is None:
            names += [
                node.name
                for node in ast.parse(block.code).body
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
            ]
    return names


def is_test_page(page_blocks: list[Block]) -> bool:
    """True when a runnable block defines a top-level ``test_*`` function: the page is a pytest module."""
    return bool(tests_defined(page_blocks))


class NotAScript(SyntaxError):
    """A block a plain script cannot run: an ``await``, ``async with`` or ``async for`` outside a function."""


def compile_block(block: Block, code: str | None = None) -> types.CodeType:
    """The block compiled as a plain script's code, so that tracebacks show the page and its own line numbers."""
    source = "\n" * (block.line - 1) + (block.code if code is None else code)
    try:
        code_object: types.CodeType = compile(source, block.page, "exec", dont_inherit=True)
    except SyntaxError as exc:
        if "outside" in (exc.msg or "") and ("await" in exc.msg or "async" in exc.msg):
            raise NotAScript(
                f"{block.page}:{exc.lineno}: {exc.msg}: a plain script cannot run this block; put the async code "
                "in 'async def main() -> None:' and end the block with 'asyncio.run(main())'"
            ) from exc
        raise
    return code_object


def module_source(page_blocks: list[Block], amqp_url: str, mongo_uri: str) -> str:
    """A test page's runnable blocks as one module, each block on its own page lines."""
    lines: list[str] = []
    for block in page_blocks:
        if block.not_runnable is not None:
            continue
        lines += [""] * (block.line - 1 - len(lines))
        lines += rewrite(block.code, amqp_url, mongo_uri).splitlines()
    return "\n".join(lines) + "\n"


def _runs_its_own_loop(block: Block) -> bool:
    """True when the block calls ``asyncio.run(...)`` at its top level (a script's entry point)."""
    for node in ast.parse(block.code).body:
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "asyncio.run":
            return True
    return False


async def run_script(page_blocks: list[Block], name: str, amqp_url: str, mongo_uri: str) -> dict[str, Any]:
    """Run a script page's runnable blocks in order in one fresh module; returns its namespace."""
    module = types.ModuleType(name)
    sys.modules[name] = module  # pydantic and typing resolve names through the defining module
    try:
        for block in page_blocks:
            if block.not_runnable is not None:
                continue
            code = compile_block(block, rewrite(block.code, amqp_url, mongo_uri))
            if _runs_its_own_loop(block):
                # A block written as a script (``asyncio.run(main())``) runs as a script does:
                # in a thread of its own, where no event loop is running yet.
                await asyncio.to_thread(eval, code, module.__dict__)
                continue
            exec(code, module.__dict__)
    finally:
        del sys.modules[name]
    return module.__dict__
