"""Registration and the consumer plan: every bound (docs/configuration.md) checked once.

``@queue(...)`` records a handler route on the function; ``Consumer.include``
and ``Consumer.configure_queue`` feed a :class:`PlanBuilder`; ``build()``
checks the whole plan and returns an immutable :class:`Plan` with the
dispatch table the runtime reads on every delivery. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from .._checks import check_int, check_seconds
from .._errors import ConfigError, PlanError
from .._text import describe_value
from ..bounds import BOUNDS, utf8_len
from ..envelope import Envelope, check_content_kind
from .extractors import Dependency, Parameter, RawDelivery, is_coroutine_function, resolve_handler

__all__ = [
    "DeliveryContext",
    "Guarantee",
    "Guard",
    "HandlerRoute",
    "Middleware",
    "Plan",
    "PlanBuilder",
    "QueueOptions",
    "RetryPolicy",
    "queue",
]

F = TypeVar("F", bound=Callable[..., Awaitable[None]])
Guarantee = Literal["at_least_once", "inbox"]
QueueType = Literal["classic", "quorum"]
Middleware = Callable[["DeliveryContext", Callable[[], Awaitable[None]]], Awaitable[None]]
"""``async def mw(ctx, call_next) -> None``: wraps the rest of the pipeline."""
Guard = Callable[["DeliveryContext"], Awaitable[bool | None]]
"""``async def guard(ctx) -> bool | None``: a pre-handler check. Raise QueueHandlerError to refuse
with your own code, or return False to refuse with permanent ``QUEUE_GUARD_REJECTED``."""

_HANDLER_ATTR = "__lily_routes__"
# Longest derived name: "<queue>.retry.<31>" (docs/settlement.md section 8, topology).
_LONGEST_SUFFIX = max(len(f".retry.{BOUNDS.retry_buckets_per_queue - 1}"), len(".dlq"))
_MAX_DELAY_SECONDS = 7 * 24 * 3600.0


def _check_seconds(field_name: str, value: object, *, low: float = 0.0, high: float = _MAX_DELAY_SECONDS) -> float:
    """Seconds above ``low`` (exclusive) up to ``high``: every duration in a plan."""
    return check_seconds(field_name, value, low=low, high=high, low_inclusive=False)


def check_name(field_name: str, name: object, *, suffix_bytes: int = 0) -> str:
    """A queue/exchange/routing name: 1..200 UTF-8 bytes, derived names included."""
    if not isinstance(name, str):
        raise ConfigError(f"{field_name} must be a string, got {describe_value(name)}")
    size = utf8_len(name)
    limit = BOUNDS.name_max_bytes - suffix_bytes
    if not BOUNDS.name_min_bytes <= size <= limit:
        extra = f" (leaving {suffix_bytes} bytes for derived names)" if suffix_bytes else ""
        raise ConfigError(f"{field_name} {name[:40]!r} is {size} bytes, outside 1..{limit} bytes{extra}")
    return name


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Application retries through delay buckets.

    Retry ``n`` (0-based) waits ``delays[min(n, len(delays) - 1)]`` seconds in a
    retry bucket; each distinct delay is one bucket (``<queue>.retry.<i>``).
    """

    max_retries: int = 5
    delays: tuple[float, ...] = (1.0, 5.0, 30.0, 120.0, 600.0)

    def __post_init__(self) -> None:
        check_int("RetryPolicy.max_retries", self.max_retries, 0, BOUNDS.max_retries)
        delays = tuple(self.delays) if isinstance(self.delays, Sequence) else self.delays
        if not isinstance(delays, tuple) or (self.max_retries > 0 and not delays):
            raise ConfigError(f"RetryPolicy.delays must be a non-empty sequence of seconds, got {self.delays!r:.60}")
        for i, delay in enumerate(delays):
            _check_seconds(f"RetryPolicy.delays[{i}]", delay, low=0.0)
            if round(delay * 1000) < 1:
                raise ConfigError(f"RetryPolicy.delays[{i}] must be at least 0.001 seconds, got {delay!r}")
        object.__setattr__(self, "delays", tuple(float(d) for d in delays))
        if len(self.bucket_delays_ms) > BOUNDS.retry_buckets_per_queue:
            raise ConfigError(
                f"RetryPolicy.delays has {len(self.bucket_delays_ms)} distinct delays, "
                f"over the bound of {BOUNDS.retry_buckets_per_queue} buckets per queue"
            )

    @property
    def bucket_delays_ms(self) -> tuple[int, ...]:
        """Distinct delays in milliseconds, in first-use order; bucket ``i`` has delay ``[i]``."""
        if self.max_retries == 0:
            return ()
        used = [round(self.delays[min(n, len(self.delays) - 1)] * 1000) for n in range(self.max_retries)]
        return tuple(dict.fromkeys(used))

    def bucket_for(self, retry: int) -> int:
        """Index of the bucket that holds retry ``retry`` (0-based)."""
        delay = round(self.delays[min(retry, len(self.delays) - 1)] * 1000)
        return self.bucket_delays_ms.index(delay)


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueOptions:
    """Per physical queue settings; bounds checked at construction."""

    name: str
    concurrency: int = 8
    prefetch: int = 64
    buffer: int | None = None
    max_body: int = BOUNDS.queue_body_default
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    queue_type: QueueType = "classic"
    deadline: float = 60.0
    cooperation_window: float = 5.0
    max_deferrals: int = 20
    max_handoff_failures: int = 5
    passive: bool = False
    unknown_errors: Literal["retryable", "permanent"] = "retryable"
    ack_delay: float = 0.001

    def __post_init__(self) -> None:
        where = f"queue {self.name!r:.60}"
        check_name("queue name", self.name, suffix_bytes=_LONGEST_SUFFIX)
        check_int(f"{where}: concurrency", self.concurrency, BOUNDS.concurrency_min, BOUNDS.concurrency_max)
        check_int(f"{where}: prefetch", self.prefetch, 1, BOUNDS.prefetch_max)
        if self.buffer is None:
            object.__setattr__(self, "buffer", self.prefetch)
        check_int(f"{where}: buffer", self.buffer, 0, self.prefetch)
        check_int(f"{where}: max_body", self.max_body, 1, BOUNDS.queue_body_max)
        if not isinstance(self.retry, RetryPolicy):
            raise ConfigError(f"{where}: retry must be a RetryPolicy, got {type(self.retry).__name__}")
        if self.queue_type not in ("classic", "quorum"):
            raise ConfigError(f"{where}: queue_type must be 'classic' or 'quorum', got {self.queue_type!r:.40}")
        _check_seconds(f"{where}: deadline", self.deadline, high=24 * 3600.0)
        _check_seconds(f"{where}: cooperation_window", self.cooperation_window, high=3600.0)
        check_int(f"{where}: max_deferrals", self.max_deferrals, 1, 10_000)
        check_int(f"{where}: max_handoff_failures", self.max_handoff_failures, 1, 1000)
        if self.unknown_errors not in ("retryable", "permanent"):
            raise ConfigError(
                f"{where}: unknown_errors must be 'retryable' or 'permanent', got {describe_value(self.unknown_errors)}"
            )
        if not isinstance(self.passive, bool):
            raise ConfigError(f"{where}: passive must be True or False, got {describe_value(self.passive)}")
        check_seconds(f"{where}: ack_delay", self.ack_delay, low=0.0, high=BOUNDS.ack_delay_max)

    @property
    def effective_prefetch(self) -> int:
        """Unacked deliveries the broker may push: never more than running plus buffered."""
        assert self.buffer is not None
        return min(self.prefetch, self.concurrency + self.buffer)

    def bucket_name(self, index: int) -> str:
        return f"{self.name}.retry.{index}"

    @property
    def dlq_name(self) -> str:
        return f"{self.name}.dlq"


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """What ``@queue`` records on a function."""

    queue: str
    version: int
    content: str
    handler_id: str | None
    guarantee: Guarantee | None
    middleware: tuple[Middleware, ...]
    guards: tuple[Guard, ...]
    trace: str | None


def queue(
    name: str,
    *,
    version: int,
    content: str = "json",
    handler_id: str | None = None,
    guarantee: Guarantee | None = None,
    middleware: Sequence[Middleware] = (),
    guards: Sequence[Guard] = (),
    trace: str | None = None,
) -> Callable[[F], F]:
    """Register an ``async def`` handler for (physical queue, schema version, content kind).

    ``handler_id`` is the stable identity the inbox deduplicates on (default:
    ``<queue>/v<version>/<content>/<function qualname>``); renaming it starts a
    new dedup history. ``guarantee`` is ``"inbox"`` (default when the consumer
    has a Mongo client) or ``"at_least_once"``. The decorator may be stacked to
    serve several versions with one function.
    """
    check_name("queue name", name, suffix_bytes=_LONGEST_SUFFIX)
    check_int("version", version, BOUNDS.schema_version_min, BOUNDS.schema_version_max)
    problem = check_content_kind(content)
    if problem is not None:
        raise ConfigError(f"content {problem}")
    if guarantee not in (None, "at_least_once", "inbox"):
        raise ConfigError(f"guarantee must be 'at_least_once' or 'inbox', got {guarantee!r:.40}")
    if handler_id is not None and (not isinstance(handler_id, str) or not handler_id):
        raise ConfigError(f"handler_id must be a non-empty string, got {describe_value(handler_id)}")
    if trace is not None and (not isinstance(trace, str) or not trace):
        raise ConfigError(f"trace must be a non-empty string, got {describe_value(trace)}")
    for field_name, hooks in (("middleware", middleware), ("guards", guards)):
        if isinstance(hooks, str) or not isinstance(hooks, Sequence) or not all(callable(h) for h in hooks):
            raise ConfigError(f"{field_name} must be a sequence of async callables, got {describe_value(hooks)}")
    spec = RouteSpec(name, version, content, handler_id, guarantee, tuple(middleware), tuple(guards), trace)

    def decorate(fn: F) -> F:
        if not is_coroutine_function(fn):
            raise ConfigError(f"@queue({name!r}) needs an async def handler, got {describe_value(fn)}")
        routes: list[RouteSpec] = list(getattr(fn, _HANDLER_ATTR, ()))
        routes.append(spec)
        setattr(fn, _HANDLER_ATTR, tuple(routes))
        return fn

    return decorate


def routes_of(fn: object) -> tuple[RouteSpec, ...]:
    """The ``@queue`` routes recorded on ``fn`` (empty when it was never decorated)."""
    return tuple(getattr(fn, _HANDLER_ATTR, ()))


@dataclass(frozen=True, slots=True)
class HandlerRoute:
    """One linked handler: a route, its function, its resolved parameters and the factories they need."""

    queue: str
    version: int
    content: str
    handler_id: str
    guarantee: Guarantee
    fn: Callable[..., Awaitable[None]]
    parameters: tuple[Parameter, ...]
    middleware: tuple[Middleware, ...]
    guards: tuple[Guard, ...]
    trace: str
    # Depends factories, each once, in the order an attempt calls them (docs/handlers.md).
    dependencies: tuple[Dependency, ...] = ()
    # (name, where) of every Resource the handler or its factories ask for: checked at start.
    resources: tuple[tuple[str, str], ...] = ()
    # The body-decoding parameter (the handler's or a factory's), found once at plan time, not per delivery.
    terminal: Parameter | None = dataclasses.field(init=False, repr=False, compare=False)
    # True when an attempt needs more than the delivery and the scope: factories, resources, the database.
    injects: bool = dataclasses.field(init=False, repr=False, compare=False)
    # True for the plain path: no middleware, no guards, nothing injected (dispatch.invoke's first branch).
    direct: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        every = [*self.parameters, *(p for d in self.dependencies for p in d.parameters)]
        terminal = next((p for p in every if p.extractor is not None and p.extractor.terminal), None)
        injects = bool(self.dependencies) or any(p.source in ("database", "resource") for p in self.parameters)
        object.__setattr__(self, "terminal", terminal)
        object.__setattr__(self, "injects", injects)
        object.__setattr__(self, "direct", not (injects or self.middleware or self.guards))


@dataclass(slots=True)
class DeliveryContext:
    """What middleware and guards see for one attempt: read-only delivery data plus a scratch dict."""

    queue: str
    handler: HandlerRoute
    delivery: RawDelivery
    attempt: int
    items: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def envelope(self) -> Envelope:
        return self.delivery.envelope


@dataclass(frozen=True, slots=True)
class Plan:
    """The checked, immutable plan: queue options and the dispatch table."""

    name: str
    queues: Mapping[str, QueueOptions]
    routes: Mapping[str, Mapping[int, Mapping[str, HandlerRoute]]]
    handlers: tuple[HandlerRoute, ...]
    middleware: tuple[Middleware, ...]
    guards: tuple[Guard, ...]


@dataclass
class PlanBuilder:
    """Collects registrations; :meth:`build` checks them all against every bound (docs/configuration.md)."""

    name: str
    has_mongo: bool
    queue_options: dict[str, QueueOptions] = field(default_factory=dict)
    functions: list[Callable[..., Awaitable[None]]] = field(default_factory=list)
    middleware: list[Middleware] = field(default_factory=list)
    guards: list[Guard] = field(default_factory=list)

    def configure_queue(self, options: QueueOptions) -> None:
        self.queue_options[options.name] = options

    def include(self, fn: Callable[..., Awaitable[None]]) -> None:
        if not routes_of(fn):
            raise PlanError(f"{describe_value(fn)} has no @queue(...) registration")
        if fn not in self.functions:
            self.functions.append(fn)

    def build(self, scope_type: type) -> Plan:
        name_bytes = utf8_len(self.name) if isinstance(self.name, str) else 0
        if not 1 <= name_bytes <= BOUNDS.consumer_descriptor_bytes:
            raise PlanError(
                f"consumer name must be 1..{BOUNDS.consumer_descriptor_bytes} bytes, got {describe_value(self.name)}"
            )
        handlers: list[HandlerRoute] = []
        for fn in self.functions:
            for spec in routes_of(fn):
                handlers.append(self._link(fn, spec, scope_type))
        if not handlers:
            raise PlanError("the consumer has no handlers; include at least one @queue handler")
        if len(handlers) > BOUNDS.linked_handlers:
            raise PlanError(f"{len(handlers)} linked handlers, over the bound of {BOUNDS.linked_handlers}")
        queues = dict(self.queue_options)
        for handler in handlers:
            queues.setdefault(handler.queue, QueueOptions(name=handler.queue))
        unused = [q for q in self.queue_options if not any(h.queue == q for h in handlers)]
        if unused:
            raise PlanError(f"configured queue {unused[0]!r:.60} has no handler")
        if len(queues) > BOUNDS.physical_queues:
            raise PlanError(f"{len(queues)} physical queues, over the bound of {BOUNDS.physical_queues}")
        total_buckets = sum(len(q.retry.bucket_delays_ms) for q in queues.values())
        if total_buckets > BOUNDS.retry_buckets_total:
            raise PlanError(
                f"{total_buckets} retry buckets in the topology, over the bound of {BOUNDS.retry_buckets_total}"
            )
        routes: dict[str, dict[int, dict[str, HandlerRoute]]] = {}
        ids: dict[str, HandlerRoute] = {}
        traces: set[str] = set()
        plan_bytes = name_bytes
        for handler in handlers:
            by_content = routes.setdefault(handler.queue, {}).setdefault(handler.version, {})
            if handler.content in by_content:
                raise PlanError(
                    f"handler {handler.handler_id!r}: (queue {handler.queue!r}, version {handler.version}, "
                    f"content {handler.content!r}) is already served by {by_content[handler.content].handler_id!r}"
                )
            by_content[handler.content] = handler
            if handler.handler_id in ids:
                raise PlanError(f"handler_id {handler.handler_id!r} is used by two handlers; ids must be unique")
            ids[handler.handler_id] = handler
            traces.add(handler.trace)
            plan_bytes += self._descriptor_bytes(handler)
        if len(traces) > BOUNDS.trace_cells:
            raise PlanError(f"{len(traces)} trace cells, over the bound of {BOUNDS.trace_cells}")
        if plan_bytes > BOUNDS.aggregate_plan_bytes:
            raise PlanError(f"the plan is {plan_bytes} bytes, over the bound of {BOUNDS.aggregate_plan_bytes} bytes")
        return Plan(self.name, queues, routes, tuple(handlers), tuple(self.middleware), tuple(self.guards))

    def _descriptor_bytes(self, handler: HandlerRoute) -> int:
        size = (
            sum(
                utf8_len(part)
                for part in (
                    handler.handler_id,
                    handler.queue,
                    handler.content,
                    handler.trace,
                    *(p.name for p in handler.parameters),
                )
            )
            + 16
        )
        if size > BOUNDS.consumer_descriptor_bytes:
            raise PlanError(
                f"handler {handler.handler_id[:60]!r}: descriptor is {size} bytes, "
                f"over the bound of {BOUNDS.consumer_descriptor_bytes} bytes"
            )
        return size

    def _link(self, fn: Callable[..., Awaitable[None]], spec: RouteSpec, scope_type: type) -> HandlerRoute:
        qualname = getattr(fn, "__qualname__", type(fn).__name__)
        handler_id = spec.handler_id or f"{spec.queue}/v{spec.version}/{spec.content}/{qualname}"
        where = f"handler {handler_id[:80]!r}"
        middleware = (*self.middleware, *spec.middleware)
        guards = (*self.guards, *spec.guards)
        if len(middleware) > BOUNDS.middleware:
            raise PlanError(f"{where}: {len(middleware)} middleware, over the bound of {BOUNDS.middleware}")
        if len(guards) > BOUNDS.guards:
            raise PlanError(f"{where}: {len(guards)} guards, over the bound of {BOUNDS.guards}")
        resolved = resolve_handler(fn, where=where, scope_type=scope_type, max_parameters=BOUNDS.handler_parameters)
        guarantee: Guarantee = spec.guarantee or ("inbox" if self.has_mongo else "at_least_once")
        if guarantee == "inbox" and not self.has_mongo:
            raise PlanError(f"{where}: guarantee 'inbox' needs a Consumer with a mongo_client")
        if resolved.scope and guarantee != "inbox":
            raise PlanError(
                f"{resolved.scope[0]}: a MongoScope parameter needs guarantee 'inbox' "
                "(an at-least-once handler reaches the database through MongoDatabase)"
            )
        if resolved.database and not self.has_mongo:
            raise PlanError(f"{resolved.database[0]}: a MongoDatabase parameter needs a Consumer with a mongo_client")
        return HandlerRoute(
            queue=spec.queue,
            version=spec.version,
            content=spec.content,
            handler_id=handler_id,
            guarantee=guarantee,
            fn=fn,
            parameters=resolved.parameters,
            middleware=middleware,
            guards=guards,
            trace=spec.trace or spec.queue,
            dependencies=resolved.dependencies,
            resources=resolved.resources,
        )
