"""A handler's parameters, resolved once at plan time (docs/handlers.md): which extractor, scope, database,
resource or dependency each one takes, and the factories an attempt calls, in order.

``Annotated[T, Resource("name")]`` is what the consumer's lifespan yielded, ``Annotated[T,
Depends(factory)]`` what ``factory`` returns or yields for the attempt (its own parameters are
resolved the same way). :func:`resolve_handler` returns the handler's parameters and its factories;
a handler that asks for none of it is called exactly as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from .._errors import ConfigError, PlanError
from .._text import describe_value
from .batch import Batch, BatchExtractor
from .extractors import Extractor, MongoDatabaseMark, RawDelivery, RawDeliveryExtractor

if TYPE_CHECKING:
    pass


__all__ = ["Dependency", "Depends", "Parameter", "Resolved", "Resource", "resolve_handler"]


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


def _from_faststream(thing: object) -> bool:
    module = getattr(thing, "__module__", None) or getattr(type(thing), "__module__", "")
    return isinstance(module, str) and module.split(".", 1)[0] == "faststream"


def _habit_hint(name: str, base: Any, shown: str, default: Any) -> str:
    """What a parameter written the FastStream way means here (docs/handlers.md): '' when it is not one."""
    if isinstance(default, Depends | Resource):
        mark = default if isinstance(default, Resource) else f"Depends({getattr(default.factory, '__name__', '...')})"
        return (
            f": {mark} as a default value is FastStream's form; here the mark goes in the annotation, "
            f"{name}: Annotated[{shown}, {mark}]"
        )
    if _from_faststream(default) or _from_faststream(base) or base is logging.Logger:
        return (
            ": FastStream's Context has no equivalent here; the delivery's facts are EventId, RetryCount, "
            "Redelivered and RawDelivery, a shared object is Annotated[T, Resource(name)] (the lifespan's "
            "resources), a logger is logging.getLogger(...) at module level"
        )
    if base is str:
        return ": did you mean Text (the body as text), or Json[str]?"
    if base is bytes:
        return ": did you mean Bytes (the body as bytes)?"
    is_model = isinstance(base, type) and (hasattr(base, "model_validate") or dataclasses.is_dataclass(base))
    if is_model or typing.get_origin(base) in (dict, list) or base in (dict, list):
        return f": did you mean Json[{shown}] (the body decoded as JSON and validated as {shown})?"
    return ""


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
        if typing.get_origin(base) is Batch:
            parameter = Parameter(name, self._batch(base, f"{where}: parameter {name!r}"))
            self.terminals.append((prefix + name, parameter))
            return parameter
        marks = [e for e in extras if isinstance(e, Extractor | Depends | Resource | MongoDatabaseMark)]
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
        if isinstance(mark, MongoDatabaseMark):
            self.database.append(here)
            return Parameter(name, None, "database")
        if isinstance(base, type) and issubclass(base, self.scope_type):
            self.scope.append(here)
            return Parameter(name, None, "scope")
        if base is RawDelivery:
            return Parameter(name, RawDeliveryExtractor())
        shown = getattr(base, "__name__", None) or repr(base)
        hint = _habit_hint(name, base, shown, param.default)
        raise PlanError(
            f"{here} of type {shown} is not injectable{hint}; use Json[T], Text, Bytes, EventId, RetryCount, "
            "Redelivered, RawDelivery, MongoScope, MongoDatabase, Annotated[T, Depends(factory)], "
            "Annotated[T, Resource(name)] or Annotated[T, Extractor()]"
        )

    @staticmethod
    def _batch(annotation: Any, where: str) -> BatchExtractor:
        """``Batch[Json[T]]`` (or ``Batch[Text]``, ``Batch[Bytes]``, a terminal extractor): each entry's body
        decoded by the inner extractor (docs/handlers.md, "Batch handlers")."""
        (inner,) = typing.get_args(annotation) or (None,)
        base, extras = _unwrap(inner)
        found = [e for e in extras if isinstance(e, Extractor) and e.terminal]
        if len(found) != 1:
            raise PlanError(
                f"{where}: Batch[...] needs a body extractor for its entries: Batch[Json[T]], Batch[Text], "
                f"Batch[Bytes] or Batch[Annotated[T, TerminalExtractor()]], got Batch[{inner!r:.80}]"
            )
        return BatchExtractor(found[0].bind(base))

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
