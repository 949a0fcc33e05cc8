"""Messages a service sends, declared with :meth:`Consumer.sends` (pure: no I/O).

The outbox publishes wherever a handler asks at run time, so nothing in the plan
says what a service sends. A declaration does: the AsyncAPI document describes it
as a ``send`` operation, and ``start()`` checks that the broker routes it (an
unroutable outbox record is retried and finally parked), or declares the
destination queue when asked to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pydantic

from .._checks import check_bool, check_int
from .._errors import ConfigError
from .._text import describe_value
from ..bounds import BOUNDS
from ..envelope import check_content_kind
from .options import check_name

__all__ = ["DeclaresOutgoing", "OutgoingMessage"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OutgoingMessage:
    """One kind of message the service publishes: destination, schema version, content kind, payload type.

    ``payload`` is the type a ``json`` payload validates as (a pydantic model or any
    type pydantic can describe); its JSON Schema goes into the AsyncAPI document.
    ``declare=True`` (default exchange only) makes ``start()`` declare the destination
    as a work queue the way a ``lily_mongo`` consumer of it declares it with default
    queue options (classic, dead-lettering to ``<name>.dlq``), so records are routable
    before that consumer first starts.
    """

    routing_key: str
    version: int
    content: str = "json"
    exchange: str = ""
    payload: Any = None
    declare: bool = False

    def __post_init__(self) -> None:
        where = f"sends({self.routing_key!r:.60})"
        if self.exchange != "":
            check_name(f"{where}: exchange", self.exchange)
        if self.routing_key != "" or not self.exchange:
            # The default exchange routes by queue name: the routing key is one.
            check_name(f"{where}: routing_key", self.routing_key)
        check_int(f"{where}: version", self.version, BOUNDS.schema_version_min, BOUNDS.schema_version_max)
        problem = check_content_kind(self.content)
        if problem is not None:
            raise ConfigError(f"{where}: content {problem}")
        check_bool(f"{where}: declare", self.declare)
        if self.declare and self.exchange:
            raise ConfigError(f"{where}: declare=True declares a queue, so it needs the default exchange ('')")
        if self.payload is not None:
            if self.content != "json":
                raise ConfigError(f"{where}: a payload type describes json content, not {self.content!r}")
            try:
                pydantic.TypeAdapter(self.payload).json_schema()
            except (pydantic.PydanticUserError, pydantic.errors.PydanticSchemaGenerationError, TypeError) as exc:
                raise ConfigError(
                    f"{where}: payload must be a type pydantic can describe, got {describe_value(self.payload)}"
                ) from exc

    @property
    def key(self) -> tuple[str, str, int, str]:
        """What makes two declarations the same: (exchange, routing key, version, content)."""
        return (self.exchange, self.routing_key, self.version, self.content)


class DeclaresOutgoing:
    """``sends(...)`` for a writer of outbox records that is not a consumer (the standalone ``Outbox``): what
    it publishes, declared for the AsyncAPI document (``asyncapi_document(..., outgoing=outbox.outgoing)``,
    ``lily-mongo asyncapi TARGET --outbox module:outbox``)."""

    __slots__ = ()

    def sends(
        self, routing_key: str, *, version: int, content: str = "json", payload: Any = None, exchange: str = ""
    ) -> OutgoingMessage:
        """Declare a message this writer publishes; the AsyncAPI document describes it as a ``send``
        operation (with ``payload``'s JSON Schema for json content)."""
        message = OutgoingMessage(
            routing_key=routing_key, version=version, content=content, payload=payload, exchange=exchange
        )
        declared = self._declared()
        if any(known.key == message.key for known in declared):
            raise ConfigError(f"sends({routing_key!r:.60}, version={version}, content={content!r}) is declared twice")
        declared.append(message)
        return message

    @property
    def outgoing(self) -> tuple[OutgoingMessage, ...]:
        """The messages declared with :meth:`sends`, in declaration order."""
        return tuple(self._declared())

    def _declared(self) -> list[OutgoingMessage]:
        declared: list[OutgoingMessage] | None = self.__dict__.get("_outgoing_declared")
        if declared is None:
            declared = self.__dict__["_outgoing_declared"] = []
        return declared
