"""Handler registrations: ``@queue(...)`` marks a function with its routes; a route in the plan is a
:class:`HandlerRoute`; middleware and guards see a :class:`DeliveryContext` (docs/handlers.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from .._checks import check_int
from .._errors import ConfigError
from .._text import describe_value
from ..bounds import BOUNDS
from ..envelope import Envelope, check_content_kind
from .batch import BatchOptions, check_batch_options
from .extractors import RawDelivery
from .options import LONGEST_SUFFIX, check_name
from .parameters import Dependency, Parameter, is_coroutine_function

__all__ = ["DeliveryContext", "Guarantee", "Guard", "HandlerRoute", "Middleware", "RouteSpec", "queue", "routes_of"]


F = TypeVar("F", bound=Callable[..., Awaitable[None]])


Guarantee = Literal["at_least_once", "inbox"]


Middleware = Callable[["DeliveryContext", Callable[[], Awaitable[None]]], Awaitable[None]]
"""``async def mw(ctx, call_next) -> None``: wraps the rest of the pipeline."""


Guard = Callable[["DeliveryContext"], Awaitable[bool | None]]
"""``async def guard(ctx) -> bool | None``: a pre-handler check. Raise QueueHandlerError to refuse
with your own code, or return False to refuse with permanent ``QUEUE_GUARD_REJECTED``."""


_HANDLER_ATTR = "__lily_routes__"


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
    batch: BatchOptions | None = None


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
    batch: BatchOptions | None = None,
) -> Callable[[F], F]:
    """Register an ``async def`` handler for (physical queue, schema version, content kind).

    ``handler_id`` is the stable identity the inbox deduplicates on (default:
    ``<queue>/v<version>/<content>/<function qualname>``); renaming it starts a
    new dedup history. ``guarantee`` is ``"inbox"`` (default when the consumer
    has a Mongo client) or ``"at_least_once"``. The decorator may be stacked to
    serve several versions with one function. ``batch`` makes it a batch handler, whose body
    parameter is ``Batch[...]`` (docs/handlers.md, "Batch handlers").
    """
    check_name("queue name", name, suffix_bytes=LONGEST_SUFFIX)
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
    spec = RouteSpec(
        name,
        version,
        content,
        handler_id,
        guarantee,
        tuple(middleware),
        tuple(guards),
        trace,
        check_batch_options(batch),
    )

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
    # A batch handler's batches (docs/handlers.md, "Batch handlers"); None for a handler of one delivery.
    batch: BatchOptions | None = None
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
