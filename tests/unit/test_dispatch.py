"""From a delivery to a handler verdict: :func:`prepare` and :func:`invoke` (docs/contracts.md, docs/settlement.md).

``prepare`` runs the checks docs/contracts.md section 5 orders before any handler code or
scope opens: body size, metadata bounds and canonical envelope, handler
selection by (queue, version, content), payload decode. ``invoke`` runs one
attempt (middleware outermost first, then guards, then the handler) and turns
whatever it raises into a verdict. No broker, no database: deliveries are a
small dataclass and plans are built with ``PlanBuilder``. Expected codes and
outcomes are written out here, not read from the code under test.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any

import pytest

from lily_mongo import (
    DeliveryContext,
    EventId,
    Extractor,
    Json,
    QueueHandlerError,
    RawDelivery,
    Text,
)
from lily_mongo._engine.dispatch import Prepared, Rejected, arguments, invoke, prepare, select_route
from lily_mongo._inbox import MongoScope
from lily_mongo._plan.extractors import NOT_DECODED
from lily_mongo._plan.options import QueueOptions
from lily_mongo._plan.plan import Plan, PlanBuilder
from lily_mongo._plan.routes import HandlerRoute, queue
from lily_mongo._verdicts import Outcome, PipelineResult
from tests.support.handlers import Order, taking_every_kind
from tests.support.messages import Unsettled

Handler = Callable[..., Awaitable[None]]

QUEUE = "orders.created"
EVENT_ID = "0f8fad5b-d9cb-469f-a165-70867728950e"

# Stable codes (docs/settlement.md, and the framework's handler codes), spelled out.
ENVELOPE_INVALID = "QUEUE_ENVELOPE_INVALID"
METADATA_BOUNDS_EXCEEDED = "QUEUE_METADATA_BOUNDS_EXCEEDED"
BODY_TOO_LARGE = "QUEUE_BODY_TOO_LARGE"
SCHEMA_VERSION_UNSUPPORTED = "QUEUE_SCHEMA_VERSION_UNSUPPORTED"
CONTENT_KIND_UNSUPPORTED = "QUEUE_CONTENT_KIND_UNSUPPORTED"
PAYLOAD_DECODE_FAILED = "QUEUE_PAYLOAD_DECODE_FAILED"
PAYLOAD_INVALID = "QUEUE_PAYLOAD_INVALID"
HANDLER_FAILED = "QUEUE_HANDLER_FAILED"
GUARD_REJECTED = "QUEUE_GUARD_REJECTED"

# docs/contracts.md section 6: an AMQP value is at most 8 KiB; a failure code travels in a 64-byte header.
VALUE_BYTES = 8 * 1024
FAILURE_CODE_BYTES = 64
# Rejection reasons end up in x-lily-failure-reason: short, never an echo of the raw value.
REASON_MAX_CHARS = 600

ORDER_BODY = b'{"order_id": 7, "lines": ["book", "pen"]}'


@dataclass
class Message(Unsettled):
    """What ``prepare`` reads of one delivery (the AMQP adapter's message, here a plain record)."""

    headers: dict[str, Any]
    body: bytes = ORDER_BODY
    content_type: str | None = "application/json"
    redelivered: bool = False
    routing_key: str = QUEUE
    exchange: str = "orders"
    malformed: str | None = None


class CountingJson(Extractor):
    """A terminal extractor that counts how often it decodes the body."""

    terminal = True

    def __init__(self) -> None:
        self.decodes = 0

    def extract(self, delivery: RawDelivery) -> Any:
        self.decodes += 1
        return Order.model_validate_json(delivery.body)


class Exploding(Extractor):
    """A terminal extractor whose decoder fails with an arbitrary exception."""

    terminal = True

    def extract(self, delivery: RawDelivery) -> Any:
        raise ValueError("the decoder fell over")


Exploded = Annotated[bytes, Exploding()]


class Special(Exception):
    """Stands for the inbox's labelled transaction errors in ``passthrough`` tests."""


@dataclass
class Trace:
    """Calls seen by handlers, middleware and guards, in order."""

    events: list[str] = field(default_factory=list)
    seen: list[Any] = field(default_factory=list)


# -- helpers ------------------------------------------------------------------------------


def envelope(version: object = "1", content: object = "json", **extra: object) -> dict[str, Any]:
    """A canonical envelope header table; ``extra`` uses ``_`` for ``-`` in header names."""
    table: dict[str, Any] = {
        "x-lily-event-id": EVENT_ID,
        "x-lily-schema-version": version,
        "x-lily-content-kind": content,
    }
    for name, value in extra.items():
        table[name.replace("_", "-")] = value
    return table


def build(
    *handlers: Handler,
    middleware: Iterable[Any] = (),
    guards: Iterable[Any] = (),
) -> Plan:
    builder = PlanBuilder(name="svc", has_mongo=True)
    builder.middleware.extend(middleware)
    builder.guards.extend(guards)
    for handler in handlers:
        builder.include(handler)
    return builder.build(MongoScope)


def order_handler(trace: Trace, *, version: int = 1, content: str = "json", **route: Any) -> Handler:
    async def on_order(order: Json[Order]) -> None:
        trace.events.append("handler")
        trace.seen.append(order)

    return queue(QUEUE, version=version, content=content, **route)(on_order)


def text_handler(trace: Trace, *, version: int = 1, content: str = "text") -> Handler:
    async def on_text(text: Text) -> None:
        trace.events.append("handler")
        trace.seen.append(text)

    return queue(QUEUE, version=version, content=content)(on_text)


def raising_handler(error: BaseException, trace: Trace | None = None, **route: Any) -> Handler:
    async def on_order(order: Json[Order]) -> None:
        if trace is not None:
            trace.events.append("handler")
        raise error

    return queue(QUEUE, version=1, **route)(on_order)


def options(max_body: int = 1 << 20) -> QueueOptions:
    return QueueOptions(name=QUEUE, max_body=max_body)


def accepted(plan: Plan, message: Message, opts: QueueOptions | None = None) -> Prepared:
    prepared = prepare(plan, opts or options(), message)
    assert isinstance(prepared, Prepared), prepared
    return prepared


def rejected(plan: Plan, message: Message, opts: QueueOptions | None = None) -> Rejected:
    outcome = prepare(plan, opts or options(), message)
    assert isinstance(outcome, Rejected), outcome
    assert isinstance(outcome.result, PipelineResult)
    return outcome


def single(plan: Plan) -> HandlerRoute:
    (route,) = plan.handlers
    return route


async def run(handler: Handler, *, attempt: int = 1, **kwargs: Any) -> PipelineResult:
    """Prepare a valid order delivery for ``handler`` and invoke it once."""
    plan = build(handler, middleware=kwargs.pop("middleware", ()), guards=kwargs.pop("guards", ()))
    prepared = accepted(plan, Message(envelope()))
    return await invoke(prepared.route, prepared.delivery, attempt=attempt, payload=prepared.payload, **kwargs)


# -- prepare: body size -------------------------------------------------------------------


def test_a_body_over_max_body_is_rejected_before_the_envelope_is_read() -> None:
    trace = Trace()
    plan = build(order_handler(trace))
    # The headers are not even an envelope: the body size decides first (docs/contracts.md section 5, step 1).
    outcome = rejected(plan, Message({}, body=b"x" * 17), options(max_body=16))
    assert outcome.result.outcome is Outcome.BODY_TOO_LARGE
    assert outcome.result.code == BODY_TOO_LARGE
    assert outcome.envelope is None
    assert trace.events == []


def test_a_body_of_exactly_max_body_is_accepted() -> None:
    plan = build(order_handler(Trace()))
    body = b'{"order_id": 1, "lines": []}'
    prepared = accepted(plan, Message(envelope(), body=body), options(max_body=len(body)))
    assert prepared.payload == Order(order_id=1, lines=[])


def test_a_valid_envelope_does_not_save_a_body_over_the_limit() -> None:
    plan = build(order_handler(Trace()))
    outcome = rejected(plan, Message(envelope(), body=ORDER_BODY), options(max_body=len(ORDER_BODY) - 1))
    assert (outcome.result.outcome, outcome.result.code, outcome.envelope) == (
        Outcome.BODY_TOO_LARGE,
        BODY_TOO_LARGE,
        None,
    )


# -- prepare: envelope and metadata -------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="no-headers"),
        pytest.param({k: v for k, v in envelope().items() if k != "x-lily-event-id"}, id="no-event-id"),
        pytest.param(envelope(x_lily_event_id=EVENT_ID.upper()), id="uppercase-event-id"),
        pytest.param(envelope(x_lily_event_id=str(uuid.UUID(int=0))), id="nil-event-id"),
        pytest.param(envelope(version="01"), id="version-leading-zero"),
        pytest.param(envelope(version=1), id="version-as-integer"),
        pytest.param(envelope(version="0"), id="version-zero"),
        pytest.param(envelope(content="JSON"), id="content-uppercase"),
        pytest.param(envelope(x_retry_count="1"), id="retry-count-as-string"),
    ],
)
def test_an_invalid_envelope_is_a_permanent_rejection_without_envelope(headers: dict[str, Any]) -> None:
    trace = Trace()
    plan = build(order_handler(trace))
    outcome = rejected(plan, Message(headers))
    assert outcome.result.outcome is Outcome.PERMANENT
    assert outcome.result.code == ENVELOPE_INVALID
    assert outcome.envelope is None
    assert trace.events == []


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(envelope(x_big="a" * (VALUE_BYTES + 1)), id="value-over-8KiB"),
        pytest.param(envelope(**{f"x_extra_{i}": "v" for i in range(64)}), id="too-many-entries"),
        pytest.param(envelope(**{"k" * 129: "v"}), id="key-over-128-bytes"),
        pytest.param(envelope(x_deep={"a": {"b": {"c": {"d": {"e": 1}}}}}), id="nested-too-deep"),
    ],
)
def test_metadata_over_a_bound_is_a_permanent_bounds_rejection(headers: dict[str, Any]) -> None:
    plan = build(order_handler(Trace()))
    outcome = rejected(plan, Message(headers))
    assert outcome.result.outcome is Outcome.PERMANENT
    assert outcome.result.code == METADATA_BOUNDS_EXCEEDED
    assert outcome.envelope is None
    # Built only from bounded, sanitized data (docs/contracts.md section 5, step 2).
    assert len(outcome.result.reason) < REASON_MAX_CHARS
    assert "a" * 100 not in outcome.result.reason


# -- prepare: handler selection -----------------------------------------------------------


def test_an_unknown_schema_version_is_permanent_and_keeps_the_envelope() -> None:
    trace = Trace()
    plan = build(order_handler(trace, version=1))
    outcome = rejected(plan, Message(envelope(version="2")))
    assert outcome.result.outcome is Outcome.PERMANENT
    assert outcome.result.code == SCHEMA_VERSION_UNSUPPORTED
    assert outcome.envelope is not None
    assert outcome.envelope.schema_version == 2
    assert outcome.envelope.content_kind == "json"
    assert outcome.envelope.event_id == uuid.UUID(EVENT_ID)
    assert trace.events == []


def test_a_known_version_with_another_content_kind_is_permanent_and_keeps_the_envelope() -> None:
    trace = Trace()
    plan = build(order_handler(trace, version=1, content="json"))
    outcome = rejected(plan, Message(envelope(version="1", content="avro")))
    assert outcome.result.outcome is Outcome.PERMANENT
    assert outcome.result.code == CONTENT_KIND_UNSUPPORTED
    assert outcome.envelope is not None
    assert (outcome.envelope.schema_version, outcome.envelope.content_kind) == (1, "avro")
    assert trace.events == []


def test_a_queue_without_any_handler_reports_the_version_unsupported() -> None:
    plan = build(order_handler(Trace()))
    other = QueueOptions(name="payments.settled")
    outcome = rejected(plan, Message(envelope()), other)
    assert outcome.result.code == SCHEMA_VERSION_UNSUPPORTED
    assert outcome.envelope is not None


def test_several_versions_and_contents_on_one_queue_select_by_the_pair() -> None:
    trace = Trace()
    v1_json = order_handler(trace, version=1, content="json")
    v2_text = text_handler(trace, version=2, content="text")
    plan = build(v1_json, v2_text)
    by_fn = {route.fn: route for route in plan.handlers}
    assert select_route(plan, QUEUE, 1, "json") is by_fn[v1_json]
    assert select_route(plan, QUEUE, 2, "text") is by_fn[v2_text]
    # Never upcast or fall back between versions (docs/contracts.md section 5).
    assert select_route(plan, QUEUE, 2, "json") == CONTENT_KIND_UNSUPPORTED
    assert select_route(plan, QUEUE, 1, "text") == CONTENT_KIND_UNSUPPORTED
    assert select_route(plan, QUEUE, 3, "json") == SCHEMA_VERSION_UNSUPPORTED
    assert accepted(plan, Message(envelope(version="2", content="text"), body=b"hi")).route is by_fn[v2_text]


# -- prepare: payload decode --------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "code"),
    [
        pytest.param(b'{"order_id": 7, "lines": [', PAYLOAD_DECODE_FAILED, id="truncated-json"),
        pytest.param(b"not json at all", PAYLOAD_DECODE_FAILED, id="not-json"),
        pytest.param(b"", PAYLOAD_DECODE_FAILED, id="empty-body"),
        pytest.param(b'{"order_id": "seven", "lines": []}', PAYLOAD_INVALID, id="wrong-field-type"),
        pytest.param(b'{"order_id": 7}', PAYLOAD_INVALID, id="missing-field"),
        pytest.param(b"[1, 2, 3]", PAYLOAD_INVALID, id="array-not-object"),
    ],
)
def test_a_body_the_json_model_cannot_decode_or_validate_is_a_permanent_failure_of_its_own_code(
    body: bytes, code: str
) -> None:
    # Bytes that are not JSON are undecodable; JSON that the model refuses is invalid.
    trace = Trace()
    plan = build(order_handler(trace))
    outcome = rejected(plan, Message(envelope(), body=body))
    assert outcome.result.outcome is Outcome.PERMANENT
    assert outcome.result.code == code
    assert outcome.envelope is not None
    assert outcome.envelope.event_id == uuid.UUID(EVENT_ID)
    assert trace.events == []


def test_a_body_that_is_not_utf8_fails_the_text_extractor() -> None:
    plan = build(text_handler(Trace(), content="text"))
    outcome = rejected(plan, Message(envelope(content="text"), body=b"caf\xe9"))
    assert (outcome.result.outcome, outcome.result.code) == (Outcome.PERMANENT, PAYLOAD_DECODE_FAILED)
    assert outcome.envelope is not None


def test_any_exception_from_a_custom_terminal_extractor_is_a_decode_failure() -> None:
    async def on_blob(blob: Exploded) -> None:
        raise AssertionError("must not run")

    plan = build(queue(QUEUE, version=1, content="blob")(on_blob))
    outcome = rejected(plan, Message(envelope(content="blob")))
    assert (outcome.result.outcome, outcome.result.code) == (Outcome.PERMANENT, PAYLOAD_DECODE_FAILED)
    assert outcome.envelope is not None


def test_rejections_run_no_middleware_and_no_guard() -> None:
    trace = Trace()

    async def mw(ctx: DeliveryContext, call_next: Callable[[], Awaitable[None]]) -> None:
        trace.events.append("middleware")
        await call_next()

    async def guard(ctx: DeliveryContext) -> bool:
        trace.events.append("guard")
        return True

    plan = build(order_handler(trace), middleware=[mw], guards=[guard])
    for message in (
        Message({}),
        Message(envelope(version="9")),
        Message(envelope(content="text")),
        Message(envelope(), body=b"{"),
    ):
        rejected(plan, message)
    assert trace.events == []


# -- prepare: the accepted delivery -------------------------------------------------------


def test_a_valid_delivery_is_prepared_with_its_payload_decoded_once() -> None:
    trace = Trace()
    handler = order_handler(trace)
    plan = build(handler)
    headers = envelope(x_retry_count=2, x_tenant="acme")
    message = Message(headers, redelivered=True, routing_key="orders.created.eu", exchange="orders")
    prepared = accepted(plan, message)
    assert prepared.route is single(plan)
    assert prepared.route.fn is handler
    assert prepared.payload == Order(order_id=7, lines=["book", "pen"])
    delivery = prepared.delivery
    assert delivery.queue == QUEUE
    assert delivery.body == ORDER_BODY
    assert delivery.content_type == "application/json"
    assert delivery.redelivered is True
    assert delivery.routing_key == "orders.created.eu"
    assert delivery.exchange == "orders"
    assert dict(delivery.headers) == {
        "x-lily-event-id": EVENT_ID,
        "x-lily-schema-version": "1",
        "x-lily-content-kind": "json",
        "x-retry-count": 2,
        "x-tenant": "acme",
    }
    assert delivery.envelope.event_id == uuid.UUID(EVENT_ID)
    assert delivery.envelope.schema_version == 1
    assert delivery.envelope.content_kind == "json"
    assert delivery.envelope.retry_count == 2
    assert trace.events == []  # preparing runs no handler code


def test_the_prepared_headers_are_a_read_only_view() -> None:
    prepared = accepted(build(order_handler(Trace())), Message(envelope()))
    headers: Any = prepared.delivery.headers
    with pytest.raises(TypeError):
        headers["x-lily-event-id"] = str(uuid.uuid4())
    with pytest.raises(TypeError):
        headers["x-new"] = "value"
    with pytest.raises(TypeError):
        del headers["x-lily-content-kind"]
    assert headers["x-lily-event-id"] == EVENT_ID


def test_a_handler_without_a_body_parameter_gets_no_decoded_payload() -> None:
    async def on_event(event_id: EventId) -> None:
        return None

    prepared = accepted(build(queue(QUEUE, version=1)(on_event)), Message(envelope(), body=b"{"))
    assert prepared.payload is NOT_DECODED


# -- invoke: verdicts ---------------------------------------------------------------------


async def test_a_handler_that_returns_is_a_success() -> None:
    trace = Trace()
    result = await run(order_handler(trace))
    assert result.outcome is Outcome.SUCCESS
    assert result.code is None
    assert trace.events == ["handler"]


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (QueueHandlerError.retryable("PAYMENT_DOWN", "gateway 503"), Outcome.RETRYABLE),
        (QueueHandlerError.permanent("ORDER_INVALID", "gateway 503"), Outcome.PERMANENT),
    ],
)
@pytest.mark.parametrize("unknown_errors", ["retryable", "permanent"])
async def test_a_queue_handler_error_chooses_its_outcome_and_code(
    error: QueueHandlerError, outcome: Outcome, unknown_errors: Any
) -> None:
    # unknown_errors only concerns exceptions that are not a QueueHandlerError.
    result = await run(raising_handler(error), unknown_errors=unknown_errors)
    assert result.outcome is outcome
    assert result.code == error.code
    assert result.reason == "gateway 503"


@pytest.mark.parametrize(
    "code",
    [
        pytest.param("A" * 65, id="ascii-65"),
        pytest.param("E" * 300, id="ascii-300"),
        pytest.param("é" * 40, id="two-byte-80"),
        pytest.param("C" * 63 + "é", id="two-byte-straddling-the-limit"),
        pytest.param("🦆" * 17, id="four-byte-68"),
    ],
)
async def test_a_code_longer_than_64_bytes_is_cut_to_64_bytes(code: str) -> None:
    assert len(code.encode()) > FAILURE_CODE_BYTES
    result = await run(raising_handler(QueueHandlerError.permanent(code)))
    assert result.outcome is Outcome.PERMANENT
    assert result.code is not None
    assert 0 < len(result.code.encode("utf-8")) <= FAILURE_CODE_BYTES
    # Still recognisably the handler's code: its first characters survive.
    assert result.code[:8] == code[:8]


async def test_a_code_of_exactly_64_bytes_is_kept_whole() -> None:
    code = "X" * 62 + "é"  # 64 UTF-8 bytes
    assert len(code.encode()) == FAILURE_CODE_BYTES
    result = await run(raising_handler(QueueHandlerError.retryable(code)))
    assert result.code == code


@pytest.mark.parametrize("error", [ValueError("bad"), KeyError("k"), RuntimeError("boom"), ZeroDivisionError()])
async def test_any_other_exception_is_retryable_handler_failed_by_default(error: Exception) -> None:
    result = await run(raising_handler(error))
    assert result.outcome is Outcome.RETRYABLE
    assert result.code == HANDLER_FAILED


@pytest.mark.parametrize("error", [ValueError("bad"), KeyError("k"), RuntimeError("boom")])
async def test_any_other_exception_is_permanent_when_configured(error: Exception) -> None:
    result = await run(raising_handler(error), unknown_errors="permanent")
    assert result.outcome is Outcome.PERMANENT
    assert result.code == HANDLER_FAILED


async def test_cancellation_is_never_turned_into_a_verdict() -> None:
    with pytest.raises(asyncio.CancelledError):
        await run(raising_handler(asyncio.CancelledError()))


# -- invoke: passthrough ------------------------------------------------------------------


async def test_passthrough_reraises_the_very_exception_it_accepts() -> None:
    error = Special("labelled transient error")
    asked: list[BaseException] = []

    def accept_special(exc: BaseException) -> bool:
        asked.append(exc)
        return isinstance(exc, Special)

    with pytest.raises(Special) as info:
        await run(raising_handler(error), passthrough=accept_special)
    assert info.value is error
    assert asked == [error]


async def test_passthrough_leaves_the_exceptions_it_refuses_to_the_verdict() -> None:
    def accept_special(exc: BaseException) -> bool:
        return isinstance(exc, Special)

    result = await run(raising_handler(LookupError("nope")), passthrough=accept_special)
    assert (result.outcome, result.code) == (Outcome.RETRYABLE, HANDLER_FAILED)
    result = await run(raising_handler(LookupError("nope")), passthrough=accept_special, unknown_errors="permanent")
    assert (result.outcome, result.code) == (Outcome.PERMANENT, HANDLER_FAILED)


async def test_passthrough_applies_to_errors_raised_by_middleware_and_guards() -> None:
    error_in_mw = Special("from middleware")
    error_in_guard = Special("from guard")

    async def failing_mw(ctx: DeliveryContext, call_next: Callable[[], Awaitable[None]]) -> None:
        raise error_in_mw

    async def failing_guard(ctx: DeliveryContext) -> bool:
        raise error_in_guard

    def accept(exc: BaseException) -> bool:
        return isinstance(exc, Special)

    trace = Trace()
    with pytest.raises(Special) as info:
        await run(order_handler(trace), middleware=[failing_mw], passthrough=accept)
    assert info.value is error_in_mw
    with pytest.raises(Special) as info:
        await run(order_handler(trace), guards=[failing_guard], passthrough=accept)
    assert info.value is error_in_guard
    assert trace.events == []


# -- invoke: middleware and guards --------------------------------------------------------


def recording_middleware(trace: Trace, name: str) -> Any:
    async def mw(ctx: DeliveryContext, call_next: Callable[[], Awaitable[None]]) -> None:
        trace.events.append(f"{name}:before")
        try:
            await call_next()
        finally:
            trace.events.append(f"{name}:after")

    return mw


def recording_guard(trace: Trace, name: str, verdict: bool | None = True) -> Any:
    async def guard(ctx: DeliveryContext) -> bool | None:
        trace.events.append(name)
        return verdict

    return guard


async def test_middleware_runs_outermost_first_around_the_guards_and_the_handler() -> None:
    trace = Trace()
    handler = order_handler(
        trace,
        middleware=[recording_middleware(trace, "route-mw-1"), recording_middleware(trace, "route-mw-2")],
        guards=[recording_guard(trace, "route-guard")],
    )
    result = await run(
        handler,
        middleware=[recording_middleware(trace, "consumer-mw")],
        guards=[recording_guard(trace, "consumer-guard")],
    )
    assert result.outcome is Outcome.SUCCESS
    assert trace.events == [
        "consumer-mw:before",
        "route-mw-1:before",
        "route-mw-2:before",
        "consumer-guard",
        "route-guard",
        "handler",
        "route-mw-2:after",
        "route-mw-1:after",
        "consumer-mw:after",
    ]


async def test_a_guard_returning_false_rejects_permanently_and_the_handler_never_runs() -> None:
    trace = Trace()
    handler = order_handler(trace, guards=[recording_guard(trace, "refuses", False), recording_guard(trace, "later")])
    result = await run(handler, middleware=[recording_middleware(trace, "mw")])
    assert result.outcome is Outcome.PERMANENT
    assert result.code == GUARD_REJECTED
    assert "handler" not in trace.events
    assert "later" not in trace.events  # the first refusal ends the check
    assert trace.events == ["mw:before", "refuses", "mw:after"]


async def test_guards_returning_true_or_none_let_the_handler_run() -> None:
    trace = Trace()
    handler = order_handler(trace, guards=[recording_guard(trace, "yes", True), recording_guard(trace, "none", None)])
    result = await run(handler)
    assert result.outcome is Outcome.SUCCESS
    assert trace.events == ["yes", "none", "handler"]


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (QueueHandlerError.retryable("RATE_LIMITED", "slow down"), Outcome.RETRYABLE),
        (QueueHandlerError.permanent("TENANT_BLOCKED", "blocked"), Outcome.PERMANENT),
    ],
)
async def test_a_guard_raising_queue_handler_error_keeps_its_code(error: QueueHandlerError, outcome: Outcome) -> None:
    trace = Trace()

    async def guard(ctx: DeliveryContext) -> bool:
        raise error

    result = await run(order_handler(trace, guards=[guard]))
    assert result.outcome is outcome
    assert result.code == error.code
    assert trace.events == []


async def test_a_middleware_raising_queue_handler_error_keeps_its_code() -> None:
    trace = Trace()

    async def mw(ctx: DeliveryContext, call_next: Callable[[], Awaitable[None]]) -> None:
        raise QueueHandlerError.retryable("UPSTREAM_BUSY")

    result = await run(order_handler(trace), middleware=[mw])
    assert (result.outcome, result.code) == (Outcome.RETRYABLE, "UPSTREAM_BUSY")
    assert trace.events == []


@pytest.mark.parametrize("attempt", [1, 2, 7])
async def test_the_delivery_context_carries_the_attempt_and_the_delivery(attempt: int) -> None:
    contexts: list[DeliveryContext] = []

    async def mw(ctx: DeliveryContext, call_next: Callable[[], Awaitable[None]]) -> None:
        contexts.append(ctx)
        await call_next()

    async def guard(ctx: DeliveryContext) -> bool:
        contexts.append(ctx)
        return True

    plan = build(order_handler(Trace()), middleware=[mw], guards=[guard])
    prepared = accepted(plan, Message(envelope()))
    result = await invoke(prepared.route, prepared.delivery, attempt=attempt, payload=prepared.payload)
    assert result.outcome is Outcome.SUCCESS
    assert len(contexts) == 2
    assert contexts[0] is contexts[1]  # middleware and guards share one context per attempt
    ctx = contexts[0]
    assert ctx.attempt == attempt
    assert ctx.queue == QUEUE
    assert ctx.handler is prepared.route
    assert ctx.delivery is prepared.delivery
    assert ctx.envelope.event_id == uuid.UUID(EVENT_ID)


async def test_each_attempt_gets_a_fresh_context() -> None:
    seen: list[tuple[int, dict[str, Any]]] = []

    async def mw(ctx: DeliveryContext, call_next: Callable[[], Awaitable[None]]) -> None:
        seen.append((ctx.attempt, dict(ctx.items)))
        ctx.items["visited"] = ctx.attempt
        await call_next()

    plan = build(order_handler(Trace()), middleware=[mw])
    prepared = accepted(plan, Message(envelope()))
    for attempt in (1, 2):
        await invoke(prepared.route, prepared.delivery, attempt=attempt, payload=NOT_DECODED)
    assert seen == [(1, {}), (2, {})]


# -- arguments ----------------------------------------------------------------------------


async def test_every_parameter_kind_receives_its_value_and_the_scope_goes_to_mongo_scope() -> None:
    received: dict[str, Any] = {}
    plan = build(queue(QUEUE, version=1)(taking_every_kind(received)))
    prepared = accepted(plan, Message(envelope(x_retry_count=3), redelivered=True))
    scope = object()  # stands for the attempt's MongoScope
    result = await invoke(prepared.route, prepared.delivery, attempt=1, scope=scope, payload=prepared.payload)
    assert result.outcome is Outcome.SUCCESS
    assert received["order"] is prepared.payload
    assert received["event_id"] == uuid.UUID(EVENT_ID)
    assert received["retries"] == 3
    assert received["redelivered"] is True
    assert received["raw"] is prepared.delivery
    assert received["mongo"] is scope


def test_arguments_pass_the_decoded_payload_or_decode_again() -> None:
    async def on_order(order: Json[Order], mongo: MongoScope) -> None:
        return None

    prepared = accepted(build(queue(QUEUE, version=1)(on_order)), Message(envelope()))
    scope = object()
    first = arguments(prepared.route, prepared.delivery, scope, prepared.payload)
    assert first["order"] is prepared.payload
    assert first["mongo"] is scope
    again = arguments(prepared.route, prepared.delivery, scope, NOT_DECODED)
    assert again["order"] == Order(order_id=7, lines=["book", "pen"])
    assert again["order"] is not prepared.payload  # a fresh object a replay can mutate safely
    assert again["mongo"] is scope


async def test_the_body_is_decoded_once_for_attempt_one_and_again_for_a_replay() -> None:
    extractor = CountingJson()
    payloads: list[Any] = []

    async def on_order(order: Any) -> None:
        payloads.append(order)
        order.lines.append("mutated by the handler")

    on_order.__annotations__ = {"order": Annotated[Order, extractor], "return": None}
    plan = build(queue(QUEUE, version=1)(on_order))
    prepared = accepted(plan, Message(envelope()))
    assert extractor.decodes == 1  # preparing decoded it

    first = await invoke(prepared.route, prepared.delivery, attempt=1, payload=prepared.payload)
    assert first.outcome is Outcome.SUCCESS
    assert extractor.decodes == 1  # attempt 1 reused the prepared payload
    assert payloads[0] is prepared.payload

    replay = await invoke(prepared.route, prepared.delivery, attempt=2, payload=NOT_DECODED)
    assert replay.outcome is Outcome.SUCCESS
    assert extractor.decodes == 2  # the replay decoded the body afresh
    assert payloads[1] == Order(order_id=7, lines=["book", "pen", "mutated by the handler"])
    assert payloads[1] is not payloads[0]


def test_a_delivery_whose_metadata_was_read_leniently_is_refused_as_an_invalid_envelope() -> None:
    trace = Trace()
    plan = build(order_handler(trace))
    outcome = rejected(plan, Message(envelope(), malformed="header name 0 is not UTF-8"))
    assert (outcome.result.outcome, outcome.result.code) == (Outcome.PERMANENT, ENVELOPE_INVALID)
    assert outcome.result.reason == "header name 0 is not UTF-8"
    assert outcome.envelope is None
    assert trace.events == []
