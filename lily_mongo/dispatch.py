"""From a delivery to a handler verdict: prepare, select, bind, invoke (docs/contracts.md section 5).

Pure: no I/O library. :func:`prepare` runs the checks docs/contracts.md section 5 orders
before any handler code or scope opens (body size and envelope, handler
selection, payload decode). :func:`invoke` runs one attempt (middleware,
guards, handler) and turns whatever it raises into a :class:`PipelineResult`.
The runtime calls both; the inbox calls :func:`invoke` once per attempt
through the callable the runtime gives it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, Protocol

from ._text import truncate_utf8
from .bounds import BOUNDS
from .envelope import Envelope, validate_envelope
from .errors import EnvelopeError, ErrorCode, QueueHandlerError
from .extractors import NOT_DECODED, PayloadDecodeError, RawDelivery, new_raw_delivery
from .plan import DeliveryContext, HandlerRoute, Middleware, Plan, QueueOptions
from .settlement import SUCCESS, Outcome, PipelineResult

__all__ = ["Inbound", "Prepared", "Rejected", "arguments", "invoke", "prepare", "select_route"]


class Inbound(Protocol):
    """What preparing needs of one delivery (the AMQP adapter's message, or a test's)."""

    @property
    def headers(self) -> dict[str, Any]: ...
    @property
    def body(self) -> bytes: ...
    @property
    def content_type(self) -> str | None: ...
    @property
    def redelivered(self) -> bool: ...
    @property
    def routing_key(self) -> str: ...
    @property
    def exchange(self) -> str: ...
    @property
    def malformed(self) -> str | None:
        """None, or which metadata was not valid AMQP text (the transport read it leniently)."""
        ...


@dataclass(slots=True)
class Prepared:
    """A delivery ready to run: its handler, its read-only view, its payload decoded once."""

    route: HandlerRoute
    delivery: RawDelivery
    payload: Any  # the terminal extractor's value (NOT_DECODED when the handler has none)


@dataclass(slots=True)
class Rejected:
    """A delivery refused before any handler code ran, with the envelope when it was valid."""

    result: PipelineResult
    envelope: Envelope | None


def select_route(plan: Plan, queue_name: str, version: int, content: str) -> HandlerRoute | str:
    """The handler for (queue, version, content), or the permanent error code why none serves it."""
    by_content = plan.routes.get(queue_name, {}).get(version)
    if by_content is None:
        return ErrorCode.SCHEMA_VERSION_UNSUPPORTED
    handler = by_content.get(content)
    if handler is None:
        return ErrorCode.CONTENT_KIND_UNSUPPORTED
    return handler


def prepare(plan: Plan, options: QueueOptions, message: Inbound) -> Prepared | Rejected:
    """Envelope, handler selection and payload decode: all before any scope or middleware opens."""
    if message.malformed is not None and len(message.body) <= options.max_body:
        # Metadata that was not valid AMQP, read leniently (_amqp.LenientFrameReader): refused.
        return Rejected(PipelineResult(Outcome.PERMANENT, ErrorCode.ENVELOPE_INVALID, message.malformed), None)
    try:
        envelope = validate_envelope(message.headers, len(message.body), max_body=options.max_body)
    except EnvelopeError as exc:
        outcome = Outcome.BODY_TOO_LARGE if exc.code == ErrorCode.BODY_TOO_LARGE else Outcome.PERMANENT
        return Rejected(PipelineResult(outcome, exc.code, exc.reason), None)
    route = select_route(plan, options.name, envelope.schema_version, envelope.content_kind)
    if isinstance(route, str):
        reason = (
            f"queue has no handler for schema version {envelope.schema_version}"
            if route == ErrorCode.SCHEMA_VERSION_UNSUPPORTED
            else f"schema version {envelope.schema_version} has no handler for content kind {envelope.content_kind!r}"
        )
        return Rejected(PipelineResult(Outcome.PERMANENT, route, reason), envelope)
    delivery = new_raw_delivery(
        options.name,
        MappingProxyType(message.headers),  # read-only: handoff copies use these
        message.body,
        message.content_type,
        message.redelivered,
        envelope,
        message.routing_key,
        message.exchange,
    )
    payload: Any = NOT_DECODED
    terminal = route.terminal
    if terminal is not None and terminal.extractor is not None:
        try:
            payload = terminal.extractor.extract(delivery)
        except PayloadDecodeError as exc:
            return Rejected(PipelineResult(Outcome.PERMANENT, ErrorCode.PAYLOAD_DECODE_FAILED, str(exc)), envelope)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            return Rejected(PipelineResult(Outcome.PERMANENT, ErrorCode.PAYLOAD_DECODE_FAILED, reason), envelope)
    return Prepared(route, delivery, payload)


def arguments(route: HandlerRoute, delivery: RawDelivery, scope: object, payload: Any) -> dict[str, Any]:
    """The handler's keyword arguments for one attempt (``scope`` goes to the MongoScope parameter)."""
    kwargs: dict[str, Any] = {}
    for p in route.parameters:
        if p.extractor is None:
            kwargs[p.name] = scope
        elif p.extractor.terminal and payload is not NOT_DECODED:
            kwargs[p.name] = payload  # decoded once while preparing
        else:
            kwargs[p.name] = p.extractor.extract(delivery)
    return kwargs


def _never(_exc: BaseException) -> bool:
    return False


async def invoke(
    route: HandlerRoute,
    delivery: RawDelivery,
    *,
    attempt: int,
    scope: object = None,
    payload: Any = NOT_DECODED,
    unknown_errors: Literal["retryable", "permanent"] = "retryable",
    passthrough: Callable[[BaseException], bool] = _never,
) -> PipelineResult:
    """One fresh middleware/guards/handler invocation; whatever it raises becomes the verdict.

    Exceptions for which ``passthrough`` is true (the inbox's labelled transaction
    errors) are re-raised instead: the caller replays the attempt.
    """
    try:
        if route.middleware or route.guards:
            ctx = DeliveryContext(route.queue, route, delivery, attempt)
            await _with_middleware(ctx, route.middleware, _guarded_handler(ctx, scope, payload))
        else:
            await route.fn(**arguments(route, delivery, scope, payload))
    except QueueHandlerError as exc:
        outcome = Outcome.RETRYABLE if exc.is_retryable else Outcome.PERMANENT
        return PipelineResult(outcome, truncate_utf8(exc.code, BOUNDS.failure_code_bytes), exc.message)
    except Exception as exc:
        if passthrough(exc):
            raise
        outcome = Outcome.RETRYABLE if unknown_errors == "retryable" else Outcome.PERMANENT
        return PipelineResult(outcome, ErrorCode.HANDLER_FAILED, f"{type(exc).__name__}: {exc}")
    return SUCCESS


def _guarded_handler(ctx: DeliveryContext, scope: object, payload: Any) -> Callable[[], Awaitable[None]]:
    """The innermost call: the guards (in order), then the handler."""
    route = ctx.handler

    async def call_handler() -> None:
        for guard in route.guards:
            if await guard(ctx) is False:
                name = getattr(guard, "__qualname__", type(guard).__name__)
                raise QueueHandlerError.permanent(ErrorCode.GUARD_REJECTED, f"guard {name} refused the delivery")
        await route.fn(**arguments(route, ctx.delivery, scope, payload))

    return call_handler


async def _with_middleware(
    ctx: DeliveryContext, middleware: tuple[Middleware, ...], innermost: Callable[[], Awaitable[None]]
) -> None:
    """Run ``innermost`` wrapped by ``middleware``, outermost first."""
    call = innermost
    for mw in reversed(middleware):
        call = _bind(mw, ctx, call)
    await call()


def _bind(
    middleware: Middleware, ctx: DeliveryContext, call_next: Callable[[], Awaitable[None]]
) -> Callable[[], Awaitable[None]]:
    async def call() -> None:
        await middleware(ctx, call_next)

    return call
