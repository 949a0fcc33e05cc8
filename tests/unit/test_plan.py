"""Plan-time bounds and registration rules (docs/configuration.md, docs/settlement.md).

Every bound (docs/configuration.md) that is checked when the consumer plan is built
is probed at the limit (accepted) and one past it (rejected with a
``ConfigError``/``PlanError`` whose message names the field, the value and
the limit). The limits are written out literally from the documented table, so a
wrong bounds table fails here as well as a wrong check. Sizes are UTF-8 bytes.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Annotated, Any

import pytest

from lily_mongo import (
    Bytes,
    ConfigError,
    Consumer,
    Depends,
    EventId,
    Extractor,
    Json,
    PlanError,
    RawDelivery,
    Redelivered,
    Resource,
    RetryCount,
    Text,
)
from lily_mongo._engine.dispatch import select_route as dispatch
from lily_mongo._inbox import MongoScope
from lily_mongo._plan.extractors import PayloadDecodeError, new_raw_delivery
from lily_mongo._plan.options import QueueOptions, RetryPolicy
from lily_mongo._plan.plan import Plan, PlanBuilder
from lily_mongo._plan.routes import HandlerRoute, queue
from lily_mongo._topology import topology_names
from lily_mongo.envelope import Envelope
from tests.support.handlers import Order, taking_every_kind

AMQP_URL = "amqp://guest:guest@127.0.0.1/"
Handler = Callable[..., Awaitable[None]]

# The documented bounds (docs/configuration.md), spelled out.
PHYSICAL_QUEUES = 256
LINKED_HANDLERS = 512
TRACE_CELLS = 256
DESCRIPTOR_BYTES = 1024
PLAN_BYTES = 256 * 1024
MIDDLEWARE = 64
GUARDS = 64
PARAMETERS = 16
CONCURRENCY_MAX = 1024
PREFETCH_MAX = 4096
BUCKETS_PER_QUEUE = 32
BUCKETS_TOTAL = 4096
NAME_MAX = 200
# The longest derived name is "<queue>.retry.31" (32 buckets, 0-based): 9 bytes of suffix.
BASE_NAME_MAX = NAME_MAX - len(".retry.31")
CONTENT_KIND_MAX = 64
VERSION_MAX = 65535

# Stable codes (docs/settlement.md).
SCHEMA_VERSION_UNSUPPORTED = "QUEUE_SCHEMA_VERSION_UNSUPPORTED"
CONTENT_KIND_UNSUPPORTED = "QUEUE_CONTENT_KIND_UNSUPPORTED"


class NoSchema:
    """A plain class pydantic cannot build a schema for."""

    def __init__(self, anything: object) -> None:
        self.anything = anything


# -- helpers ------------------------------------------------------------------------------


def new_handler() -> Handler:
    async def handler() -> None:
        return None

    return handler


def routed(*routes: dict[str, Any], fn: Handler | None = None) -> Handler:
    """A handler carrying one ``@queue`` registration per keyword dict (stacked decorators)."""
    handler = fn if fn is not None else new_handler()
    for route in routes:
        route = dict(route)
        handler = queue(route.pop("name", "q"), **{"version": 1, **route})(handler)
    return handler


def handler_with_parameters(count: int, annotation: str = "EventId") -> Handler:
    """A real ``async def`` with ``count`` parameters annotated ``annotation`` (module names)."""
    params = ", ".join(f"p{i}: {annotation}" for i in range(count))
    namespace: dict[str, Any] = {}
    exec(f"async def handler({params}) -> None:\n    return None\n", globals(), namespace)
    handler: Handler = namespace["handler"]
    return handler


def build(
    *handlers: Handler,
    has_mongo: bool = False,
    queues: Iterable[QueueOptions] = (),
    middleware: Iterable[Any] = (),
    guards: Iterable[Any] = (),
    name: str = "svc",
) -> Plan:
    builder = PlanBuilder(name=name, has_mongo=has_mongo)
    for options in queues:
        builder.configure_queue(options)
    builder.middleware.extend(middleware)
    builder.guards.extend(guards)
    for handler in handlers:
        builder.include(handler)
    return builder.build(MongoScope)


def assert_names(error: BaseException, *parts: object) -> None:
    """The error message mentions every part (field, value, limit)."""
    message = str(error)
    for part in parts:
        assert str(part) in message, f"{part!r} not in {message!r}"


def plan_error(*handlers: Handler, **kwargs: Any) -> PlanError:
    with pytest.raises(PlanError) as info:
        build(*handlers, **kwargs)
    return info.value


def config_error(make: Callable[[], object]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        make()
    return info.value


async def middleware(ctx: Any, call_next: Callable[[], Awaitable[None]]) -> None:
    await call_next()


async def guard(ctx: Any) -> None:
    return None


def delivery(body: bytes, *, content_kind: str = "json") -> RawDelivery:
    envelope = Envelope(
        event_id=uuid.UUID("0f8fad5b-d9cb-469f-a165-70867728950e"),
        schema_version=1,
        content_kind=content_kind,
        retry_count=0,
        traceparent=None,
        tracestate=None,
    )
    return RawDelivery(
        queue="q",
        headers={},
        body=body,
        content_type="application/json",
        redelivered=False,
        envelope=envelope,
        routing_key="q",
        exchange="",
    )


def test_the_per_delivery_constructor_builds_the_same_raw_delivery() -> None:
    built = delivery(b'{"n": 1}')
    fast = new_raw_delivery(
        built.queue,
        built.headers,
        built.body,
        built.content_type,
        built.redelivered,
        built.envelope,
        built.routing_key,
        built.exchange,
    )
    assert fast == built
    assert type(fast) is RawDelivery
    with pytest.raises(AttributeError):
        fast.body = b"changed"  # type: ignore[misc]


def terminal_extractor(handler: Handler) -> Extractor:
    plan = build(handler)
    terminal = plan.handlers[0].terminal
    assert terminal is not None
    assert terminal.extractor is not None
    return terminal.extractor


# -- errors are ValueErrors --------------------------------------------------------------


def test_plan_error_is_a_config_error_and_a_value_error() -> None:
    assert issubclass(PlanError, ConfigError)
    assert issubclass(ConfigError, ValueError)


# -- physical queues: 256 -----------------------------------------------------------------


def test_physical_queues_at_the_limit_are_accepted() -> None:
    handler = routed(*({"name": f"q{i:03d}"} for i in range(PHYSICAL_QUEUES)))
    plan = build(handler)
    assert len(plan.queues) == 256
    assert len(plan.handlers) == 256


def test_physical_queues_one_past_the_limit_are_rejected() -> None:
    handler = routed(*({"name": f"q{i:03d}"} for i in range(PHYSICAL_QUEUES + 1)))
    error = plan_error(handler)
    assert_names(error, "physical queues", "257", "256")


def test_physical_queues_through_the_public_consumer() -> None:
    consumer = Consumer(amqp_url=AMQP_URL, name="svc")
    consumer.include(routed(*({"name": f"q{i:03d}"} for i in range(PHYSICAL_QUEUES + 1))))
    with pytest.raises(PlanError) as info:
        consumer.plan()
    assert_names(info.value, "physical queues", "257", "256")


# -- linked handlers: 512 -----------------------------------------------------------------


def test_linked_handlers_at_the_limit_are_accepted() -> None:
    # One function serving 512 schema versions of one queue: 512 linked handlers.
    plan = build(routed(*({"version": v} for v in range(1, LINKED_HANDLERS + 1))))
    assert len(plan.handlers) == 512
    assert len(plan.routes["q"]) == 512


def test_linked_handlers_one_past_the_limit_are_rejected() -> None:
    first = routed(*({"version": v} for v in range(1, 301)))
    second = routed(*({"version": v} for v in range(301, LINKED_HANDLERS + 2)))
    error = plan_error(first, second)
    assert_names(error, "linked handlers", "513", "512")


def test_including_the_same_function_twice_links_it_once() -> None:
    handler = routed({"version": 1})
    plan = build(handler, handler)
    assert len(plan.handlers) == 1


# -- trace cells: 256 ---------------------------------------------------------------------


def test_trace_label_defaults_to_the_queue_name() -> None:
    plan = build(routed({"name": "orders.created"}, {"name": "orders.created", "version": 2, "trace": "orders"}))
    traces = {h.version: h.trace for h in plan.handlers}
    assert traces == {1: "orders.created", 2: "orders"}


def test_trace_cells_at_the_limit_are_accepted() -> None:
    # 255 explicit labels plus the default label (the queue name "q"): 256 cells.
    labelled = ({"version": v, "trace": f"t{v:03d}"} for v in range(1, TRACE_CELLS))
    plan = build(routed(*labelled, {"version": 999}))
    assert len({h.trace for h in plan.handlers}) == 256


def test_many_handlers_sharing_a_trace_label_use_one_cell() -> None:
    plan = build(routed(*({"version": v} for v in range(1, 301))))
    assert {h.trace for h in plan.handlers} == {"q"}


def test_trace_cells_one_past_the_limit_are_rejected() -> None:
    labelled = ({"version": v, "trace": f"t{v:03d}"} for v in range(1, TRACE_CELLS + 2))
    error = plan_error(routed(*labelled))
    assert_names(error, "trace cells", "257", "256")


# -- descriptor: 1024 bytes per handler, 256 KiB per plan -----------------------------------
# A handler's descriptor is handler_id + queue + content + trace + parameter names + 16
# bytes. For queue "q", content "json", the default trace "q" and no parameters that is
# len(handler_id) + 22 bytes, so a handler_id of 1002 bytes reaches 1024 exactly.


def test_descriptor_at_the_limit_is_accepted() -> None:
    plan = build(routed({"handler_id": "h" * 1002}))
    assert plan.handlers[0].handler_id == "h" * 1002


def test_descriptor_one_past_the_limit_is_rejected() -> None:
    error = plan_error(routed({"handler_id": "h" * 1003}))
    assert_names(error, "descriptor", "1025", "1024")


def test_descriptor_counts_utf8_bytes() -> None:
    build(routed({"handler_id": "é" * 501}))  # 1002 bytes, 501 characters
    error = plan_error(routed({"handler_id": "é" * 501 + "a"}))  # 1003 bytes
    assert_names(error, "descriptor", "1025", "1024")


def test_descriptor_counts_parameter_names_and_trace() -> None:
    def make() -> Handler:
        async def handler(event: EventId) -> None:  # "event": 5 bytes
            return None

        return handler

    # 997 + 1 (queue) + 4 (content) + 1 (trace "q") + 5 + 16 = 1024
    build(queue("q", version=1, handler_id="h" * 997)(make()))
    with pytest.raises(PlanError) as info:
        build(queue("q", version=1, handler_id="h" * 997, trace="qq")(make()))
    assert_names(info.value, "descriptor", "1025", "1024")


def _full_descriptors(count: int, last_short_by: int) -> Handler:
    routes: list[dict[str, Any]] = [{"version": v, "handler_id": f"{v:04d}" + "h" * 998} for v in range(1, count + 1)]
    routes[-1]["handler_id"] = routes[-1]["handler_id"][: 1002 - last_short_by]
    return routed(*routes)


def test_aggregate_plan_at_the_limit_is_accepted() -> None:
    # Consumer name "c" (1 byte) + 255 * 1024 + 1023 = 262144 bytes.
    plan = build(_full_descriptors(256, last_short_by=1), name="c")
    assert len(plan.handlers) == 256


def test_aggregate_plan_one_past_the_limit_is_rejected() -> None:
    error = plan_error(_full_descriptors(256, last_short_by=0), name="c")
    assert_names(error, "plan", "262145", "262144")


def test_consumer_name_bounds() -> None:
    build(routed({}), name="n" * DESCRIPTOR_BYTES)
    assert_names(plan_error(routed({}), name="n" * (DESCRIPTOR_BYTES + 1)), "consumer name", "1025", "1024")
    assert_names(plan_error(routed({}), name=""), "consumer name", "1024")


# -- middleware and guards: 64 each (consumer-wide + per handler) ---------------------------


def test_middleware_at_the_limit_is_accepted() -> None:
    handler = routed({"middleware": [middleware] * 32})
    plan = build(handler, middleware=[middleware] * 32)
    assert len(plan.handlers[0].middleware) == 64


@pytest.mark.parametrize(("consumer_wide", "per_handler"), [(65, 0), (0, 65), (32, 33), (64, 1)])
def test_middleware_one_past_the_limit_is_rejected(consumer_wide: int, per_handler: int) -> None:
    handler = routed({"middleware": [middleware] * per_handler})
    error = plan_error(handler, middleware=[middleware] * consumer_wide)
    assert_names(error, "65 middleware", "64")


def public_plan_error(add: Callable[[Consumer], None], count: int, route: dict[str, Any]) -> PlanError:
    """The plan error of a :class:`Consumer` that ``add`` gave ``count`` consumer-wide layers, its one
    handler routed with ``route``."""
    consumer = Consumer(amqp_url=AMQP_URL, name="svc")
    for _ in range(count):
        add(consumer)
    consumer.include(routed(route))
    with pytest.raises(PlanError) as info:
        consumer.plan()
    return info.value


def test_middleware_through_the_public_consumer() -> None:
    error = public_plan_error(lambda consumer: consumer.use(middleware), MIDDLEWARE, {"middleware": [middleware]})
    assert_names(error, "65 middleware", "64")


def test_guards_at_the_limit_are_accepted() -> None:
    plan = build(routed({"guards": [guard] * 40}), guards=[guard] * 24)
    assert len(plan.handlers[0].guards) == 64


@pytest.mark.parametrize(("consumer_wide", "per_handler"), [(65, 0), (0, 65), (24, 41)])
def test_guards_one_past_the_limit_are_rejected(consumer_wide: int, per_handler: int) -> None:
    error = plan_error(routed({"guards": [guard] * per_handler}), guards=[guard] * consumer_wide)
    assert_names(error, "65 guards", "64")


def test_guards_through_the_public_consumer() -> None:
    error = public_plan_error(lambda consumer: consumer.guard(guard), GUARDS, {"guards": [guard]})
    assert_names(error, "65 guards", "64")


# -- handler parameters: 16, at most one terminal payload extractor --------------------------


def test_parameters_at_the_limit_are_accepted() -> None:
    plan = build(routed({}, fn=handler_with_parameters(PARAMETERS)))
    assert len(plan.handlers[0].parameters) == 16


def test_parameters_one_past_the_limit_are_rejected() -> None:
    error = plan_error(routed({}, fn=handler_with_parameters(PARAMETERS + 1)))
    assert_names(error, "17 parameters", "16")


def test_every_builtin_extractor_is_injectable() -> None:
    plan = build(queue("q", version=1)(taking_every_kind({})), has_mongo=True)
    route = plan.handlers[0]
    assert [p.name for p in route.parameters] == ["order", "event_id", "retries", "redelivered", "raw", "mongo"]
    assert route.terminal is not None
    assert route.terminal.name == "order"
    # Only the MongoScope parameter has no extractor: the attempt's scope is passed there.
    assert [p.name for p in route.parameters if p.extractor is None] == ["mongo"]


@pytest.mark.parametrize(
    ("first", "second"), [("Json[Order]", "Text"), ("Text", "Bytes"), ("Bytes", "Json[Order]"), ("Bytes", "Bytes")]
)
def test_two_terminal_extractors_are_rejected(first: str, second: str) -> None:
    namespace: dict[str, Any] = {}
    exec(f"async def handler(a: {first}, b: {second}) -> None:\n    return None\n", globals(), namespace)
    error = plan_error(routed({}, fn=namespace["handler"]))
    assert_names(error, "2 terminal payload extractors", "a, b", "bound of 1")


def test_one_terminal_extractor_with_fifteen_metadata_parameters_is_accepted() -> None:
    namespace: dict[str, Any] = {}
    params = ", ".join(["body: Text", *(f"m{i}: RetryCount" for i in range(15))])
    exec(f"async def handler({params}) -> None:\n    return None\n", globals(), namespace)
    plan = build(routed({}, fn=namespace["handler"]))
    assert len(plan.handlers[0].parameters) == 16


def test_unannotated_parameter_is_rejected() -> None:
    async def handler(payload) -> None:  # type: ignore[no-untyped-def]
        return None

    error = plan_error(queue("q", version=1)(handler))
    assert_names(error, "'payload'", "no annotation")


def test_uninjectable_parameter_is_rejected() -> None:
    async def handler(count: int) -> None:
        return None

    error = plan_error(queue("q", version=1)(handler))
    assert_names(error, "'count'", "int", "not injectable")


def test_a_bare_model_parameter_asks_whether_json_was_meant() -> None:
    async def handler(order: Order) -> None:
        return None

    error = plan_error(queue("q", version=1)(handler))
    assert_names(error, "parameter 'order' of type Order is not injectable: did you mean Json[Order]")


def test_a_depends_default_names_the_annotated_form() -> None:
    def get_rate() -> int:
        return 3

    async def handler(rate: int = Depends(get_rate)) -> None:  # type: ignore[assignment]  # the FastStream habit
        return None

    error = plan_error(queue("q", version=1)(handler))
    assert_names(
        error,
        "parameter 'rate' of type int is not injectable: Depends(get_rate) as a default value is FastStream's form",
        "rate: Annotated[int, Depends(get_rate)]",
    )


def test_a_resource_default_names_the_annotated_form() -> None:
    async def handler(client: object = Resource("http")) -> None:
        return None

    assert_names(plan_error(queue("q", version=1)(handler)), "client: Annotated[object, Resource('http')]")


# What FastStream's Context() looks like to the check (FastStream is not installed, and never imported).
Context = type("Context", (), {"__module__": "faststream._internal.context"})


def test_a_context_style_parameter_names_what_replaces_it() -> None:
    async def handler(message: dict[str, Any] = Context()) -> None:  # noqa: B008 - the FastStream habit
        return None

    async def logged(logger: logging.Logger) -> None:
        return None

    for handler_fn in (handler, logged):
        error = plan_error(queue("q", version=1)(handler_fn))
        assert_names(error, "FastStream's Context has no equivalent here", "EventId, RetryCount", "Resource(name)")


def test_str_and_bytes_parameters_name_text_and_bytes() -> None:
    async def as_text(body: str) -> None:
        return None

    async def as_bytes(body: bytes) -> None:
        return None

    assert_names(plan_error(queue("q", version=1)(as_text)), "did you mean Text")
    assert_names(plan_error(queue("q", version=1)(as_bytes)), "did you mean Bytes")


def test_variadic_and_positional_only_parameters_are_rejected() -> None:
    async def star(*args: EventId) -> None:
        return None

    async def positional(event: EventId, /) -> None:
        return None

    assert_names(plan_error(queue("q", version=1)(star)), "'args'", "cannot be injected")
    assert_names(plan_error(queue("q", version=1)(positional)), "'event'", "positional-only")


def test_two_extractors_on_one_parameter_are_rejected() -> None:
    async def handler(value: Annotated[Any, *EventId.__metadata__, *RetryCount.__metadata__]) -> None:
        return None

    assert_names(plan_error(queue("q", version=1)(handler)), "'value'", "2 extractors")


def test_json_of_a_type_without_schema_is_rejected_at_plan_time() -> None:
    async def handler(body: Json[NoSchema]) -> None:
        return None

    assert_names(plan_error(queue("q", version=1)(handler)), "Json[", "NoSchema", "no pydantic schema")


def test_unresolvable_annotation_is_rejected() -> None:
    async def handler(body: Json[Undefined]) -> None:  # type: ignore[name-defined]  # noqa: F821
        return None

    assert_names(plan_error(queue("q", version=1)(handler)), "cannot resolve parameter annotations", "Undefined")


# -- MongoScope and the guarantee -----------------------------------------------------------


def scoped() -> Handler:
    """A fresh handler taking a MongoScope (``@queue`` records routes on the function object)."""

    async def handler(mongo: MongoScope) -> None:
        return None

    return handler


def test_mongo_scope_without_a_mongo_client_is_rejected() -> None:
    error = plan_error(queue("q", version=1)(scoped()), has_mongo=False)
    assert_names(error, "MongoScope", "guarantee 'inbox'")


def test_mongo_scope_through_the_public_consumer_without_mongo() -> None:
    consumer = Consumer(amqp_url=AMQP_URL, name="svc")
    consumer.include(queue("q", version=1)(scoped()))
    with pytest.raises(PlanError) as info:
        consumer.plan()
    assert_names(info.value, "MongoScope", "guarantee 'inbox'")


def test_mongo_scope_with_a_mongo_client_defaults_to_inbox() -> None:
    plan = build(queue("q", version=1)(scoped()), has_mongo=True)
    assert plan.handlers[0].guarantee == "inbox"


def test_mongo_scope_with_at_least_once_is_rejected() -> None:
    error = plan_error(queue("q", version=1, guarantee="at_least_once")(scoped()), has_mongo=True)
    assert_names(error, "MongoScope", "guarantee 'inbox'")


def test_inbox_guarantee_without_a_mongo_client_is_rejected() -> None:
    error = plan_error(routed({"guarantee": "inbox"}), has_mongo=False)
    assert_names(error, "guarantee 'inbox'", "mongo_client")


def test_guarantee_defaults() -> None:
    assert build(routed({}), has_mongo=False).handlers[0].guarantee == "at_least_once"
    assert build(routed({}), has_mongo=True).handlers[0].guarantee == "inbox"
    assert build(routed({"guarantee": "at_least_once"}), has_mongo=True).handlers[0].guarantee == "at_least_once"


def test_unknown_guarantee_is_rejected() -> None:
    assert_names(config_error(lambda: queue("q", version=1, guarantee="exactly_once")), "guarantee", "exactly_once")  # type: ignore[arg-type]


# -- queue options: concurrency, prefetch, buffer --------------------------------------------


def test_concurrency_bounds() -> None:
    assert QueueOptions(name="q", concurrency=1).concurrency == 1
    assert QueueOptions(name="q", concurrency=CONCURRENCY_MAX).concurrency == 1024
    assert_names(config_error(lambda: QueueOptions(name="q", concurrency=1025)), "concurrency", "1025", "1..1024")
    assert_names(config_error(lambda: QueueOptions(name="q", concurrency=0)), "concurrency", "0", "1..1024")
    assert_names(config_error(lambda: QueueOptions(name="q", concurrency=True)), "concurrency", "bool", "1..1024")
    assert_names(config_error(lambda: QueueOptions(name="q", concurrency=2.0)), "concurrency", "float", "1..1024")  # type: ignore[arg-type]


def test_concurrency_through_the_public_consumer() -> None:
    consumer = Consumer(amqp_url=AMQP_URL, name="svc")
    assert consumer.configure_queue("q", concurrency=1024).concurrency == 1024
    with pytest.raises(ConfigError) as info:
        consumer.configure_queue("q", concurrency=1025)
    assert_names(info.value, "'q'", "concurrency", "1025", "1..1024")


def test_prefetch_bounds() -> None:
    assert QueueOptions(name="q", prefetch=PREFETCH_MAX).prefetch == 4096
    assert_names(config_error(lambda: QueueOptions(name="q", prefetch=4097)), "prefetch", "4097", "4096")
    assert_names(config_error(lambda: QueueOptions(name="q", prefetch=0)), "prefetch", "0", "4096")


def test_buffer_bounds() -> None:
    assert QueueOptions(name="q", prefetch=10, buffer=10).buffer == 10
    assert QueueOptions(name="q", prefetch=10, buffer=0).buffer == 0
    assert QueueOptions(name="q", prefetch=10).buffer == 10  # default: the prefetch
    assert_names(config_error(lambda: QueueOptions(name="q", prefetch=10, buffer=11)), "buffer", "11", "10")
    assert_names(config_error(lambda: QueueOptions(name="q", prefetch=10, buffer=-1)), "buffer", "-1", "10")


def test_effective_prefetch_is_running_plus_buffered() -> None:
    assert QueueOptions(name="q", concurrency=2, prefetch=64, buffer=3).effective_prefetch == 5
    assert QueueOptions(name="q", concurrency=100, prefetch=64, buffer=64).effective_prefetch == 64


def test_other_queue_options_are_checked() -> None:
    assert_names(config_error(lambda: QueueOptions(name="q", max_body=16 * 1024 * 1024 + 1)), "max_body", "16777217")
    QueueOptions(name="q", max_body=16 * 1024 * 1024)
    assert_names(config_error(lambda: QueueOptions(name="q", max_deferrals=0)), "max_deferrals", "0")
    assert_names(config_error(lambda: QueueOptions(name="q", max_handoff_failures=0)), "max_handoff_failures", "0")
    assert_names(config_error(lambda: QueueOptions(name="q", queue_type="stream")), "queue_type", "stream")  # type: ignore[arg-type]
    assert_names(config_error(lambda: QueueOptions(name="q", deadline=0)), "deadline", "0")
    assert_names(config_error(lambda: QueueOptions(name="q", retry=(1, 2))), "retry", "RetryPolicy")  # type: ignore[arg-type]


def test_configured_queue_without_a_handler_is_rejected() -> None:
    error = plan_error(routed({"name": "a"}), queues=[QueueOptions(name="b")])
    assert_names(error, "'b'", "no handler")


def test_plan_without_handlers_is_rejected() -> None:
    assert_names(plan_error(), "no handlers")


def test_including_an_undecorated_function_is_rejected() -> None:
    builder = PlanBuilder(name="svc", has_mongo=False)
    with pytest.raises(PlanError) as info:
        builder.include(new_handler())
    assert_names(info.value, "no @queue")


# -- retry buckets: 32 per queue, 4096 in the topology ---------------------------------------


def _distinct_delays(count: int) -> tuple[float, ...]:
    return tuple(float(i) for i in range(1, count + 1))


def test_retry_buckets_per_queue_at_the_limit_are_accepted() -> None:
    policy = RetryPolicy(max_retries=BUCKETS_PER_QUEUE, delays=_distinct_delays(BUCKETS_PER_QUEUE))
    assert len(policy.bucket_delays_ms) == 32
    options = QueueOptions(name="q", retry=policy)
    assert topology_names(options)[-2] == "q.retry.31"


def test_retry_buckets_per_queue_one_past_the_limit_are_rejected() -> None:
    error = config_error(lambda: RetryPolicy(max_retries=33, delays=_distinct_delays(33)))
    assert_names(error, "RetryPolicy.delays", "33 distinct delays", "32")


def test_only_delays_a_retry_uses_make_buckets() -> None:
    # 40 distinct delays, but 32 retries reach only the first 32 of them.
    policy = RetryPolicy(max_retries=32, delays=_distinct_delays(40))
    assert len(policy.bucket_delays_ms) == 32
    # 100 retries (the RetryPolicy bound) through 32 distinct delays: still 32 buckets.
    assert len(RetryPolicy(max_retries=100, delays=_distinct_delays(32)).bucket_delays_ms) == 32


def _queues_with_buckets(count: int, buckets: int, prefix: str) -> list[QueueOptions]:
    policy = RetryPolicy(max_retries=buckets, delays=_distinct_delays(buckets))
    return [QueueOptions(name=f"{prefix}{i:03d}", retry=policy) for i in range(count)]


def test_retry_buckets_in_the_topology_at_the_limit_are_accepted() -> None:
    queues = _queues_with_buckets(128, BUCKETS_PER_QUEUE, "q")  # 128 * 32 = 4096
    handler = routed(*({"name": q.name} for q in queues))
    plan = build(handler, queues=queues)
    assert sum(len(q.retry.bucket_delays_ms) for q in plan.queues.values()) == 4096


def test_retry_buckets_in_the_topology_one_past_the_limit_are_rejected() -> None:
    queues = [*_queues_with_buckets(128, BUCKETS_PER_QUEUE, "q"), *_queues_with_buckets(1, 1, "extra")]
    handler = routed(*({"name": q.name} for q in queues))
    error = plan_error(handler, queues=queues)
    assert_names(error, "retry buckets in the topology", "4097", "4096")


def test_default_retry_policy_counts_towards_the_topology_bound() -> None:
    # Queues without configure_queue get RetryPolicy(): 5 retries, 5 distinct delays.
    plan = build(routed({"name": "a"}))
    assert plan.queues["a"].retry.bucket_delays_ms == (1000, 5000, 30000, 120000, 600000)


# -- retry policy semantics (docs/settlement.md section 9) -------------------------------------------------


def test_retry_n_waits_the_delay_at_min_n_len_minus_one() -> None:
    policy = RetryPolicy(max_retries=5, delays=(0.2, 1, 3))
    # Retries 0..4 wait 0.2, 1, 3, 3, 3 seconds: three distinct delays, three buckets.
    assert policy.delays == (0.2, 1.0, 3.0)
    assert policy.bucket_delays_ms == (200, 1000, 3000)
    assert [policy.bucket_for(n) for n in range(5)] == [0, 1, 2, 2, 2]


def test_each_distinct_delay_is_one_bucket_in_first_use_order() -> None:
    policy = RetryPolicy(max_retries=4, delays=(5, 1, 5, 1))
    assert policy.bucket_delays_ms == (5000, 1000)
    assert [policy.bucket_for(n) for n in range(4)] == [0, 1, 0, 1]
    single = RetryPolicy(max_retries=10, delays=(0.2,))
    assert single.bucket_delays_ms == (200,)
    assert {single.bucket_for(n) for n in range(10)} == {0}


def test_delays_equal_in_milliseconds_share_a_bucket() -> None:
    policy = RetryPolicy(max_retries=2, delays=(1.0, 1.0004))
    assert policy.bucket_delays_ms == (1000,)


def test_float_delays_are_allowed() -> None:
    assert RetryPolicy(max_retries=1, delays=(0.2,)).bucket_delays_ms == (200,)
    assert RetryPolicy(max_retries=1, delays=(0.001,)).bucket_delays_ms == (1,)
    assert RetryPolicy(max_retries=1, delays=[0.5]).delays == (0.5,)  # type: ignore[arg-type]


def test_zero_retries_need_no_buckets() -> None:
    policy = RetryPolicy(max_retries=0, delays=())
    assert policy.bucket_delays_ms == ()
    assert topology_names(QueueOptions(name="q", retry=policy)) == ["q", "q.dlq"]


def test_retry_policy_bounds() -> None:
    RetryPolicy(max_retries=100, delays=(1,))
    assert_names(config_error(lambda: RetryPolicy(max_retries=101, delays=(1,))), "max_retries", "101", "100")
    assert_names(config_error(lambda: RetryPolicy(max_retries=-1, delays=(1,))), "max_retries", "-1", "100")
    assert_names(config_error(lambda: RetryPolicy(max_retries=1, delays=())), "RetryPolicy.delays", "non-empty")
    RetryPolicy(max_retries=1, delays=(7 * 24 * 3600,))


@pytest.mark.parametrize("delay", [0, -1, 0.0004, float("nan"), float("inf"), 7 * 24 * 3600 + 1, "1", True])
def test_invalid_delays_are_rejected(delay: object) -> None:
    error = config_error(lambda: RetryPolicy(max_retries=1, delays=(delay,)))  # type: ignore[arg-type]
    assert_names(error, "RetryPolicy.delays[0]")


# -- names: 1..200 UTF-8 bytes, derived names included ---------------------------------------


def test_base_name_at_the_limit_keeps_every_derived_name_within_200_bytes() -> None:
    base = "q" * BASE_NAME_MAX
    policy = RetryPolicy(max_retries=32, delays=_distinct_delays(32))
    options = QueueOptions(name=base, retry=policy)
    names = topology_names(options)
    assert max(len(n.encode()) for n in names) == 200
    assert f"{base}.retry.31" in names
    plan = build(routed({"name": base}), queues=[options])
    assert base in plan.queues


def test_base_name_one_past_the_limit_is_rejected_everywhere() -> None:
    name = "q" * (BASE_NAME_MAX + 1)
    for make in (
        lambda: QueueOptions(name=name),
        lambda: queue(name, version=1),
        lambda: Consumer(amqp_url=AMQP_URL, name="svc").configure_queue(name),
    ):
        assert_names(config_error(make), "queue name", "192 bytes", "1..191")


@pytest.mark.parametrize(
    ("accepted", "rejected"),
    [
        ("é" * 95 + "q", "é" * 96),  # 2-byte characters: 191 / 192 bytes
        ("😀" * 47 + "abc", "😀" * 48),  # 4-byte characters: 191 / 192 bytes
        ("名" * 63 + "ab", "名" * 64),  # 3-byte characters: 191 / 192 bytes
    ],
)
def test_name_bound_counts_utf8_bytes(accepted: str, rejected: str) -> None:
    assert len(accepted.encode()) == 191
    assert len(rejected.encode()) == 192
    QueueOptions(name=accepted)
    queue(accepted, version=1)
    assert_names(config_error(lambda: QueueOptions(name=rejected)), "queue name", "192 bytes", "1..191")
    assert_names(config_error(lambda: queue(rejected, version=1)), "queue name", "192 bytes", "1..191")


def test_empty_or_non_string_name_is_rejected() -> None:
    assert_names(config_error(lambda: QueueOptions(name="")), "queue name", "0 bytes", "1..191")
    assert_names(config_error(lambda: queue("", version=1)), "queue name", "0 bytes")
    assert_names(config_error(lambda: QueueOptions(name=b"q")), "queue name", "bytes")  # type: ignore[arg-type]


# -- registrations: duplicates, content kind, version, async -----------------------------------


def test_duplicate_queue_version_content_is_rejected() -> None:
    first = queue("orders", version=3, content="json", handler_id="first")(new_handler())
    second = queue("orders", version=3, content="json", handler_id="second")(new_handler())
    error = plan_error(first, second)
    assert_names(error, "'orders'", "version 3", "'json'", "'first'", "'second'")


def test_same_queue_and_version_with_other_content_is_accepted() -> None:
    handler = routed({"version": 3, "content": "json"}, {"version": 3, "content": "text"})
    plan = build(handler)
    assert set(plan.routes["q"][3]) == {"json", "text"}


def test_stacking_the_same_route_twice_is_rejected() -> None:
    error = plan_error(routed({"version": 1}, {"version": 1}))
    assert_names(error, "'q'", "version 1", "'json'", "already served")


def test_duplicate_handler_id_is_rejected() -> None:
    first = queue("a", version=1, handler_id="orders-v1")(new_handler())
    second = queue("b", version=1, handler_id="orders-v1")(new_handler())
    error = plan_error(first, second)
    assert_names(error, "handler_id", "'orders-v1'", "unique")


def test_default_handler_id_names_queue_version_content_and_function() -> None:
    async def on_order() -> None:
        return None

    plan = build(queue("orders", version=2, content="text")(on_order))
    assert plan.handlers[0].handler_id == f"orders/v2/text/{on_order.__qualname__}"


def test_empty_handler_id_is_rejected() -> None:
    assert_names(config_error(lambda: queue("q", version=1, handler_id="")), "handler_id")


@pytest.mark.parametrize("content", ["json", "text", "binary", "a", "x.y+z-1_2", "0" + "a" * 63])
def test_canonical_content_kinds_are_accepted(content: str) -> None:
    assert len(content.encode()) <= CONTENT_KIND_MAX
    plan = build(routed({"content": content}))
    assert plan.handlers[0].content == content


@pytest.mark.parametrize(
    ("content", "parts"),
    [
        ("a" * 65, ("content", "65 bytes", "64")),
        ("", ("content", "empty")),
        ("JSON", ("content", "JSON")),
        ("application/json", ("content", "application/json")),
        ("-json", ("content", "-json")),
        (".json", ("content", ".json")),
        ("json ", ("content", "json")),
        ("jsön", ("content",)),
    ],
)
def test_non_canonical_content_kinds_are_rejected(content: str, parts: tuple[str, ...]) -> None:
    assert_names(config_error(lambda: queue("q", version=1, content=content)), *parts)


def test_version_bounds() -> None:
    plan = build(routed({"version": 1}, {"version": VERSION_MAX}))
    assert set(plan.routes["q"]) == {1, 65535}
    assert_names(config_error(lambda: queue("q", version=65536)), "version", "65536", "1..65535")
    assert_names(config_error(lambda: queue("q", version=0)), "version", "0", "1..65535")
    assert_names(config_error(lambda: queue("q", version=True)), "version", "bool", "1..65535")
    assert_names(config_error(lambda: queue("q", version="1")), "version", "str", "1..65535")  # type: ignore[arg-type]


def test_non_async_handler_is_rejected() -> None:
    def sync_handler() -> None:
        return None

    async def generator_handler() -> Any:
        yield None

    for fn in (sync_handler, generator_handler):
        error = config_error(lambda fn=fn: queue("q", version=1)(fn))  # type: ignore[misc]
        assert_names(error, "async def")


def test_callable_object_with_async_call_is_accepted() -> None:
    class Handler:
        async def __call__(self, event_id: EventId) -> None:
            return None

    plan = build(queue("q", version=1)(Handler()))
    assert [p.name for p in plan.handlers[0].parameters] == ["event_id"]


# -- dispatch -----------------------------------------------------------------------------


def _dispatch_plan() -> Plan:
    return build(routed({"name": "orders", "version": 1, "content": "json"}, {"name": "orders", "version": 2}))


def test_dispatch_finds_the_handler() -> None:
    found = dispatch(_dispatch_plan(), "orders", 2, "json")
    assert isinstance(found, HandlerRoute)
    assert (found.queue, found.version, found.content) == ("orders", 2, "json")


def test_dispatch_unknown_version() -> None:
    assert dispatch(_dispatch_plan(), "orders", 3, "json") == SCHEMA_VERSION_UNSUPPORTED
    assert dispatch(_dispatch_plan(), "other", 1, "json") == SCHEMA_VERSION_UNSUPPORTED


def test_dispatch_known_version_other_content() -> None:
    assert dispatch(_dispatch_plan(), "orders", 1, "text") == CONTENT_KIND_UNSUPPORTED


# -- extractors ---------------------------------------------------------------------------


def json_handler() -> Handler:
    async def handler(order: Json[Order]) -> None:
        return None

    return handler


def text_handler() -> Handler:
    async def handler(body: Text) -> None:
        return None

    return handler


def bytes_handler() -> Handler:
    async def handler(body: Bytes) -> None:
        return None

    return handler


def test_json_decodes_and_validates_with_pydantic() -> None:
    extractor = terminal_extractor(queue("q", version=1)(json_handler()))
    order = extractor.extract(delivery(b'{"order_id": 7, "lines": ["a", "b"]}'))
    assert order == Order(order_id=7, lines=["a", "b"])
    # pydantic's lax mode coerces a numeric string for an int field.
    assert extractor.extract(delivery(b'{"order_id": "8", "lines": []}')) == Order(order_id=8, lines=[])


@pytest.mark.parametrize("body", [b"", b"{", b"{'order_id': 1}", b"\xff\xfe", b'{"order_id": 1,}', b"nul"])
def test_json_broken_body_raises_payload_decode_error(body: bytes) -> None:
    extractor = terminal_extractor(queue("q", version=1)(json_handler()))
    with pytest.raises(PayloadDecodeError, match="not valid JSON"):
        extractor.extract(delivery(body))


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (b'{"lines": []}', "order_id"),
        (b'{"order_id": "x", "lines": []}', "order_id"),
        (b'{"order_id": 1, "lines": [1]}', "lines.0"),
        (b"[]", "<root>"),
    ],
)
def test_json_validation_error_raises_payload_decode_error(body: bytes, where: str) -> None:
    extractor = terminal_extractor(queue("q", version=1)(json_handler()))
    with pytest.raises(PayloadDecodeError) as info:
        extractor.extract(delivery(body))
    assert "validation error" in str(info.value)
    assert where in str(info.value)


def test_json_of_a_plain_type() -> None:
    async def handler(numbers: Json[list[int]]) -> None:
        return None

    extractor = terminal_extractor(queue("q", version=1)(handler))
    assert extractor.extract(delivery(b"[1, 2, 3]")) == [1, 2, 3]
    with pytest.raises(PayloadDecodeError):
        extractor.extract(delivery(b'{"a": 1}'))


def test_text_requires_utf8() -> None:
    extractor = terminal_extractor(queue("q", version=1, content="text")(text_handler()))
    assert extractor.extract(delivery("héllo 😀".encode())) == "héllo 😀"
    assert extractor.extract(delivery(b"")) == ""
    with pytest.raises(PayloadDecodeError, match="not UTF-8") as info:
        extractor.extract(delivery(b"ok \xff"))
    assert "byte 3" in str(info.value)
    with pytest.raises(PayloadDecodeError, match="not UTF-8"):
        extractor.extract(delivery("x".encode("utf-16")))


def test_bytes_passes_the_body_through() -> None:
    extractor = terminal_extractor(queue("q", version=1, content="binary")(bytes_handler()))
    assert extractor.extract(delivery(b"\x00\xff raw")) == b"\x00\xff raw"


def test_metadata_extractors_read_the_envelope_and_delivery() -> None:
    async def handler(event_id: EventId, retries: RetryCount, redelivered: Redelivered, raw: RawDelivery) -> None:
        return None

    plan = build(queue("q", version=1)(handler))
    raw = delivery(b"{}")
    values = {p.name: p.extractor.extract(raw) for p in plan.handlers[0].parameters if p.extractor is not None}
    assert values == {
        "event_id": uuid.UUID("0f8fad5b-d9cb-469f-a165-70867728950e"),
        "retries": 0,
        "redelivered": False,
        "raw": raw,
    }
    assert plan.handlers[0].terminal is None


def test_raw_delivery_is_read_only() -> None:
    raw = delivery(b"{}")
    with pytest.raises(AttributeError):
        raw.body = b"changed"  # type: ignore[misc]
    assert not hasattr(raw, "ack")
    assert not hasattr(raw, "channel")
