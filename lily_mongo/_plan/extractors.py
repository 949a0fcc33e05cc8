"""Handler parameters: what a handler can ask for, resolved once at plan time.

A handler declares what it needs through annotations::

    async def on_order(order: Json[Order], event_id: EventId, mongo: MongoScope) -> None

``Json[T]``, ``Text`` and ``Bytes`` are *terminal* extractors: they decode the
body, and a handler has at most one. The rest read bounded metadata. An
application adds its own with ``Annotated[T, MyExtractor()]`` where
``MyExtractor`` subclasses :class:`Extractor`.

Beyond the delivery, a handler may ask for what the consumer supplies per
attempt (docs/handlers.md): ``MongoDatabase`` (the consumer's database, for every
guarantee), ``Annotated[T, Resource("name")]`` (what the consumer's lifespan
yielded) and ``Annotated[T, Depends(factory)]`` (what ``factory`` returns or
yields for the attempt; its own parameters are resolved the same way). All of it
is resolved here, once, at plan time: :func:`resolve_handler` returns the
handler's parameters and its factories in the order an attempt calls them, and
a handler that asks for none of it is called exactly as before.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import typing
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import orjson
import pydantic

from .._errors import ConfigError, PlanError
from .._fast import slot_constructor
from .._text import describe_value

if TYPE_CHECKING:
    from pymongo.asynchronous.database import AsyncDatabase

    from ..envelope import Envelope

__all__ = [
    "Bytes",
    "Dependency",
    "Depends",
    "EventId",
    "Extractor",
    "Json",
    "MongoDatabase",
    "Parameter",
    "RawDelivery",
    "Redelivered",
    "Resolved",
    "Resource",
    "RetryCount",
    "Text",
    "resolve_handler",
]

T = TypeVar("T")


NOT_DECODED: Any = object()
"""Marks a payload that has not been decoded yet (the handler's extractor decodes it)."""


class PayloadDecodeError(Exception):
    """A terminal extractor could not decode the body (mapped to QUEUE_PAYLOAD_DECODE_FAILED)."""


@dataclass(frozen=True, slots=True)
class RawDelivery:
    """A read-only view of one delivery: metadata and body, never a channel or an ACK handle."""

    queue: str
    headers: Mapping[str, Any]
    body: bytes
    content_type: str | None
    redelivered: bool
    envelope: Envelope
    routing_key: str
    exchange: str

    def __repr__(self) -> str:
        return f"<RawDelivery queue={self.queue!r} body={len(self.body)} bytes>"


new_raw_delivery = slot_constructor(RawDelivery)
"""``RawDelivery(...)`` for the per-delivery path, positional (see _fast.py for why)."""


class Extractor:
    """Base class for parameter extractors; subclass it for application extractors.

    Set ``terminal = True`` when the extractor decodes the body: its failures
    become permanent ``QUEUE_PAYLOAD_DECODE_FAILED`` rejections.
    """

    terminal: bool = False

    def bind(self, annotation: Any) -> Extractor:
        """Called once at plan time with the parameter's base type; return the bound extractor."""
        return self

    def extract(self, delivery: RawDelivery) -> Any:
        """Produce the argument for one delivery."""
        raise NotImplementedError

    def payload_schema(self, ref_template: str) -> dict[str, Any]:
        """JSON Schema of the body a terminal extractor accepts (for the AsyncAPI document)."""
        return {}


class _JsonExtractor(Extractor):
    terminal = True

    def __init__(self, adapter: pydantic.TypeAdapter[Any] | None = None) -> None:
        self._adapter = adapter

    def bind(self, annotation: Any) -> Extractor:
        try:
            return _JsonExtractor(pydantic.TypeAdapter(annotation))
        except pydantic.PydanticSchemaGenerationError as exc:
            raise PlanError(f"Json[{annotation!r}] has no pydantic schema: {exc}") from exc

    def payload_schema(self, ref_template: str) -> dict[str, Any]:
        assert self._adapter is not None
        schema: dict[str, Any] = self._adapter.json_schema(ref_template=ref_template)
        return schema

    def extract(self, delivery: RawDelivery) -> Any:
        assert self._adapter is not None
        try:
            return self._adapter.validate_python(orjson.loads(delivery.body))
        except orjson.JSONDecodeError as exc:
            raise PayloadDecodeError(f"body is not valid JSON: {exc.msg} at position {exc.pos}") from None
        except pydantic.ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[:3]
            where = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in first)
            raise PayloadDecodeError(f"{exc.error_count()} validation error(s): {where}") from None


class _TextExtractor(Extractor):
    terminal = True

    def payload_schema(self, ref_template: str) -> dict[str, Any]:
        return {"type": "string"}

    def extract(self, delivery: RawDelivery) -> str:
        try:
            return delivery.body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PayloadDecodeError(f"body is not UTF-8 (byte {exc.start})") from None


class _BytesExtractor(Extractor):
    terminal = True

    def payload_schema(self, ref_template: str) -> dict[str, Any]:
        return {"type": "string", "format": "binary"}

    def extract(self, delivery: RawDelivery) -> bytes:
        return delivery.body


class _EventIdExtractor(Extractor):
    def extract(self, delivery: RawDelivery) -> uuid.UUID:
        return delivery.envelope.event_id


class _RetryCountExtractor(Extractor):
    def extract(self, delivery: RawDelivery) -> int:
        return delivery.envelope.retry_count


class _RedeliveredExtractor(Extractor):
    def extract(self, delivery: RawDelivery) -> bool:
        return delivery.redelivered


class _RawDeliveryExtractor(Extractor):
    def extract(self, delivery: RawDelivery) -> RawDelivery:
        return delivery


Json = Annotated[T, _JsonExtractor()]
"""``Json[Model]``: the body decoded with orjson and validated by pydantic."""
Text = Annotated[str, _TextExtractor()]
"""The body decoded as UTF-8."""
Bytes = Annotated[bytes, _BytesExtractor()]
"""The raw body."""
EventId = Annotated[uuid.UUID, _EventIdExtractor()]
"""The event id (preserved across retries, DLQ and replays)."""
RetryCount = Annotated[int, _RetryCountExtractor()]
"""The framework's application retry count (``x-retry-count``)."""
Redelivered = Annotated[bool, _RedeliveredExtractor()]
"""The broker's ``redelivered`` flag: says nothing about an earlier commit."""


class _MongoDatabaseMark:
    """Marks the ``MongoDatabase`` parameter: the consumer's database, supplied per attempt."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MongoDatabase"


if TYPE_CHECKING:
    MongoDatabase = Annotated[AsyncDatabase[Any], _MongoDatabaseMark()]
else:  # the annotation names no PyMongo type at run time: this module imports no I/O library
    MongoDatabase = Annotated[Any, _MongoDatabaseMark()]
"""The consumer's database (PyMongo's ``AsyncDatabase``), for handlers of any guarantee.

An inbox handler's writes belong to its transaction only with ``session=mongo.session``
(``MongoScope``); an at-least-once handler writes straight through it."""


class Depends:
    """``Annotated[T, Depends(factory)]``: the parameter gets what ``factory`` gives for the attempt.

    ``factory`` is a function, a coroutine function, or an (async) generator function whose
    code after its one ``yield`` runs when the attempt ends, success or failure. Its own
    parameters are resolved like a handler's (extractors, ``MongoScope``,
    ``MongoDatabase``, ``Resource``, other ``Depends``); it runs once per attempt, however
    many parameters ask for it. See docs/handlers.md.
    """

    __slots__ = ("factory",)

    def __init__(self, factory: Callable[..., Any]) -> None:
        if not callable(factory):
            raise ConfigError(f"Depends(factory) needs a callable factory, got {describe_value(factory)}")
        self.factory = factory

    def __repr__(self) -> str:
        return f"Depends({_name_of(self.factory)})"


class Resource:
    """``Annotated[T, Resource("name")]``: the value the consumer's lifespan yielded under ``name``.

    A name the lifespan did not yield fails ``start()`` (docs/handlers.md, resources).
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"Resource(name) needs a non-empty string, got {describe_value(name)}")
        self.name = name

    def __repr__(self) -> str:
        return f"Resource({self.name!r})"


Source = Literal["delivery", "scope", "database", "resource", "depends"]


@dataclass(frozen=True, slots=True)
class Parameter:
    """One resolved parameter of a handler or a factory."""

    name: str
    extractor: Extractor | None  # set for a value read from the delivery; None: supplied by the attempt
    source: Source = "delivery"  # delivery (the extractor), scope (MongoScope), database, resource, depends
    resource: str | None = None  # the Resource name
    dependency: Dependency | None = None  # the Depends factory


FactoryKind = Literal["function", "coroutine", "async_generator", "generator"]


@dataclass(frozen=True, slots=True, eq=False)
class Dependency:
    """One ``Depends`` factory, resolved: how to call it and where each of its arguments comes from."""

    factory: Callable[..., Any]
    kind: FactoryKind
    parameters: tuple[Parameter, ...]
    name: str
    # What an attempt calls: the factory, or for a generator function its context manager.
    opener: Callable[..., Any]

    def __repr__(self) -> str:
        return f"<Dependency {self.name} ({self.kind})>"


@dataclass(frozen=True, slots=True)
class Resolved:
    """A handler's parameters and every factory they need, each once, in the order an attempt calls them."""

    parameters: tuple[Parameter, ...]
    dependencies: tuple[Dependency, ...]
    terminal: Parameter | None
    scope: tuple[str, ...]  # where a MongoScope is asked for (for plan errors)
    database: tuple[str, ...]  # where MongoDatabase is asked for
    resources: tuple[tuple[str, str], ...]  # (name, where) of every Resource asked for


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    if typing.get_origin(annotation) is Annotated:
        base, *extras = typing.get_args(annotation)
        return base, extras
    return annotation, []


def _name_of(fn: object) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None and isinstance(fn, functools.partial):
        return f"partial({_name_of(fn.func)})"
    return str(name) if name is not None else type(fn).__name__


def _annotated(fn: Callable[..., Any]) -> Any:
    """Where ``fn``'s parameter annotations live."""
    if isinstance(fn, functools.partial):
        return _annotated(fn.func)
    if isinstance(fn, type):
        return fn.__init__  # type: ignore[misc]  # a class: its __init__'s annotations
    if isinstance(fn, types.FunctionType | types.MethodType | types.BuiltinFunctionType):
        return fn
    return type(fn).__call__  # a callable object: its annotations live on the class's __call__


def _factory_kind(factory: Callable[..., Any]) -> FactoryKind:
    call: Any = factory
    if not isinstance(factory, types.FunctionType | types.MethodType | functools.partial | type):
        call = getattr(type(factory), "__call__", factory)  # noqa: B004
    if inspect.isasyncgenfunction(call):
        return "async_generator"
    if inspect.isgeneratorfunction(call):
        return "generator"
    if inspect.iscoroutinefunction(call):
        return "coroutine"
    return "function"


class _Resolver:
    """Resolves one handler: its parameters, then each factory's, depth first, each factory once."""

    def __init__(self, scope_type: type, max_parameters: int) -> None:
        self.scope_type = scope_type
        self.max_parameters = max_parameters
        self.nodes: dict[int, Dependency] = {}  # by id(factory): factories need not be hashable
        self.order: list[Dependency] = []
        self.chain: list[tuple[int, str]] = []  # the factories being resolved, outermost first
        self.terminals: list[tuple[str, Parameter]] = []
        self.scope: list[str] = []
        self.database: list[str] = []
        self.resources: list[tuple[str, str]] = []

    def parameters(self, fn: Callable[..., Any], where: str, prefix: str = "") -> tuple[Parameter, ...]:
        try:
            hints = typing.get_type_hints(_annotated(fn), include_extras=True)
        except Exception as exc:  # NameError for unresolvable forward references, and the like
            raise PlanError(f"{where}: cannot resolve parameter annotations: {exc}") from exc
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError) as exc:
            raise PlanError(f"{where}: cannot read the signature of {_name_of(fn)}: {exc}") from exc
        if len(params) > self.max_parameters:
            raise PlanError(f"{where}: {len(params)} parameters, over the bound of {self.max_parameters}")
        return tuple(self._parameter(param, hints, where, prefix) for param in params)

    def _parameter(self, param: inspect.Parameter, hints: dict[str, Any], where: str, prefix: str) -> Parameter:
        name = param.name
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise PlanError(f"{where}: parameter {name!r} (*args/**kwargs) cannot be injected")
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise PlanError(f"{where}: parameter {name!r} is positional-only")
        annotation = hints.get(name, inspect.Parameter.empty)
        if annotation is inspect.Parameter.empty:
            raise PlanError(f"{where}: parameter {name!r} has no annotation to inject from")
        base, extras = _unwrap(annotation)
        marks = [e for e in extras if isinstance(e, Extractor | Depends | Resource | _MongoDatabaseMark)]
        if len(marks) > 1:
            raise PlanError(
                f"{where}: parameter {name!r} has {len(marks)} extractors ({', '.join(map(repr, marks))}); "
                "a parameter takes one"
            )
        here = f"{where}: parameter {name!r}"
        mark = marks[0] if marks else None
        if isinstance(mark, Extractor):
            parameter = Parameter(name, mark.bind(base))
            if parameter.extractor is not None and parameter.extractor.terminal:
                self.terminals.append((prefix + name, parameter))
            return parameter
        if isinstance(mark, Depends):
            return Parameter(name, None, "depends", dependency=self.depend(mark.factory, here))
        if isinstance(mark, Resource):
            self.resources.append((mark.name, here))
            return Parameter(name, None, "resource", resource=mark.name)
        if isinstance(mark, _MongoDatabaseMark):
            self.database.append(here)
            return Parameter(name, None, "database")
        if isinstance(base, type) and issubclass(base, self.scope_type):
            self.scope.append(here)
            return Parameter(name, None, "scope")
        if base is RawDelivery:
            return Parameter(name, _RawDeliveryExtractor())
        shown = getattr(base, "__name__", None) or repr(base)
        raise PlanError(
            f"{here} of type {shown} is not injectable; use Json[T], Text, Bytes, EventId, RetryCount, "
            "Redelivered, RawDelivery, MongoScope, MongoDatabase, Annotated[T, Depends(factory)], "
            "Annotated[T, Resource(name)] or Annotated[T, Extractor()]"
        )

    def depend(self, factory: Callable[..., Any], where: str) -> Dependency:
        key = id(factory)
        known = self.nodes.get(key)
        if known is not None:
            return known
        name = _name_of(factory)
        if any(k == key for k, _ in self.chain):
            cycle = " -> ".join([*(n for _, n in self.chain), name])
            raise PlanError(f"{where}: Depends({name}) needs itself: {cycle}")
        kind = _factory_kind(factory)
        self.chain.append((key, name))
        try:
            parameters = self.parameters(factory, f"{where} (Depends({name}))", prefix=f"{name}.")
        finally:
            self.chain.pop()
        opener: Callable[..., Any] = factory
        if kind == "async_generator":
            opener = contextlib.asynccontextmanager(factory)
        elif kind == "generator":
            opener = contextlib.contextmanager(factory)
        node = Dependency(factory, kind, parameters, name, opener)
        self.nodes[key] = node
        self.order.append(node)  # after every factory it needs: they were resolved first
        return node


def resolve_handler(fn: Callable[..., Any], *, where: str, scope_type: type, max_parameters: int) -> Resolved:
    """Resolve every parameter of ``fn`` and of the factories it depends on, once, at plan time.

    Each parameter of ``fn`` counts once toward ``max_parameters`` (a ``Depends`` parameter
    too, whatever its factory needs); each factory has the same bound on its own.
    """
    resolver = _Resolver(scope_type, max_parameters)
    parameters = resolver.parameters(fn, where)
    terminals = resolver.terminals
    if len(terminals) > 1:
        raise PlanError(
            f"{where}: {len(terminals)} terminal payload extractors ({', '.join(n for n, _ in terminals)}), "
            "over the bound of 1"
        )
    return Resolved(
        parameters=parameters,
        dependencies=tuple(resolver.order),
        terminal=terminals[0][1] if terminals else None,
        scope=tuple(resolver.scope),
        database=tuple(resolver.database),
        resources=tuple(resolver.resources),
    )


def is_coroutine_function(fn: object) -> bool:
    """True for ``async def`` functions (and callables whose ``__call__`` is one)."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004
    return call is not None and not isinstance(fn, types.FunctionType) and inspect.iscoroutinefunction(call)
