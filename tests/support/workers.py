"""What the worker scripts of the process tests (``tests/integration/workers``) share.

A worker writes one JSON object a line on stdout (:func:`emit`), takes the connection arguments of
:func:`worker_parser` (its consumer made of them by :func:`worker_consumer`), announces ``{"ready": name}``
once it serves and runs until SIGTERM (:func:`serve`), and a consumer's worker ends with its terminal
observations (:func:`emit_observations`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any, Protocol

from pymongo import AsyncMongoClient

from lily_mongo import Consumer, ManagedConsumer, ShutdownReport


class Served(Protocol):
    def install_signal_handlers(self) -> Callable[[], None]: ...

    async def wait(self) -> ShutdownReport: ...


def emit(record: dict[str, Any]) -> None:
    """Write ``record`` as one JSON line on stdout, flushed: the test reads it while the worker runs."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def worker_parser(description: str | None, *, consumer: bool = True) -> argparse.ArgumentParser:
    """The arguments every worker takes (``--mongo-uri``, ``--amqp``, ``--database``, ``--name``); a
    ``consumer`` worker also needs its ``--queue`` and ``--handler-id``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--mongo-uri", required=True)
    parser.add_argument("--amqp", required=True)
    parser.add_argument("--database", required=True)
    parser.add_argument("--name", required=True)
    if consumer:
        parser.add_argument("--queue", required=True)
        parser.add_argument("--handler-id", required=True)
    return parser


def worker_consumer(args: argparse.Namespace, client: AsyncMongoClient[Any] | None = None, **options: Any) -> Consumer:
    """The worker's consumer (``--amqp``, ``--database``, ``--name``), on ``client`` or, if none is given, on a
    client of ``--mongo-uri`` of its own, which it closes when it stops."""
    owns = client is None
    if client is None:
        client = AsyncMongoClient(args.mongo_uri, serverSelectionTimeoutMS=10_000)
    return Consumer(
        amqp_url=args.amqp,
        mongo_client=client,
        database=args.database,
        name=args.name,
        owns_mongo_client=owns,
        **options,
    )


async def serve(process: Served, name: str) -> ShutdownReport:
    """Stop ``process`` on SIGTERM, announce ``{"ready": name}`` and wait for it to end."""
    process.install_signal_handlers()
    emit({"ready": name, "pid": os.getpid()})
    return await process.wait()


def emit_observations(managed: ManagedConsumer, report: ShutdownReport, *fields: str) -> None:
    """Announce the consumer's ended deliveries (``fields`` of each, and its event id) and how it stopped."""
    emit(
        {
            "observations": [
                {**{field: getattr(o, field) for field in fields}, "event_id": str(o.event_id)}
                for o in managed.delivery_terminal_observations()
            ],
            "succeeded": report.succeeded,
            "unresolved": report.unresolved,
        }
    )
