"""Every options class refuses a bad value with a ConfigError naming the field, the value and the bound.

``InboxOptions`` has its own tests; the queue and retry options are covered in test_plan.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from lily_mongo import (
    ConfigError,
    Consumer,
    CustomPublishContent,
    InboxOptions,
    Outbox,
    OutboxOptions,
    OutboxTransaction,
    Publisher,
    Relay,
    queue,
)
from lily_mongo._outbox import OutboxWriter
from lily_mongo._plan.options import QueueOptions
from lily_mongo.publisher import prepare_publication

URL = "amqp://guest:guest@127.0.0.1/"


def refused(make: Callable[[], object], *parts: str) -> None:
    with pytest.raises(ConfigError) as caught:
        make()
    for part in parts:
        assert part in str(caught.value), (part, str(caught.value))


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        ({"collection": ""}, ("OutboxOptions.collection", "1..120 bytes", "''")),
        ({"collection": "a$b"}, ("OutboxOptions.collection", "a$b")),
        ({"collection": "x" * 121}, ("OutboxOptions.collection", "1..120 bytes")),
        ({"max_body": 0}, ("OutboxOptions.max_body", "0", "1..16777216")),
        ({"max_body": 16 * 1024 * 1024 + 1}, ("OutboxOptions.max_body", "16777217", "1..16777216")),
        ({"batch_size": 0}, ("OutboxOptions.batch_size", "0", "1..1000")),
        ({"batch_size": 1001}, ("OutboxOptions.batch_size", "1001", "1..1000")),
        ({"poll_interval": -1}, ("OutboxOptions.poll_interval", "-1", "0.01..3600")),
        ({"poll_interval": 0}, ("OutboxOptions.poll_interval", "0", "0.01..3600")),
        ({"poll_interval": float("nan")}, ("OutboxOptions.poll_interval", "nan", "finite")),
        ({"claim_seconds": 0}, ("OutboxOptions.claim_seconds", "0", "0.1..86400")),
        ({"mark_interval": -0.1}, ("OutboxOptions.mark_interval", "-0.1", "0..60")),
        ({"mark_interval": 61, "claim_seconds": 600}, ("OutboxOptions.mark_interval", "61", "0..60")),
        ({"claim_seconds": 1.0}, ("OutboxOptions.mark_interval", "1.0", "half of claim_seconds (1.0)")),
        ({"max_attempts": 0}, ("OutboxOptions.max_attempts", "0", "1..1000")),
        ({"max_attempts": 2.5}, ("OutboxOptions.max_attempts", "2.5", "1..1000")),
        ({"max_attempts": True}, ("OutboxOptions.max_attempts", "True", "1..1000")),
        ({"backoff_base": 0}, ("OutboxOptions.backoff_base", "0", "0.001..3600")),
        ({"backoff_base": 2.0, "backoff_max": 1.0}, ("OutboxOptions.backoff_max", "1.0", ">= backoff_base (2.0)")),
        ({"published_retention": 59}, ("OutboxOptions.published_retention", "59", "60..31622400")),
        ({"count_interval": 0}, ("OutboxOptions.count_interval", "0", "0.01..3600")),
        ({"run_relay": 1}, ("OutboxOptions.run_relay", "True or False", "1")),
        ({"passive_indexes": "no"}, ("OutboxOptions.passive_indexes", "True or False", "no")),
        ({"transaction_retries": -1}, ("OutboxOptions.transaction_retries", "-1", "0..100")),
        ({"commit_retries": 101}, ("OutboxOptions.commit_retries", "101", "0..100")),
    ],
)
def test_outbox_options_are_bounded(options: dict[str, Any], parts: tuple[str, ...]) -> None:
    refused(lambda: OutboxOptions(**options), *parts)


# The lowest and the highest value each bounded field takes (the bounds the refusals above name).
OUTBOX_BOUNDS: dict[str, tuple[float, float]] = {
    "poll_interval": (0.01, 3600),
    "claim_seconds": (0.1, 86400),
    "mark_interval": (0, 60),
    "max_attempts": (1, 1000),
    "backoff_base": (0.001, 3600),
    "backoff_max": (0.001, 86400),
    "batch_size": (1, 1000),
    "max_body": (1, 16 * 1024 * 1024),
    "published_retention": (60, 31622400),
    "count_interval": (0.01, 3600),
    "transaction_retries": (0, 100),
    "commit_retries": (0, 100),
}


@pytest.mark.parametrize("end", [0, 1], ids=["lowest", "highest"])
def test_outbox_options_at_their_bounds_are_accepted(end: int) -> None:
    values: dict[str, Any] = {field: bounds[end] for field, bounds in OUTBOX_BOUNDS.items()}
    options = OutboxOptions(**values)
    assert {field: getattr(options, field) for field in values} == values
    assert isinstance(options.poll_interval, float)
    assert isinstance(options.mark_interval, float)


def test_outbox_options_defaults() -> None:
    defaults = OutboxOptions()
    assert (defaults.collection, defaults.batch_size, defaults.max_body) == ("lily_outbox", 100, 8 * 1024 * 1024)
    assert (defaults.claim_seconds, defaults.mark_interval, defaults.run_relay) == (30.0, 1.0, True)


def test_a_consumer_needs_distinct_record_and_outbox_collections() -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient("mongodb://127.0.0.1:1/", connect=False)
    refused(
        lambda: Consumer(
            amqp_url=URL,
            name="svc",
            mongo_client=client,
            database="shop",
            inbox=InboxOptions(records="same"),
            outbox=OutboxOptions(collection="same"),
        ),
        "InboxOptions.records and OutboxOptions.collection must differ",
        "same",
    )


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        ({"mongo_client": "mongodb://db/"}, ("mongo_client", "AsyncMongoClient", "mongodb://db/")),
        ({"database": "a.b"}, ("database", "1..63 bytes", "a.b")),
        ({"amqp_url": "http://rabbit/"}, ("amqp_url", "amqp:// or amqps://")),
        ({"options": {"batch_size": 1}}, ("options", "OutboxOptions", "dict")),
        ({"name": ""}, ("name", "1..200 bytes")),
        ({"confirm_timeout": 0}, ("confirm_timeout", "0", "> 0 and <= 3600")),
    ],
)
def test_standalone_outbox_options_are_checked(options: dict[str, Any], parts: tuple[str, ...]) -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient("mongodb://127.0.0.1:1/", connect=False)
    refused(lambda: Outbox(**{"mongo_client": client, "database": "shop", **options}), *parts)


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        ({"amqp_url": "rabbit:5672"}, ("amqp_url", "amqp:// or amqps://")),
        ({"database": ""}, ("database", "''")),
        ({"options": 5}, ("options", "OutboxOptions", "int 5")),
        ({"name": "n" * 201}, ("name", "1..200 bytes")),
        ({"graceful_timeout": 0}, ("graceful_timeout", "0", "> 0 and <= 3600")),
        ({"force_timeout": -1}, ("force_timeout", "-1")),
        ({"owns_mongo_client": "yes"}, ("owns_mongo_client", "True or False")),
    ],
)
def test_relay_service_options_are_checked(options: dict[str, Any], parts: tuple[str, ...]) -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient("mongodb://127.0.0.1:1/", connect=False)
    refused(lambda: Relay(**{"mongo_client": client, "database": "shop", "amqp_url": URL, **options}), *parts)


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        ({"amqp_url": "http://rabbit/"}, ("amqp_url", "amqp:// or amqps://", "http://rabbit/")),
        ({"amqp_url": "amqp:///"}, ("amqp_url", "with a host")),
        ({"amqp_url": 42}, ("amqp_url", "int 42")),
        ({"confirm_timeout": 0}, ("confirm_timeout", "0", "> 0 and <= 3600")),
        ({"graceful_timeout": 3601}, ("graceful_timeout", "3601", "> 0 and <= 3600")),
        ({"force_timeout": float("inf")}, ("force_timeout", "inf", "finite")),
        ({"database": "shop"}, ("database", "shop", "needs a mongo_client")),
        ({"inbox": InboxOptions()}, ("inbox", "needs a mongo_client")),
        ({"outbox": OutboxOptions()}, ("outbox", "needs a mongo_client")),
        ({"owns_mongo_client": True}, ("owns_mongo_client", "needs a mongo_client")),
        ({"mongo_client": "mongodb://db/", "database": "shop"}, ("mongo_client", "AsyncMongoClient", "mongodb://db/")),
    ],
)
def test_consumer_options_are_checked(options: dict[str, Any], parts: tuple[str, ...]) -> None:
    refused(lambda: Consumer(**{"amqp_url": URL, "name": "svc", **options}), *parts)


def test_a_refused_amqp_url_is_shown_without_its_password() -> None:
    with pytest.raises(ConfigError) as caught:
        Consumer(amqp_url="amqp://app:P@ssw0rd@/", name="svc")
    assert "ssw0rd" not in str(caught.value)


@pytest.mark.parametrize(
    ("database", "parts"),
    [
        (None, ("database", "None")),
        ("", ("database", "''")),
        ("shop.orders", ("database", "1..63 bytes", "shop.orders")),
        ("a" * 64, ("database", "1..63 bytes", "length 64")),
        ("my shop", ("database", "my shop")),
    ],
)
def test_consumer_database_name_is_checked(database: object, parts: tuple[str, ...]) -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient("mongodb://127.0.0.1:1/", connect=False)
    refused(lambda: Consumer(amqp_url=URL, name="svc", mongo_client=client, database=database), *parts)  # type: ignore[arg-type]


def test_consumer_with_mongo_options_and_a_client_is_accepted() -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient("mongodb://127.0.0.1:1/", connect=False)
    consumer = Consumer(
        amqp_url=URL, name="svc", mongo_client=client, database="a" * 63, inbox=InboxOptions(), owns_mongo_client=True
    )
    assert consumer.name == "svc"


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        ({"amqp_url": "rabbit:5672"}, ("amqp_url", "amqp:// or amqps://")),
        ({"amqp_url": URL, "confirm_timeout": 0}, ("confirm_timeout", "0", "> 0 and <= 3600")),
        ({"amqp_url": URL, "confirm_timeout": float("inf")}, ("confirm_timeout", "inf", "finite")),
        ({"amqp_url": URL, "confirm_timeout": True}, ("confirm_timeout", "True")),
        ({"channel": "a channel"}, ("channel", "aio-pika channel", "a channel")),
        ({}, ("exactly one of amqp_url or channel",)),
    ],
)
def test_publisher_options_are_checked(options: dict[str, Any], parts: tuple[str, ...]) -> None:
    refused(lambda: Publisher(**options), *parts)


def test_custom_content_encoder_must_be_callable() -> None:
    refused(lambda: CustomPublishContent("protobuf", "application/x-protobuf", b"not callable"), "encode", "bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        ({"passive": "yes"}, ("passive", "True or False", "yes")),
        ({"unknown_errors": "ignore"}, ("unknown_errors", "'retryable' or 'permanent'", "ignore")),
        ({"ack_delay": -0.001}, ("ack_delay", "0..0.1 seconds", "-0.001")),
        ({"ack_delay": 0.5}, ("ack_delay", "0..0.1 seconds", "0.5")),
        ({"ack_delay": "1ms"}, ("ack_delay", "finite number of seconds", "1ms")),
        ({"consumer_timeout": 0}, ("consumer_timeout", "> 0 and <= 604800 seconds", "0")),
        ({"consumer_timeout": True}, ("consumer_timeout", "finite number of seconds", "True")),
    ],
)
def test_queue_options_name_the_refused_value(options: dict[str, Any], parts: tuple[str, ...]) -> None:
    refused(lambda: QueueOptions(name="orders", **options), *parts)


def test_ack_delay_zero_turns_coalescing_off_and_the_default_is_a_millisecond() -> None:
    assert QueueOptions(name="orders", ack_delay=0).ack_delay == 0
    assert QueueOptions(name="orders").ack_delay == 0.001


@pytest.mark.parametrize(
    ("options", "parts"),
    [
        ({"trace": 5}, ("trace", "int 5")),
        ({"trace": ""}, ("trace", "non-empty")),
        ({"middleware": [42]}, ("middleware", "async callables")),
        ({"guards": 5}, ("guards", "int 5")),
    ],
)
def test_queue_registration_options_are_checked(options: dict[str, Any], parts: tuple[str, ...]) -> None:
    refused(lambda: queue("orders", version=1, **options), *parts)


def keyword_options(hint: object) -> set[str]:
    """The keys of the TypedDict behind ``**options: Unpack[TypedDict]``."""
    assert typing.get_origin(hint) is typing.Unpack, hint
    (typed,) = typing.get_args(hint)
    return set(typed.__annotations__)


def test_configure_queue_takes_exactly_the_queue_options_as_typed_keywords() -> None:
    hint = typing.get_type_hints(Consumer.configure_queue)["options"]
    fields = {f.name for f in dataclasses.fields(QueueOptions)} - {"name"}
    assert keyword_options(hint) == fields


@pytest.mark.parametrize("method", ["publish", "publish_json", "publish_text", "publish_binary"])
@pytest.mark.parametrize("owner", [Publisher, OutboxWriter, OutboxTransaction])
def test_publish_methods_take_exactly_the_publication_options_as_typed_keywords(owner: type, method: str) -> None:
    hint = typing.get_type_hints(getattr(owner, method))["options"]
    accepted = {
        name
        for name, parameter in inspect.signature(prepare_publication).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    # version is a parameter of its own; max_body is the outbox's bound, not the caller's.
    assert keyword_options(hint) == accepted - {"version", "max_body"}


@pytest.mark.parametrize(
    ("arguments", "parts"),
    [
        ({"routing_key": "", "version": 1}, ("routing_key", "1..200 bytes")),
        ({"routing_key": "x" * 201, "version": 1}, ("routing_key", "201 bytes")),
        ({"routing_key": "out", "version": 0}, ("version", "1..65535", "int 0")),
        ({"routing_key": "out", "version": 1, "content": "JSON"}, ("content",)),
        ({"routing_key": "out", "version": 1, "content": "text", "payload": int}, ("payload", "json content")),
        ({"routing_key": "out", "version": 1, "payload": object()}, ("payload", "pydantic")),
        ({"routing_key": "out", "version": 1, "exchange": "ex", "declare": True}, ("declare", "default exchange")),
        ({"routing_key": "é" * 96, "version": 1, "declare": True}, ("queue name", "192 bytes")),
    ],
)
def test_sends_is_checked_when_declared(arguments: dict[str, Any], parts: tuple[str, ...]) -> None:
    consumer = Consumer(amqp_url=URL, name="svc")
    refused(lambda: consumer.sends(**arguments), *parts)


def test_the_same_outgoing_message_cannot_be_declared_twice() -> None:
    consumer = Consumer(amqp_url=URL, name="svc")
    consumer.sends("orders.confirmed", version=1)
    consumer.sends("orders.confirmed", version=2)
    refused(lambda: consumer.sends("orders.confirmed", version=1), "declared twice")
    assert [m.version for m in consumer.outgoing] == [1, 2]
