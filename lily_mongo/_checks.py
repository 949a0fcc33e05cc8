"""Option checks: each raises :class:`ConfigError` naming the field, the value and the bound.

Options are checked once, when they are given (docs/design.md, options); the
value in a message is a bounded description (:func:`describe_value`), never an
unbounded echo of what the caller passed, and a URL is shown redacted. Pure: no
I/O library is imported (pure modules such as :mod:`lily_mongo.content` use it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from yarl import URL

from ._errors import ConfigError
from ._nodes import MAX_NODES, NodeMismatch, join_nodes, split_nodes
from ._redact import redact_url
from ._text import describe_value
from .bounds import utf8_len

__all__ = ["check_amqp_url", "check_bool", "check_callable", "check_database_name", "check_int", "check_seconds"]


def check_int(field: str, value: object, low: int, high: int) -> int:
    """An integer (not a bool) within ``low..high``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{field} must be an integer {low}..{high}, got {describe_value(value)}")
    return value


def check_seconds(field: str, value: object, *, low: float, high: float, low_inclusive: bool = True) -> float:
    """A finite number of seconds within the bounds (``> low`` when ``low_inclusive`` is false)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{field} must be a finite number of seconds, got {describe_value(value)}")
    if not (low <= value if low_inclusive else low < value) or value > high:
        bound = f"{_num(low)}..{_num(high)}" if low_inclusive else f"> {_num(low)} and <= {_num(high)}"
        raise ConfigError(f"{field} must be {bound} seconds, got {describe_value(value)}")
    return float(value)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def check_bool(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{field} must be True or False, got {describe_value(value)}")
    return value


def check_callable(field: str, value: object) -> Callable[..., Any]:
    if not callable(value):
        raise ConfigError(f"{field} must be callable, got {describe_value(value)}")
    return value


def check_amqp_url(field: str, value: object) -> str:
    """An ``amqp://`` or ``amqps://`` URL with a host, as aio-pika parses it; shown redacted when refused.

    Several nodes of a cluster (docs/deployment.md, "Clusters") are either one URL with a
    comma-separated host list (``amqp://u:p@h1:5672,h2:5672/vhost``) or a list of single-node
    URLs that differ in their host and port only; both come back as the one URL with a host
    list, which :func:`lily_mongo._nodes.split_nodes` cuts into the nodes tried in turn.
    """
    if isinstance(value, list | tuple):
        if not 1 <= len(value) <= MAX_NODES:
            raise ConfigError(f"{field} must list 1..{MAX_NODES} node URLs, got a list of {len(value)}")
        urls = [check_amqp_url(f"{field}[{i}]", url) for i, url in enumerate(value)]
        try:
            joined = join_nodes(urls)
        except NodeMismatch as exc:
            raise ConfigError(
                f"{field}[{exc.index}] must differ from {field}[0] in its host and port only (the same scheme, "
                f"user, password, virtual host and options), got {redact_url(urls[exc.index])[:200]!r} "
                f"after {redact_url(urls[0])[:200]!r}"
            ) from None
        return _check_one_url(field, joined)
    return _check_one_url(field, value)


def _check_one_url(field: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"{field} must be an amqp:// or amqps:// URL (or a list of them), got {describe_value(value)}"
        )
    try:
        nodes = split_nodes(value)
    except ValueError:
        nodes = ()
    if len(nodes) > MAX_NODES:
        raise ConfigError(f"{field} must name 1..{MAX_NODES} nodes, got {len(nodes)} in {redact_url(value)[:200]!r}")
    valid = bool(nodes)
    for node in nodes:
        try:
            url = URL(node)
            valid = valid and url.scheme in ("amqp", "amqps") and bool(url.host) and (url.port is None or url.port > 0)
        except (ValueError, TypeError):
            valid = False
    if not valid or utf8_len(value) > 4096:
        raise ConfigError(f"{field} must be an amqp:// or amqps:// URL with a host, got {redact_url(value)[:200]!r}")
    return value


# MongoDB database names: at most 63 bytes, none of these characters (MongoDB's naming restrictions).
_DATABASE_NAME_BYTES = 63
_DATABASE_NAME_FORBIDDEN = frozenset('/\\. "$\x00')


def check_database_name(field: str, database: object) -> str:
    """A MongoDB database name: 1..63 bytes without ``/ \\ . " $``, space or NUL."""
    if not isinstance(database, str) or not database:
        raise ConfigError(f"{field} is required with a mongo_client: a name, got {describe_value(database)}")
    if utf8_len(database) > _DATABASE_NAME_BYTES or _DATABASE_NAME_FORBIDDEN.intersection(database):
        raise ConfigError(
            f"{field} must be a MongoDB database name of 1..{_DATABASE_NAME_BYTES} bytes without any of "
            f'/ \\ . space " $ or NUL, got {describe_value(database, 70)}'
        )
    return database
