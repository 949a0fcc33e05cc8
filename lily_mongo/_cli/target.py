"""A command's target, ``module:attribute``: a Consumer, or a function taking no arguments that returns one."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
import sys
from typing import TYPE_CHECKING

from .._text import describe_value
from .errors import fail
from .exit_codes import ExitCode

if TYPE_CHECKING:
    from .._lifecycle import Consumer
    from .._outbox import Outbox

    pass


def _imported(module_name: str) -> object:
    """The target's module, imported from the current directory as ``python -m`` would."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            fail(ExitCode.USAGE, f"cannot import {module_name!r}: no such module (run from your project's root)")
        fail(ExitCode.USAGE, f"importing {module_name!r} failed: {exc}")
    except Exception as exc:
        fail(ExitCode.USAGE, f"importing {module_name!r} failed: {type(exc).__name__}: {exc}")


def load_consumer(target: str) -> Consumer:
    """Import ``module:attribute``: a Consumer, or a plain function taking no arguments that returns one.

    Anything else (a class, an async function or ``@queue`` handler, a function that
    needs arguments or returns something else) is refused without being called on a guess.
    """
    from .._lifecycle import Consumer  # the package: imported when a command needs a target, not for --help
    from .._plan.routes import routes_of

    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        fail(ExitCode.USAGE, f"expected module:attribute (for example myservice:consumer), got {target!r}")
    value = getattr(_imported(module_name), attribute, None)
    if value is None:
        fail(ExitCode.USAGE, f"module {module_name!r} has no attribute {attribute!r}")
    if isinstance(value, Consumer):
        return value
    expected = "give a lily_mongo.Consumer, or a function taking no arguments that returns one"
    if isinstance(value, type):
        fail(ExitCode.USAGE, f"{target} is a class ({value.__name__}), not a lily_mongo.Consumer; {expected}")
    if routes_of(value):
        fail(ExitCode.USAGE, f"{target} is a @queue handler, not a lily_mongo.Consumer; {expected}")
    if inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value):
        fail(ExitCode.USAGE, f"{target} is an async function, not a lily_mongo.Consumer; {expected}")
    if not (inspect.isfunction(value) or inspect.ismethod(value) or isinstance(value, functools.partial)):
        fail(ExitCode.USAGE, f"{target} is a {type(value).__name__}, not a lily_mongo.Consumer; {expected}")
    required = [
        p.name
        for p in inspect.signature(value).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        fail(ExitCode.USAGE, f"{target} needs arguments ({', '.join(required)}); {expected}")
    try:
        made = value()
    except Exception as exc:
        fail(ExitCode.USAGE, f"calling {target}() failed: {type(exc).__name__}: {exc}")
    if inspect.isawaitable(made):
        if inspect.iscoroutine(made):
            made.close()
        fail(ExitCode.USAGE, f"{target}() returned an awaitable, not a lily_mongo.Consumer; {expected}")
    if not isinstance(made, Consumer):
        fail(ExitCode.USAGE, f"{target}() returned {describe_value(made)}, not a lily_mongo.Consumer; {expected}")
    return made


def consumer_urls(consumer: Consumer | None) -> str | None:
    return consumer.settings.amqp_url if consumer is not None else None


def load_outbox(target: str) -> Outbox:
    """Import ``module:attribute``, an :class:`~lily_mongo.Outbox` (for its ``sends()`` declarations)."""
    from .._outbox import Outbox

    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        fail(ExitCode.USAGE, f"--outbox: expected module:attribute (for example myservice:outbox), got {target!r}")
    value = getattr(_imported(module_name), attribute, None)
    if not isinstance(value, Outbox):
        fail(ExitCode.USAGE, f"--outbox: {target} is not a lily_mongo.Outbox (got {type(value).__name__})")
    return value
