"""From a delivery to a handler verdict: prepare, select, bind, invoke (docs/contracts.md section 5).

Pure: no I/O library. :func:`prepare` runs the checks docs/contracts.md section 5 orders
before any handler code or scope opens (body size and envelope, handler
selection, payload decode). :func:`invoke` runs one attempt (middleware,
guards, handler) and turns whatever it raises into a :class:`PipelineResult`.
The runtime calls both; the inbox calls :func:`invoke` once per attempt
through the callable the runtime gives it.

A handler that asks for ``Depends`` factories, ``Resource`` values or
``MongoDatabase`` (docs/handlers.md) has its arguments produced by
:func:`_call_injected` for each attempt: its factories in plan order, each once,
their cleanups when the attempt ends. Every other handler is called straight
from :func:`arguments`, as if none of that existed.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from .._errors import EnvelopeError, ErrorCode, QueueHandlerError
from .._plan.extractors import NOT_DECODED, PayloadDecodeError, RawDelivery, new_raw_delivery
from .._plan.options import QueueOptions
from .._plan.parameters import Dependency, Parameter
from .._plan.plan import Plan
from .._plan.routes import DeliveryContext, HandlerRoute, Middleware
from .._text import truncate_utf8
from .._verdicts import SUCCESS, Outcome, PipelineResult
from ..bounds import BOUNDS
from ..envelope import Envelope, event_id_of, validate_envelope
from .message import InboundMessage

__all__ = [
    "NO_SERVICES",
    "Prepared",
    "Rejected",
    "Services",
    "arguments",
    "invoke",
    "prepare",
    "select_route",
]


@dataclass(slots=True)
class Prepared:
    """A delivery ready to run: its handler, its read-only view, its payload decoded once."""

    route: HandlerRoute
    delivery: RawDelivery
    payload: Any  # the terminal extractor's value (NOT_DECODED when the handler has none)


@dataclass(slots=True)
class Rejected:
    """A delivery refused before any handler code ran, with the envelope when it was valid, and
    the event id whenever its own header was valid (also when the rest of the envelope was not)."""

    result: PipelineResult
    envelope: Envelope | None
    event_id: uuid.UUID | None = None

    def __post_init__(self) -> None:
        if self.event_id is None and self.envelope is not None:
            self.event_id = self.envelope.event_id


@dataclass(frozen=True, slots=True)
class Services:
    """What the consumer supplies to an attempt besides the delivery and the scope (docs/handlers.md):
    its database (``MongoDatabase``) and the resources its lifespan yielded (``Resource``)."""

    database: Any = None  # PyMongo's AsyncDatabase; None without a mongo_client (the plan refuses MongoDatabase then)
    resources: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


NO_SERVICES = Services()


def select_route(plan: Plan, queue_name: str, version: int, content: str) -> HandlerRoute | str:
    """The handler for (queue, version, content), or the permanent error code why none serves it."""
    by_content = plan.routes.get(queue_name, {}).get(version)
    if by_content is None:
        return ErrorCode.SCHEMA_VERSION_UNSUPPORTED
    handler = by_content.get(content)
    if handler is None:
        return ErrorCode.CONTENT_KIND_UNSUPPORTED
    return handler


def prepare(plan: Plan, options: QueueOptions, message: InboundMessage) -> Prepared | Rejected:
    """Envelope, handler selection and payload decode: all before any scope or middleware opens."""
    if message.malformed is not None and len(message.body) <= options.max_body:
        # Metadata that was not valid AMQP, read leniently (_amqp.LenientFrameReader): refused.
        result = PipelineResult(Outcome.PERMANENT, ErrorCode.ENVELOPE_INVALID, message.malformed)
        return Rejected(result, None, event_id_of(message.headers))
    try:
        envelope = validate_envelope(message.headers, len(message.body), max_body=options.max_body)
    except EnvelopeError as exc:
        outcome = Outcome.BODY_TOO_LARGE if exc.code == ErrorCode.BODY_TOO_LARGE else Outcome.PERMANENT
        return Rejected(PipelineResult(outcome, exc.code, exc.reason), None, event_id_of(message.headers))
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
            return Rejected(
                PipelineResult(
                    Outcome.PERMANENT,
                    exc.code if isinstance(exc.code, ErrorCode) else ErrorCode.PAYLOAD_DECODE_FAILED,
                    str(exc),
                ),
                envelope,
            )
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
    services: Services = NO_SERVICES,
) -> PipelineResult:
    """One fresh middleware/guards/handler invocation; whatever it raises becomes the verdict.

    Exceptions for which ``passthrough`` is true (the inbox's labelled transaction
    errors) are re-raised instead: the caller replays the attempt. The verdict keeps
    the exception itself (``PipelineResult.exception``) for the failure log and tests.
    """
    try:
        if route.direct:
            await route.fn(**arguments(route, delivery, scope, payload))
        elif route.middleware or route.guards:
            ctx = DeliveryContext(route.queue, route, delivery, attempt)
            await _with_middleware(ctx, route.middleware, _guarded_handler(ctx, scope, payload, services))
        else:
            await _call_injected(route, delivery, scope, payload, services)
    except QueueHandlerError as exc:
        outcome = Outcome.RETRYABLE if exc.is_retryable else Outcome.PERMANENT
        return PipelineResult(outcome, truncate_utf8(exc.code, BOUNDS.failure_code_bytes), exc.message, exc)
    except Exception as exc:
        if passthrough(exc):
            raise
        outcome = Outcome.RETRYABLE if unknown_errors == "retryable" else Outcome.PERMANENT
        return PipelineResult(outcome, ErrorCode.HANDLER_FAILED, f"{type(exc).__name__}: {exc}", exc)
    return SUCCESS


def _guarded_handler(
    ctx: DeliveryContext, scope: object, payload: Any, services: Services
) -> Callable[[], Awaitable[None]]:
    """The innermost call: the guards (in order), then the handler (its factories first, if any)."""
    route = ctx.handler

    async def call_handler() -> None:
        for guard in route.guards:
            if await guard(ctx) is False:
                name = getattr(guard, "__qualname__", type(guard).__name__)
                raise QueueHandlerError.permanent(ErrorCode.GUARD_REJECTED, f"guard {name} refused the delivery")
        if route.injects:
            await _call_injected(route, ctx.delivery, scope, payload, services)
        else:
            await route.fn(**arguments(route, ctx.delivery, scope, payload))

    return call_handler


# -- dependencies, resources and the database (docs/handlers.md) --------------------------------


async def _call_injected(
    route: HandlerRoute, delivery: RawDelivery, scope: object, payload: Any, services: Services
) -> None:
    """Call the handler with its factories' values: each factory once, in plan order; cleanups at the end.

    The cleanups (the code after a generator factory's ``yield``) run when the attempt
    ends, in reverse order, and see its exception if it failed. None of them can turn a
    failure into a success: an exception a cleanup swallows is still the verdict. An
    exception a cleanup raises becomes the attempt's failure.
    """
    stack = contextlib.AsyncExitStack()
    try:
        values: dict[Dependency, Any] = {}
        for dependency in route.dependencies:
            kwargs = _arguments_of(dependency.parameters, delivery, scope, payload, services, values)
            values[dependency] = await _produce(dependency, kwargs, stack)
        await route.fn(**_arguments_of(route.parameters, delivery, scope, payload, services, values))
    except BaseException as exc:
        await stack.__aexit__(type(exc), exc, exc.__traceback__)  # whether it says "suppress" or not
        raise
    await stack.aclose()


async def _produce(dependency: Dependency, kwargs: dict[str, Any], stack: contextlib.AsyncExitStack) -> Any:
    kind = dependency.kind
    if kind == "coroutine":
        return await dependency.factory(**kwargs)
    if kind == "async_generator":
        return await stack.enter_async_context(dependency.opener(**kwargs))
    if kind == "generator":
        return stack.enter_context(dependency.opener(**kwargs))
    return dependency.factory(**kwargs)


def _arguments_of(
    parameters: tuple[Parameter, ...],
    delivery: RawDelivery,
    scope: object,
    payload: Any,
    services: Services,
    values: dict[Dependency, Any],
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for p in parameters:
        source = p.source
        if p.extractor is not None:
            kwargs[p.name] = (
                payload if p.extractor.terminal and payload is not NOT_DECODED else p.extractor.extract(delivery)
            )
        elif source == "depends":
            assert p.dependency is not None
            kwargs[p.name] = values[p.dependency]
        elif source == "resource":
            assert p.resource is not None
            kwargs[p.name] = services.resources[p.resource]
        elif source == "database":
            kwargs[p.name] = services.database
        else:
            kwargs[p.name] = scope
    return kwargs


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
