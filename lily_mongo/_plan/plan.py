"""Registration and the consumer plan: every bound (docs/configuration.md) checked once.

``@queue(...)`` records a handler route on the function; ``Consumer.include``
and ``Consumer.configure_queue`` feed a :class:`PlanBuilder`; ``build()``
checks the whole plan and returns an immutable :class:`Plan` with the
dispatch table the engine reads on every delivery. Pure: no I/O. The queues' options
are :mod:`.options`, the registrations :mod:`.routes`, the parameters :mod:`.parameters`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from .._errors import PlanError
from .._text import describe_value
from ..bounds import BOUNDS, utf8_len
from .batch import BatchExtractor, check_batch_queue, default_batch_prefetch
from .options import QueueOptions
from .parameters import Resolved, resolve_handler
from .routes import Guarantee, Guard, HandlerRoute, Middleware, RouteSpec, routes_of

__all__ = ["Plan", "PlanBuilder"]


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
        queues = _queues_of(self.queue_options, handlers)
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
        _check_batch(spec, resolved, where)
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
            batch=spec.batch,
        )


def _queues_of(configured: Mapping[str, QueueOptions], handlers: list[HandlerRoute]) -> dict[str, QueueOptions]:
    """Every queue's options: as configured, else the defaults; a batch handler's queue must let a batch fill."""
    queues = dict(configured)
    for handler in handlers:
        if handler.batch is not None and handler.queue not in queues:
            # Not configured: room for a batch running and one forming (docs/configuration.md).
            queues[handler.queue] = QueueOptions(name=handler.queue, prefetch=default_batch_prefetch(handler.batch))
        queues.setdefault(handler.queue, QueueOptions(name=handler.queue))
    for handler in handlers:
        if handler.batch is not None:
            check_batch_queue(queues[handler.queue], handler.batch, f"handler {handler.handler_id[:80]!r}")
    return queues


def _check_batch(spec: RouteSpec, resolved: Resolved, where: str) -> None:
    """A batch handler takes its body as ``Batch[...]`` and reads every event's own values from its entries
    (docs/handlers.md, "Batch handlers"); a ``Batch[...]`` parameter needs ``@queue(..., batch=...)``."""
    takes_batch = resolved.terminal is not None and isinstance(resolved.terminal.extractor, BatchExtractor)
    if spec.batch is None:
        if takes_batch:
            raise PlanError(f"{where}: a Batch[...] parameter needs @queue(..., batch=BatchOptions(...))")
        return
    if not takes_batch:
        raise PlanError(
            f"{where}: @queue(..., batch=...) needs a body parameter Batch[Json[T]] (or Batch[Text], Batch[Bytes])"
        )
    every = [*resolved.parameters, *(p for d in resolved.dependencies for p in d.parameters)]
    for p in every:
        if p.extractor is not None and not isinstance(p.extractor, BatchExtractor):
            raise PlanError(
                f"{where}: parameter {p.name!r} reads one delivery ({type(p.extractor).__name__}), but a batch "
                "handler is called with many: read each event's id, retry count, body and delivery from its "
                "Batch entries"
            )
