"""Depends, Resource and MongoDatabase (docs/handlers.md): resolved at plan time, produced per attempt.

No broker, no database: plans are built with ``PlanBuilder`` and attempts run through
``dispatch.invoke`` with a ``Services`` whose database is a stand-in object. Expected
values, orders and messages are written out here.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import MappingProxyType
from typing import Annotated, Any

import pydantic
import pytest

from lily_mongo import (
    ConfigError,
    Depends,
    EventId,
    Json,
    MongoDatabase,
    PlanError,
    QueueHandlerError,
    Resource,
    RetryCount,  # noqa: F401  # named by the source exec'd below
    Text,
)
from lily_mongo._engine.dispatch import Prepared, Services, invoke, prepare
from lily_mongo._inbox import MongoScope
from lily_mongo._plan.options import QueueOptions
from lily_mongo._plan.plan import Plan, PlanBuilder
from lily_mongo._plan.routes import HandlerRoute, queue
from lily_mongo._verdicts import Outcome, PipelineResult
from tests.support.messages import Unsettled

Handler = Callable[..., Awaitable[None]]
QUEUE = "orders"
EVENT_ID = "0f8fad5b-d9cb-469f-a165-70867728950e"
HANDLER_FAILED = "QUEUE_HANDLER_FAILED"
PARAMETERS = 16  # the documented bound on a handler's parameters (docs/configuration.md)
HEADERS = {"x-lily-event-id": EVENT_ID, "x-lily-schema-version": "1", "x-lily-content-kind": "json"}


class Order(pydantic.BaseModel):
    order_id: str


class Message(Unsettled):
    """What ``prepare`` reads of one delivery."""

    def __init__(self, body: bytes = b'{"order_id": "o1"}', headers: dict[str, Any] | None = None) -> None:
        self.headers = dict(HEADERS if headers is None else headers)
        self.body = body
        self.content_type = "application/json"
        self.redelivered = False
        self.routing_key = QUEUE
        self.exchange = ""
        self.malformed: str | None = None


class Transient(Exception):
    """Stands for the inbox's labelled transaction errors (``passthrough``)."""


DATABASE = object()  # stands for the consumer's AsyncDatabase


def build(*handlers: Handler, has_mongo: bool = True) -> Plan:
    builder = PlanBuilder(name="svc", has_mongo=has_mongo)
    for handler in handlers:
        builder.include(handler)
    return builder.build(MongoScope)


def plan_error(*handlers: Handler, has_mongo: bool = True) -> str:
    with pytest.raises(PlanError) as info:
        build(*handlers, has_mongo=has_mongo)
    return str(info.value)


def route_of(handler: Handler, **options: Any) -> HandlerRoute:
    (route,) = build(handler, **options).handlers
    return route


async def attempt(
    handler: Handler,
    *,
    resources: dict[str, Any] | None = None,
    scope: object = None,
    passthrough: Callable[[BaseException], bool] = lambda exc: False,
    **plan_options: Any,
) -> PipelineResult:
    """Prepare a valid delivery for ``handler`` and run one attempt with the given services."""
    plan = build(handler, **plan_options)
    prepared = prepare(plan, QueueOptions(name=QUEUE), Message())
    assert isinstance(prepared, Prepared), prepared
    services = Services(database=DATABASE, resources=MappingProxyType(resources or {}))
    return await invoke(
        prepared.route,
        prepared.delivery,
        attempt=1,
        scope=scope,
        payload=prepared.payload,
        services=services,
        passthrough=passthrough,
    )


# -- factories (module level: the annotations naming them are resolved in this module's globals) ------

Events = Annotated[list[str], Resource("events")]  # each test's own record of what happened


def settings() -> dict[str, str]:
    return {"name": "shop"}


async def client(config: Annotated[dict[str, str], Depends(settings)], events: Events) -> str:
    events.append("client")
    return f"client of {config['name']}"


async def connection(events: Events) -> AsyncIterator[str]:
    events.append("open connection")
    try:
        yield "connection"
    except BaseException as exc:
        events.append(f"connection saw {type(exc).__name__}")
        raise
    finally:
        events.append("close connection")


def cursor(c: Annotated[str, Depends(connection)], events: Events) -> Iterator[str]:
    events.append("open cursor")
    try:
        yield f"cursor on {c}"
    finally:
        events.append("close cursor")


def user_of_client(c: Annotated[str, Depends(client)]) -> str:
    return f"user of {c}"


async def forgiving() -> AsyncIterator[None]:
    with contextlib.suppress(Exception):  # a factory that swallows what the handler raised
        yield


async def leaky() -> AsyncIterator[None]:
    yield
    raise OSError("could not close")


async def broken() -> object:
    raise LookupError("no such tenant")


def repository(url) -> object:  # type: ignore[no-untyped-def]
    return object()


def timed_repository(timeout: float) -> object:
    return object()


def order_of(order: Json[Order]) -> Order:
    return order


def writer(mongo: MongoScope) -> object:
    return mongo


def http_client(http: Annotated[object, Resource("http")]) -> object:
    return http


def value() -> int:
    return 1


def ours(name: Annotated[dict[str, str], Resource("settings")], db: MongoDatabase) -> tuple[str, object]:
    return name["name"], db


async def greeting(
    config: Annotated[tuple[str, object], Depends(ours)], event_id: EventId, mongo: MongoScope
) -> tuple[str, object, object]:
    return f"{config[0]}:{event_id}", config[1], mongo


def cycle_a(x: Annotated[object, Depends(cycle_b)]) -> object:  # cycle_b: defined below
    return x


def cycle_b(y: Annotated[object, Depends(cycle_a)]) -> object:
    return y


# -- plan time ---------------------------------------------------------------------------------------


def test_a_handler_without_injections_takes_the_direct_path() -> None:
    @queue(QUEUE, version=1)
    async def plain(order: Json[Order], event_id: EventId, mongo: MongoScope) -> None: ...

    route = route_of(plain)
    assert (route.direct, route.injects, route.dependencies, route.resources) == (True, False, (), ())


def test_every_factory_is_resolved_once_in_the_order_an_attempt_calls_them() -> None:
    @queue(QUEUE, version=1)
    async def handler(
        cur: Annotated[str, Depends(cursor)],
        c: Annotated[str, Depends(client)],
        again: Annotated[str, Depends(user_of_client)],
    ) -> None: ...

    route = route_of(handler)
    assert [(d.name, d.kind) for d in route.dependencies] == [
        ("connection", "async_generator"),
        ("cursor", "generator"),
        ("settings", "function"),
        ("client", "coroutine"),
        ("user_of_client", "function"),
    ]
    assert (route.direct, route.injects) == (False, True)


def test_a_factory_parameter_without_an_annotation_is_a_plan_error_naming_it() -> None:
    @queue(QUEUE, version=1, handler_id="h1")
    async def handler(repo: Annotated[object, Depends(repository)]) -> None: ...

    message = plan_error(handler)
    for part in ("handler 'h1'", "parameter 'repo'", "Depends(repository)", "parameter 'url'", "no annotation"):
        assert part in message, message


def test_an_uninjectable_factory_parameter_is_a_plan_error_naming_it() -> None:
    @queue(QUEUE, version=1, handler_id="h1")
    async def handler(repo: Annotated[object, Depends(timed_repository)]) -> None: ...

    message = plan_error(handler)
    for part in ("parameter 'repo'", "parameter 'timeout'", "float", "not injectable"):
        assert part in message, message


def test_a_factory_that_needs_itself_is_a_plan_error() -> None:
    @queue(QUEUE, version=1, handler_id="h1")
    async def handler(v: Annotated[object, Depends(cycle_a)]) -> None: ...

    assert "Depends(cycle_a) needs itself: cycle_a -> cycle_b -> cycle_a" in plan_error(handler)


def test_each_depends_parameter_counts_once_toward_the_parameter_bound() -> None:
    def make(count: int) -> Handler:
        params = ", ".join(f"p{i}: Annotated[int, Depends(value)]" for i in range(count))
        namespace: dict[str, Any] = {}
        exec(f"async def handler({params}) -> None: ...", globals(), namespace)
        handler: Handler = namespace["handler"]
        return queue(QUEUE, version=1)(handler)

    route = route_of(make(PARAMETERS))
    assert (len(route.parameters), len(route.dependencies)) == (PARAMETERS, 1)
    assert "17 parameters, over the bound of 16" in plan_error(make(PARAMETERS + 1))


def test_a_factory_has_the_same_parameter_bound() -> None:
    params = ", ".join(f"m{i}: RetryCount" for i in range(PARAMETERS + 1))
    namespace: dict[str, Any] = {}
    exec(f"def factory({params}) -> int: return 0", globals(), namespace)
    wide = namespace["factory"]

    async def handler(v: int) -> None: ...

    handler.__annotations__["v"] = Annotated[int, Depends(wide)]
    assert "17 parameters, over the bound of 16" in plan_error(queue(QUEUE, version=1)(handler))


def test_one_terminal_extractor_over_the_handler_and_its_factories() -> None:
    @queue(QUEUE, version=1)
    async def both(note: Text, order: Annotated[Order, Depends(order_of)]) -> None: ...

    message = plan_error(both)
    assert "2 terminal payload extractors (note, order_of.order), over the bound of 1" in message

    @queue(QUEUE, version=1)
    async def one(order: Annotated[Order, Depends(order_of)]) -> None: ...

    terminal = route_of(one).terminal
    assert terminal is not None
    assert terminal.name == "order"  # the factory's body parameter: prepare decodes it


def test_a_mongo_scope_in_a_factory_needs_the_inbox_guarantee() -> None:
    @queue(QUEUE, version=1, guarantee="at_least_once")
    async def handler(w: Annotated[object, Depends(writer)]) -> None: ...

    message = plan_error(handler)
    assert "parameter 'mongo'" in message
    assert "a MongoScope parameter needs guarantee 'inbox'" in message


def test_mongo_database_is_valid_for_every_guarantee_but_needs_a_mongo_client() -> None:
    @queue(QUEUE, version=1, guarantee="at_least_once")
    async def at_least_once(db: MongoDatabase) -> None: ...

    @queue(QUEUE, version=1, guarantee="inbox")
    async def inbox(db: MongoDatabase) -> None: ...

    assert route_of(at_least_once).parameters[0].source == "database"
    assert route_of(inbox).parameters[0].source == "database"

    @queue(QUEUE, version=1)
    async def without(db: MongoDatabase) -> None: ...

    message = plan_error(without, has_mongo=False)
    assert "parameter 'db'" in message
    assert "a MongoDatabase parameter needs a Consumer with a mongo_client" in message


def test_resource_names_are_collected_with_who_asks_for_them() -> None:
    @queue(QUEUE, version=1, handler_id="h1")
    async def handler(
        conf: Annotated[dict[str, Any], Resource("settings")], c: Annotated[object, Depends(http_client)]
    ) -> None: ...

    route = route_of(handler)
    assert route.resources == (
        ("settings", "handler 'h1': parameter 'conf'"),
        ("http", "handler 'h1': parameter 'c' (Depends(http_client)): parameter 'http'"),
    )


def test_two_marks_on_one_parameter_are_refused() -> None:
    @queue(QUEUE, version=1)
    async def handler(v: Annotated[int, Depends(value), Resource("x")]) -> None: ...

    assert "has 2 extractors (Depends(value), Resource('x'))" in plan_error(handler)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: Depends(42), "Depends(factory) needs a callable factory, got int 42"),  # type: ignore[arg-type]
        (lambda: Resource(""), "Resource(name) needs a non-empty string, got str '' (length 0)"),
        (lambda: Resource(1), "Resource(name) needs a non-empty string, got int 1"),  # type: ignore[arg-type]
    ],
)
def test_bad_marks_are_refused_at_once(make: Callable[[], object], says: str) -> None:
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value) == says


# -- one attempt -------------------------------------------------------------------------------------


async def test_factories_receive_extractors_resources_the_database_the_scope_and_each_other() -> None:
    seen: dict[str, Any] = {}
    scope = object()

    @queue(QUEUE, version=1)
    async def handler(
        order: Json[Order], text: Annotated[tuple[str, object, object], Depends(greeting)], db: MongoDatabase
    ) -> None:
        seen.update(order=order.order_id, text=text, db=db)

    result = await attempt(handler, resources={"settings": {"name": "shop"}}, scope=scope)
    assert result.outcome is Outcome.SUCCESS
    assert seen == {"order": "o1", "text": (f"shop:{EVENT_ID}", DATABASE, scope), "db": DATABASE}


async def test_each_factory_runs_once_per_attempt_however_many_ask_for_it() -> None:
    events: list[str] = []

    @queue(QUEUE, version=1)
    async def handler(a: Annotated[str, Depends(client)], b: Annotated[str, Depends(user_of_client)]) -> None:
        assert b == f"user of {a}"

    assert (await attempt(handler, resources={"events": events})).outcome is Outcome.SUCCESS
    assert (await attempt(handler, resources={"events": events})).outcome is Outcome.SUCCESS
    assert events == ["client", "client"]  # once per attempt, two attempts


async def test_generator_cleanups_run_after_the_handler_in_reverse_order() -> None:
    events: list[str] = []

    @queue(QUEUE, version=1)
    async def handler(cur: Annotated[str, Depends(cursor)], log: Events) -> None:
        log.append(f"handler with {cur}")

    assert (await attempt(handler, resources={"events": events})).outcome is Outcome.SUCCESS
    assert events == [
        "open connection",
        "open cursor",
        "handler with cursor on connection",
        "close cursor",
        "close connection",
    ]


@pytest.mark.parametrize(
    ("error", "outcome", "code"),
    [
        (RuntimeError("unexpected bug"), Outcome.RETRYABLE, HANDLER_FAILED),
        (QueueHandlerError.permanent("ORDER_INVALID", "no lines"), Outcome.PERMANENT, "ORDER_INVALID"),
    ],
)
async def test_cleanups_run_on_failure_see_it_and_the_verdict_keeps_the_exception(
    error: Exception, outcome: Outcome, code: str
) -> None:
    events: list[str] = []

    @queue(QUEUE, version=1)
    async def handler(c: Annotated[str, Depends(connection)]) -> None:
        raise error

    result = await attempt(handler, resources={"events": events})
    assert (result.outcome, result.code, result.exception) == (outcome, code, error)
    assert events == ["open connection", f"connection saw {type(error).__name__}", "close connection"]


def handler_failure(result: PipelineResult) -> str:
    """The reason of an attempt that failed as a handler does (retryable, ``QUEUE_HANDLER_FAILED``)."""
    assert (result.outcome, result.code) == (Outcome.RETRYABLE, HANDLER_FAILED), result
    return result.reason


async def test_a_cleanup_cannot_swallow_the_failure() -> None:
    @queue(QUEUE, version=1)
    async def handler(f: Annotated[None, Depends(forgiving)]) -> None:
        raise RuntimeError("still a failure")

    assert handler_failure(await attempt(handler)) == "RuntimeError: still a failure"


async def test_a_failing_cleanup_fails_the_attempt() -> None:
    @queue(QUEUE, version=1)
    async def handler(f: Annotated[None, Depends(leaky)]) -> None: ...

    assert handler_failure(await attempt(handler)) == "OSError: could not close"


async def test_a_replayed_error_passes_through_after_the_cleanups_ran() -> None:
    events: list[str] = []

    @queue(QUEUE, version=1)
    async def handler(c: Annotated[str, Depends(connection)]) -> None:
        raise Transient("write conflict")

    with pytest.raises(Transient):
        await attempt(handler, resources={"events": events}, passthrough=lambda exc: isinstance(exc, Transient))
    assert events == ["open connection", "connection saw Transient", "close connection"]


async def test_a_factory_that_raises_is_the_attempts_failure_and_the_handler_never_runs() -> None:
    ran: list[str] = []

    @queue(QUEUE, version=1)
    async def handler(t: Annotated[object, Depends(broken)]) -> None:
        ran.append("handler")

    result = await attempt(handler)
    assert (result.outcome, result.reason, ran) == (Outcome.RETRYABLE, "LookupError: no such tenant", [])


async def test_guards_run_before_any_factory() -> None:
    events: list[str] = []

    async def refuse(ctx: Any) -> bool:
        return False

    builder = PlanBuilder(name="svc", has_mongo=True)
    builder.guards.append(refuse)

    @queue(QUEUE, version=1)
    async def handler(c: Annotated[str, Depends(client)]) -> None: ...

    builder.include(handler)
    prepared = prepare(builder.build(MongoScope), QueueOptions(name=QUEUE), Message())
    assert isinstance(prepared, Prepared)
    services = Services(resources=MappingProxyType({"events": events}))
    result = await invoke(prepared.route, prepared.delivery, attempt=1, payload=prepared.payload, services=services)
    assert (result.outcome, result.code, events) == (Outcome.PERMANENT, "QUEUE_GUARD_REJECTED", [])


# -- refused deliveries name their event id ----------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "event_id"),
    [
        ({"x-lily-event-id": EVENT_ID, "x-lily-schema-version": "01", "x-lily-content-kind": "json"}, EVENT_ID),
        ({"x-lily-event-id": EVENT_ID}, EVENT_ID),
        ({"x-lily-event-id": EVENT_ID.upper(), "x-lily-schema-version": "1", "x-lily-content-kind": "json"}, None),
        ({"x-lily-event-id": 7}, None),
        ({}, None),
    ],
)
def test_an_invalid_envelope_keeps_the_event_id_when_its_header_was_valid(
    headers: dict[str, Any], event_id: str | None
) -> None:
    @queue(QUEUE, version=1)
    async def handler(order: Json[Order]) -> None: ...

    refused = prepare(build(handler), QueueOptions(name=QUEUE), Message(headers=headers))
    assert not isinstance(refused, Prepared)
    assert refused.envelope is None
    assert refused.event_id == (uuid.UUID(event_id) if event_id else None)


def test_a_lenient_read_delivery_keeps_its_event_id_too() -> None:
    @queue(QUEUE, version=1)
    async def handler(order: Json[Order]) -> None: ...

    message = Message()
    message.malformed = "a header name is not valid UTF-8"
    refused = prepare(build(handler), QueueOptions(name=QUEUE), message)
    assert not isinstance(refused, Prepared)
    assert (refused.result.code, refused.event_id) == ("QUEUE_ENVELOPE_INVALID", uuid.UUID(EVENT_ID))


def test_a_dispatch_refusal_keeps_the_envelopes_event_id() -> None:
    @queue(QUEUE, version=1)
    async def handler(order: Json[Order]) -> None: ...

    headers = {**HEADERS, "x-lily-schema-version": "2"}
    refused = prepare(build(handler), QueueOptions(name=QUEUE), Message(headers=headers))
    assert not isinstance(refused, Prepared)
    assert (refused.result.code, refused.event_id) == ("QUEUE_SCHEMA_VERSION_UNSUPPORTED", uuid.UUID(EVENT_ID))
