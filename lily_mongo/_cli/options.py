"""What several commands share: the default URLs, their options, the consoles, the version."""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

if TYPE_CHECKING:
    pass


DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


DEFAULT_MONGO_URI = "mongodb://127.0.0.1:27017/"


console = Console()


err_console = Console(stderr=True)


AMQP_HINT = "is it running? Check --amqp-url (or LILY_AMQP_URL)"


MONGO_HINT = "is it running? Check --mongo-uri (or LILY_MONGO_URI)"


AmqpOption = Annotated[
    str,
    typer.Option(
        "--amqp-url",
        envvar="LILY_AMQP_URL",
        help="RabbitMQ URL; for a cluster, its nodes as a comma-separated host list (amqp://u:p@h1,h2/).",
    ),
]


MongoOption = Annotated[str, typer.Option("--mongo-uri", envvar="LILY_MONGO_URI", help="MongoDB URI.")]


def version() -> str:
    return importlib.metadata.version("lily-mongo")
