"""The standalone outbox for code outside handlers: ``await outbox.transaction(fn)`` (docs/outbox.md)."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from .._amqp import channel_errors, connect_amqp
from .._checks import check_amqp_url, check_database_name, check_seconds
from .._errors import CommitOutcomeUnknown, ConfigError, LilyError, TransportError
from .._mongo import TransactionScope, error_labels, mongo_error, rules
from .._mongo import transactions as transaction
from .._mongo.transactions import Replay
from .._observer import NO_OBSERVER, Observer
from .._plan.outgoing import DeclaresOutgoing
from .._tasks import TaskSet
from .._text import describe_value
from ..publisher import CustomPublishContent, OpenClose, PublishOptions, ResourceState, TypedPublishing
from ..telemetry import resolve_telemetry
from .options import TRANSACTION_BACKOFF_BASE, TRANSACTION_BACKOFF_MAX, OutboxOptions, standalone_options
from .process import ProcessOutbox
from .writer import OutboxWriter

if TYPE_CHECKING:
    import aio_pika.abc
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.database import AsyncDatabase

    from ..telemetry import Telemetry
T = TypeVar("T")

# -- the standalone outbox ----------------------------------------------------------------------------


class OutboxTransaction(TransactionScope, TypedPublishing):
    """What :meth:`Outbox.transaction`'s function receives: the session, the database and the outbox.

    Valid while the function runs; pass ``session=tx.session`` to every operation that
    belongs to the transaction. ``publish_json/text/binary`` and ``publish`` validate and
    return the event id exactly like a handler's ``mongo.outbox``.
    """

    __slots__ = ("_writer",)

    _closed_message = "this transaction has ended; its session and outbox cannot be used any more"

    def __init__(self, session: AsyncClientSession, database: AsyncDatabase[Any], writer: OutboxWriter) -> None:
        super().__init__(session, database)
        self._writer = writer

    def __repr__(self) -> str:
        return f"<OutboxTransaction open={self._open} written={self._writer.written}>"

    async def _publish[T](
        self, content: CustomPublishContent[T], routing_key: str, payload: T, version: int, options: PublishOptions
    ) -> uuid.UUID:
        self._check()
        return await self._writer.publish(content, routing_key, payload, version=version, **options)


class Outbox(OpenClose, DeclaresOutgoing):
    """The transactional outbox for code outside handlers (a web endpoint, a script).

    ``await outbox.transaction(fn)`` runs ``fn(tx)`` in a fresh session and transaction
    and returns its result; messages staged with ``tx.publish_*`` commit with the
    business writes or not at all. Without ``amqp_url`` it only writes: nothing needs
    starting, and a relay (a consumer's, or ``lily-mongo relay``) publishes the records.
    With ``amqp_url``, ``async with Outbox(...)`` owns a connection, publishes each
    transaction's records right after its commit and runs a backstop relay unless
    ``options.run_relay`` is off (docs/outbox.md). ``mongo_client`` is the caller's.
    """

    def __init__(
        self,
        mongo_client: AsyncMongoClient[Any],
        database: str,
        *,
        amqp_url: str | Sequence[str] | None = None,
        options: OutboxOptions | None = None,
        name: str = "outbox",
        confirm_timeout: float = 10.0,
        telemetry: bool | Telemetry = True,
    ) -> None:
        if not isinstance(mongo_client, AsyncMongoClient):
            raise ConfigError(f"mongo_client must be a pymongo.AsyncMongoClient, got {describe_value(mongo_client)}")
        check_database_name("database", database)
        if amqp_url is not None:
            amqp_url = check_amqp_url("amqp_url", amqp_url)
        options = standalone_options(options, name)
        self._client = mongo_client
        self._database = mongo_client[database]
        self._url = amqp_url
        self._options = options
        self._rules = rules.Rules(
            replay_budget=options.transaction_retries,
            commit_retries=options.commit_retries,
            backoff_base=TRANSACTION_BACKOFF_BASE,
            backoff_max=TRANSACTION_BACKOFF_MAX,
        )
        self._name = name
        self._confirm_timeout = check_seconds("confirm_timeout", confirm_timeout, low=0, high=3600, low_inclusive=False)
        observer: Observer = resolve_telemetry(telemetry) or NO_OBSERVER
        self._process = ProcessOutbox(
            mongo_client, database, options, owner=f"{name[:64]}:{uuid.uuid4().hex[:12]}", observer=observer
        )
        self._tasks = TaskSet()
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._state = ResourceState.NEW

    def __repr__(self) -> str:
        return f"<Outbox name={self._name!r} state={self._state.value} dispatch={self._url is not None}>"

    @property
    def options(self) -> OutboxOptions:
        return self._options

    @property
    def process(self) -> ProcessOutbox:
        """The process's outbox parts (dispatcher, relay, counters)."""
        return self._process

    async def open(self) -> None:
        """With ``amqp_url``: connect, read the server's clock, create the indexes, start dispatching (and
        the relay). Without: nothing to start."""
        if self._state is ResourceState.CLOSED:
            raise LilyError("this Outbox is closed and cannot be reopened")
        if self._state is ResourceState.OPEN:
            return
        if self._url is None:
            self._state = ResourceState.OPEN
            return
        connection = await connect_amqp(self._url)
        try:
            try:
                await self._process.prepare()
            except PyMongoError as exc:
                raise mongo_error(exc, "the outbox set-up") from exc
            with channel_errors("starting the outbox"):
                await self._process.start(connection, self._confirm_timeout, self._tasks)
        except BaseException:
            await self._process.stop(1.0)
            await connection.close()
            raise
        self._connection = connection
        self._state = ResourceState.OPEN

    async def close(self) -> None:
        """Publish and mark what was committed (within ``confirm_timeout``), stop, close the connection.

        Records not published by then stay in the collection; a relay publishes them."""
        if self._state is ResourceState.CLOSED:
            return
        self._state = ResourceState.CLOSED
        try:
            await self._process.stop(self._confirm_timeout)
            leftovers = self._tasks.pending()
            for task in leftovers:
                task.cancel()
            await self._tasks.join(leftovers, self._confirm_timeout)
        finally:
            if self._connection is not None:
                connection, self._connection = self._connection, None
                await connection.close()

    def _require_usable(self) -> None:
        if self._state is ResourceState.CLOSED:
            raise LilyError("this Outbox is closed")
        if self._url is not None and self._state is not ResourceState.OPEN:
            raise LilyError("an Outbox with amqp_url dispatches after commit: use `async with Outbox(...)` first")

    async def transaction(self, fn: Callable[[OutboxTransaction], Awaitable[T]]) -> T:
        """Run ``fn(tx)`` in a fresh session and transaction, commit, dispatch its records; return ``fn``'s result.

        ``fn`` runs again in a fresh transaction after a ``TransientTransactionError`` (by label),
        at most ``options.transaction_retries`` times, with jittered backoff. An unknown commit
        result retries the same commit (``options.commit_retries``), then reads one of the
        transaction's own records with majority read concern: present, it committed; absent
        (or no record written) raises :class:`~lily_mongo.CommitOutcomeUnknown` (``fn`` is never
        re-run to find out). Any other exception from ``fn`` aborts and propagates unchanged.
        The steps are the inbox's (``lily_mongo._mongo.transactions``).
        """
        self._require_usable()
        if self._url is None and self._process.clock_stale:  # nothing was opened: read on use, now and then
            try:
                await self._process.read_clock()
            except PyMongoError as exc:
                raise mongo_error(exc, "reading the server's clock") from exc

        def spent(replay: Replay, runs: int) -> NoReturn:
            raise TransportError(
                f"the transaction did not commit after {runs} runs (TransientTransactionError each "
                f"time; OutboxOptions.transaction_retries={self._rules.replay_budget}); nothing was committed"
            ) from replay

        result, writer = await transaction.replaying(functools.partial(self._run, fn), self._rules, spent=spent)
        self._process.committed(writer)
        return result

    async def _run(self, fn: Callable[[OutboxTransaction], Awaitable[T]]) -> tuple[T, OutboxWriter]:
        """One run of ``fn`` in its own session and transaction, then its commit (a :class:`Replay` when
        it must run again)."""
        session = await transaction.start_transaction(self._client)
        try:
            tx: OutboxTransaction | None = None
            writer = self._process.writer(session, self._name, lambda: tx is not None and tx.is_open)
            tx = OutboxTransaction(session, self._database, writer)
            try:
                result = await fn(tx)
            except BaseException as exc:
                tx.close()
                await transaction.abort_quietly(session, None)
                if (
                    isinstance(exc, PyMongoError)
                    and rules.classify_error(error_labels(exc), in_commit=False) is rules.ErrorStep.REPLAY
                ):
                    raise Replay(f"{type(exc).__name__} in the transaction's function") from exc
                raise
            tx.close()
            unknown = await transaction.commit(session, None)
            if unknown is not None:
                await self._reconcile(session, writer, unknown)
            return result, writer
        finally:
            await session.end_session()

    async def _reconcile(self, session: AsyncClientSession, writer: OutboxWriter, unknown: PyMongoError) -> None:
        """An unknown commit result: retry the same commit, then read the transaction's own record back;
        :class:`CommitOutcomeUnknown` unless one of them proves the commit."""
        if await transaction.retry_commit(session, self._rules):
            return
        record: dict[str, Any] | None = None
        if writer.records:
            try:
                record = await transaction.read_back(self._process.read_backs, writer.records[0]["_id"], None)
            except PyMongoError as exc:
                raise CommitOutcomeUnknown(
                    f"the commit's outcome is unknown and its outbox record could not be read back "
                    f"({type(exc).__name__}); check the data before running it again"
                ) from exc
        # A record it wrote, present, proves the commit (a transaction commits all its writes or
        # none). Absent proves nothing (a commit still in progress, or a failover).
        if rules.read_back_verdict(record, completed={}, ours={}) is rules.ReadBack.COMMITTED:
            return
        what = (
            "its outbox record is not visible with majority read concern"
            if writer.records
            else "it wrote no outbox record to read back"
        )
        raise CommitOutcomeUnknown(
            f"the commit's outcome is unknown after {self._rules.commit_retries} commit retries and {what}; "
            "it may or may not have committed: check the data before running it again"
        ) from unknown
