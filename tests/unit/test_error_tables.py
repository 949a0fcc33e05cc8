"""The two error tables: every AMQP client and PyMongo exception becomes the lily error docs/operations.md names.

The tables (``lily_mongo._amqp.errors.AMQP_ERRORS``, ``lily_mongo._mongo.MONGO_ERRORS``) must
name classes the installed libraries define, and cover every exception class those libraries
define; a representative instance of each kind must come out as the documented lily error
with the documented sentence. Exceptions the tables do not name (bugs, cancellation) pass
through unchanged.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
from types import ModuleType
from typing import Any

import aio_pika.exceptions
import aiormq.abc
import aiormq.exceptions
import bson.errors
import pymongo.errors
import pytest
from pamqp import commands as spec

from lily_mongo._amqp import AMQP_ERRORS, amqp_failure, channel_errors, map_amqp_errors
from lily_mongo._amqp.connections import connection_error
from lily_mongo._amqp.publishing import publish_error
from lily_mongo._errors import ConfigError, LilyError, PublishError, TransportError
from lily_mongo._mongo import MONGO_ERRORS, mongo_error, mongo_errors, timed_out

URL = "amqp://app:s3cret@broker.example:5672/orders"
MONGO_URI = "mongodb://app:s3cret@db.example:27017/"


def exception_classes(module: ModuleType) -> list[type[BaseException]]:
    """The public exception classes ``module`` defines (aliases included once)."""
    found = {
        cls
        for name, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and not name.startswith("_") and cls.__module__.startswith(module.__name__)
    }
    return sorted(found, key=lambda cls: cls.__name__)


def bare(cls: type[BaseException]) -> BaseException:
    """An instance of ``cls`` without its constructor's arguments (some require frames)."""
    return cls.__new__(cls)


# -- the tables name what the libraries define ------------------------------------------------------


@pytest.mark.parametrize("cls", list(AMQP_ERRORS), ids=lambda cls: cls.__name__)
def test_each_amqp_class_the_table_names_exists_in_the_installed_library(cls: type[BaseException]) -> None:
    home = {"aiormq.exceptions": aiormq.exceptions, "builtins": None, "asyncio.exceptions": asyncio}[cls.__module__]
    if home is not None:
        assert getattr(home, cls.__name__) is cls


@pytest.mark.parametrize("cls", list(MONGO_ERRORS), ids=lambda cls: cls.__name__)
def test_each_pymongo_class_the_table_names_exists_in_the_installed_library(cls: type[BaseException]) -> None:
    home = {"pymongo.errors": pymongo.errors, "bson.errors": bson.errors}[cls.__module__]
    assert getattr(home, cls.__name__) is cls


@pytest.mark.parametrize(
    "cls",
    exception_classes(aiormq.exceptions) + exception_classes(aio_pika.exceptions),
    ids=lambda cls: f"{cls.__module__}.{cls.__name__}",
)
def test_every_amqp_client_exception_is_mapped(cls: type[BaseException]) -> None:
    assert any(issubclass(cls, named) for named in AMQP_ERRORS)
    assert amqp_failure(bare(cls)) is not None


@pytest.mark.parametrize("cls", exception_classes(pymongo.errors), ids=lambda cls: cls.__name__)
def test_every_pymongo_exception_is_mapped(cls: type[BaseException]) -> None:
    assert any(issubclass(cls, named) for named in MONGO_ERRORS)


# -- connecting --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "sentence", "unreachable"),
    [
        (
            aiormq.exceptions.ProbableAuthenticationError("ACCESS_REFUSED"),
            "RabbitMQ at amqp://app:***@broker.example:5672/orders refused the login (ACCESS_REFUSED): "
            "check the user and password",
            False,
        ),
        (
            aiormq.exceptions.InvalidFrameError("Expected Connection.OpenOk, got <Connection.Close object>"),
            "RabbitMQ at amqp://app:***@broker.example:5672/orders refused to open virtual host 'orders': "
            "it does not exist, or the user may not access it",
            False,
        ),
        (
            ConnectionRefusedError(111, "Connection refused"),
            "RabbitMQ is not reachable at amqp://app:***@broker.example:5672/orders (connection refused)",
            True,
        ),
        (
            socket.gaierror(-2, "Name or service not known"),
            "RabbitMQ is not reachable at amqp://app:***@broker.example:5672/orders (unknown host)",
            True,
        ),
        (
            TimeoutError(),
            "RabbitMQ is not reachable at amqp://app:***@broker.example:5672/orders (timed out)",
            True,
        ),
        (
            aiormq.exceptions.AMQPConnectionError(104, "Connection reset by peer"),
            "RabbitMQ is not reachable at amqp://app:***@broker.example:5672/orders (Connection reset by peer)",
            True,
        ),
        (
            aiormq.exceptions.MethodNotImplemented(),
            "connecting to RabbitMQ at amqp://app:***@broker.example:5672/orders failed (MethodNotImplemented)",
            False,
        ),
    ],
)
def test_a_refused_connection_says_who_refused(exc: BaseException, sentence: str, unreachable: bool) -> None:
    error = connection_error(URL, exc)
    assert type(error) is TransportError
    assert str(error) == sentence
    assert error.unreachable is unreachable


# -- publishing --------------------------------------------------------------------------------------


def returned() -> aiormq.abc.DeliveredMessage:
    """A message the broker returned (basic.return), as aiormq hands it to its PublishError."""
    return aiormq.abc.DeliveredMessage(
        delivery=spec.Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange="", routing_key="q"),
        header=None,  # type: ignore[arg-type]
        body=b"",
        channel=None,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (aiormq.exceptions.PublishError(returned(), spec.Basic.Return()), "unroutable"),
        (aiormq.exceptions.DeliveryError(None, spec.Basic.Nack(delivery_tag=1)), "nacked"),
        (TimeoutError(), "timeout"),
        (aiormq.exceptions.ChannelInvalidStateError("closed"), "closed"),
        (aiormq.exceptions.ConnectionClosed(320, "CONNECTION_FORCED"), "closed"),
        (ConnectionResetError(), "closed"),
        (asyncio.InvalidStateError(), "closed"),
    ],
)
def test_a_failed_publish_is_a_publish_error_of_its_kind(exc: BaseException, kind: str) -> None:
    failure = amqp_failure(exc)
    assert failure is not None
    error = publish_error(failure, exc, where="exchange '' routing key 'q'", timeout=2.5)
    assert error.kind == kind
    assert str(error).startswith(f"publish {kind}: exchange '' routing key 'q': ")


# -- other channel operations -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "expected", "sentence"),
    [
        (
            aiormq.exceptions.ChannelNotFoundEntity("NOT_FOUND - no queue 'q'"),
            ConfigError,
            "declaring queue 'q': the queue or exchange does not exist on the broker",
        ),
        (
            aiormq.exceptions.ChannelPreconditionFailed("PRECONDITION_FAILED - inequivalent arg"),
            ConfigError,
            "declaring queue 'q': it exists with other arguments (PRECONDITION_FAILED): "
            "PRECONDITION_FAILED - inequivalent arg",
        ),
        (
            aiormq.exceptions.ChannelAccessRefused("ACCESS_REFUSED - no access to 'q'"),
            TransportError,
            "RabbitMQ refused access (declaring queue 'q'): ACCESS_REFUSED - no access to 'q'",
        ),
        (aiormq.exceptions.ChannelClosed(406, "x"), TransportError, "declaring queue 'q' failed: ChannelClosed"),
        (aiormq.exceptions.AMQPError(), TransportError, "declaring queue 'q' failed: AMQPError"),
        (ConnectionResetError(), TransportError, "declaring queue 'q' failed: ConnectionResetError"),
    ],
)
def test_a_failed_channel_operation_names_the_operation(
    exc: BaseException, expected: type[LilyError], sentence: str
) -> None:
    with pytest.raises(LilyError) as caught, channel_errors("declaring queue 'q'"):
        raise exc
    assert type(caught.value) is expected
    assert str(caught.value) == sentence
    assert caught.value.__cause__ is exc


def test_a_caller_words_a_missing_queue_itself() -> None:
    missing = "queue 'q' does not exist (passive)"
    with (
        pytest.raises(ConfigError, match=r"^queue 'q' does not exist \(passive\)$"),
        channel_errors("declaring queue 'q'", not_found=missing),
    ):
        raise aiormq.exceptions.ChannelNotFoundEntity("NOT_FOUND")


@pytest.mark.parametrize(
    "exc",
    [ValueError("bug"), RuntimeError("bug"), KeyError("k"), ConfigError("already lily"), PublishError("nacked", "x")],
)
def test_what_the_amqp_table_does_not_name_passes_through(exc: Exception) -> None:
    with pytest.raises(type(exc)) as caught, map_amqp_errors(lambda failure, e: TransportError("mapped")):
        raise exc
    assert caught.value is exc


async def test_a_cancellation_is_never_mapped() -> None:
    with pytest.raises(asyncio.CancelledError), channel_errors("reading 'q.dlq'"):
        raise asyncio.CancelledError


# -- PyMongo -----------------------------------------------------------------------------------------


SHOWN = "mongodb://app:***@db.example:27017/"  # MONGO_URI as a sentence names it: its password masked
UNREACHABLE = f"MongoDB is not reachable at {SHOWN} (no server answered in time)"
REFUSED = f"MongoDB at {SHOWN} refused the ping"


@pytest.mark.parametrize(
    ("exc", "expected", "sentence", "unreachable"),
    [
        (pymongo.errors.InvalidURI("bad port"), ConfigError, f"the MongoDB URI {SHOWN} is not valid: bad port", False),
        (pymongo.errors.ServerSelectionTimeoutError("db.example:27017: timed out"), TransportError, UNREACHABLE, True),
        (pymongo.errors.AutoReconnect("connection closed"), TransportError, UNREACHABLE, True),
        (
            pymongo.errors.OperationFailure("Authentication failed.", code=18),
            TransportError,
            f"MongoDB at {SHOWN} refused the login: check the user and password",
            False,
        ),
        (
            pymongo.errors.OperationFailure("not authorized on shop", code=13),
            TransportError,
            f"{REFUSED}: OperationFailure: not authorized on shop",
            False,
        ),
        (pymongo.errors.DuplicateKeyError("E11000"), TransportError, f"{REFUSED}: DuplicateKeyError: E11000", False),
        (
            bson.errors.InvalidDocument("cannot encode object"),
            TransportError,
            f"{REFUSED}: InvalidDocument: cannot encode object",
            False,
        ),
    ],
    ids=["invalid-uri", "server-selection", "reconnect", "login", "unauthorized", "duplicate-key", "bad-document"],
)
def test_a_pymongo_error_becomes_the_documented_lily_error(
    exc: BaseException, expected: type[LilyError], sentence: str, unreachable: bool
) -> None:
    error = mongo_error(exc, "the ping", uri=MONGO_URI)
    assert type(error) is expected
    assert str(error) == sentence
    assert getattr(error, "unreachable", False) is unreachable


def test_without_a_uri_the_sentence_names_the_operation() -> None:
    error = mongo_error(pymongo.errors.OperationFailure("index exists", code=85), "the inbox set-up")
    assert str(error) == "MongoDB refused the inbox set-up: OperationFailure: index exists"
    error = mongo_error(pymongo.errors.ConfigurationError("unknown option"), "the inbox set-up")
    assert type(error) is ConfigError
    assert str(error) == "MongoDB configuration is not valid (the inbox set-up): unknown option"


def test_a_uri_password_never_reaches_the_sentence() -> None:
    error = mongo_error(pymongo.errors.OperationFailure(f"bad {MONGO_URI}", code=2), "the ping", uri=MONGO_URI)
    assert "s3cret" not in str(error)


@pytest.mark.parametrize("exc", [ValueError("bug"), RuntimeError("bug"), TransportError("already lily")])
def test_what_the_pymongo_table_does_not_name_passes_through(exc: Exception) -> None:
    with pytest.raises(type(exc)) as caught, mongo_errors("reading the inbox statistics"):
        raise exc
    assert caught.value is exc


def test_a_mapped_pymongo_error_keeps_its_cause() -> None:
    original: Any = pymongo.errors.NetworkTimeout("timed out")
    with pytest.raises(TransportError) as caught, mongo_errors("reading the inbox statistics"):
        raise original
    assert caught.value.__cause__ is original
    assert caught.value.unreachable


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (pymongo.errors.NetworkTimeout("timed out"), True),  # no reply within the operation timeout
        (pymongo.errors.ServerSelectionTimeoutError("no primary"), True),  # no server within it
        (pymongo.errors.ExecutionTimeout("operation exceeded time limit", 50), True),  # the server's maxTimeMS
        (pymongo.errors.AutoReconnect("connection closed"), False),  # a lost connection, not a wait
        (pymongo.errors.OperationFailure("write conflict", 112), False),
        (pymongo.errors.DuplicateKeyError("E11000", 11000), False),
    ],
    ids=["network-timeout", "server-selection", "max-time-ms", "reconnect", "write-conflict", "duplicate-key"],
)
def test_a_wait_that_ran_out_is_told_apart_from_other_failures(
    exc: pymongo.errors.PyMongoError, expected: bool
) -> None:
    assert timed_out(exc) is expected
