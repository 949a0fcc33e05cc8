"""The generated AsyncAPI 3.0 document (docs/asyncapi.md), checked against the official JSON Schema.

``asyncapi_document(plan)`` is pure, so every test builds a plan from handlers
defined here and inspects the document: it must validate against the vendored
AsyncAPI 3.0.0 schema, every ``$ref`` in it must resolve inside the document,
and it must describe the plan (one channel per queue, retry bucket and DLQ,
one receive operation per queue, one message per (version, content) with the
payload schema of the handler's model and the envelope headers). Expected
names, addresses and header rules are written out literally from docs/asyncapi.md and docs/settlement.md.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import pytest

from lily_mongo import Bytes, Consumer, Json, RetryPolicy, Text, queue
from lily_mongo._plan.plan import Plan
from lily_mongo.asyncapi import asyncapi_document
from lily_mongo.publisher import BINARY, JSON, TEXT, prepare_publication
from tests.support.asyncapi import resolve, version_and_content

AMQP_URL = "amqp://guest:guest@127.0.0.1/"
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "data" / "asyncapi-3.0.0.schema.json"
ENVELOPE = ("x-lily-event-id", "x-lily-schema-version", "x-lily-content-kind")
FAILURE_HEADERS = ("x-lily-failure-code", "x-lily-failure-reason", "x-lily-failed-queue", "x-lily-failed-at")
# AsyncAPI 3.0.0, Components Object: "objects that MUST use keys that match ^[a-zA-Z0-9\.\-_]+$".
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
COMPONENT_KEY = re.compile(r"^[a-zA-Z0-9.\-_]+$")
Handler = Callable[..., Awaitable[None]]


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return jsonschema.Draft7Validator(schema)


# -- payload models -------------------------------------------------------------------------------


class Address(pydantic.BaseModel):
    street_line: str
    postcode: str


class Customer(pydantic.BaseModel):
    customer_ref: str
    billing_address: Address


class Line(pydantic.BaseModel):
    sku: str
    quantity: int = pydantic.Field(gt=0)


class OrderV1(pydantic.BaseModel):
    order_id: str
    customer: Customer
    lines: list[Line]


class OrderV2(pydantic.BaseModel):
    order_id: str
    total_cents: int


class Node(pydantic.BaseModel):
    label: str
    children: list[Node] = []


def _basket_v1() -> type[pydantic.BaseModel]:
    class Item(pydantic.BaseModel):
        sku: str

    class Basket(pydantic.BaseModel):
        items: list[Item]

    return Basket


def _basket_v2() -> type[pydantic.BaseModel]:
    class Item(pydantic.BaseModel):  # same model names as version 1, other fields
        product_code: str

    class Basket(pydantic.BaseModel):
        items: list[Item]

    return Basket


BasketV1 = _basket_v1()
BasketV2 = _basket_v2()


# -- helpers --------------------------------------------------------------------------------------


def plan_of(*handlers: Handler, retry: dict[str, RetryPolicy] | None = None, name: str = "svc") -> Plan:
    consumer = Consumer(amqp_url=AMQP_URL, name=name)
    for queue_name, policy in (retry or {}).items():
        consumer.configure_queue(queue_name, retry=policy)
    consumer.include(*handlers)
    return consumer.plan()


def walk_refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from walk_refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk_refs(item)


def assert_refs_resolve(document: dict[str, Any]) -> None:
    unresolved = []
    for ref in walk_refs(document):
        try:
            resolve(document, ref)
        except KeyError as exc:
            unresolved.append(str(exc))
    assert not unresolved, unresolved


def channel_by_address(document: dict[str, Any], address: str) -> dict[str, Any]:
    matches = [c for c in document["channels"].values() if c.get("address") == address]
    assert len(matches) == 1, f"{len(matches)} channels with address {address!r}"
    channel: dict[str, Any] = matches[0]
    return channel


def channel_messages(document: dict[str, Any], address: str) -> list[dict[str, Any]]:
    channel = channel_by_address(document, address)
    return [resolve(document, ref["$ref"]) if "$ref" in ref else ref for ref in channel["messages"].values()]


def payload_validator(document: dict[str, Any], message_ref: str) -> jsonschema.Draft7Validator:
    """A validator for one message's payload that resolves ``#/components/...`` inside ``document``."""
    return jsonschema.Draft7Validator({**document, "$ref": f"{message_ref}/payload"})


def sample_headers(**overrides: object) -> dict[str, object]:
    headers: dict[str, object] = {
        "x-lily-event-id": str(uuid.uuid4()),
        "x-lily-schema-version": "1",
        "x-lily-content-kind": "json",
    }
    headers.update(overrides)
    return {k: v for k, v in headers.items() if v is not None}


# -- a plan with several queues, versions and contents -------------------------------------------

ORDERS = "shop.orders.created"
FILES = "shop.files"


def shop_plan() -> Plan:
    @queue(ORDERS, version=1, content="json")
    async def order_v1(order: Json[OrderV1]) -> None:
        pass

    @queue(ORDERS, version=2, content="json")
    async def order_v2(order: Json[OrderV2]) -> None:
        pass

    @queue(ORDERS, version=2, content="text")
    async def order_v2_text(note: Text) -> None:
        pass

    @queue(FILES, version=3, content="binary")
    async def file_v3(blob: Bytes) -> None:
        pass

    return plan_of(
        order_v1,
        order_v2,
        order_v2_text,
        file_v3,
        retry={
            ORDERS: RetryPolicy(max_retries=3, delays=(0.5, 2.0)),  # delays used: 0.5, 2, 2 -> two buckets
            FILES: RetryPolicy(max_retries=0, delays=()),  # no buckets
        },
    )


@pytest.fixture(scope="module")
def shop() -> dict[str, Any]:
    return asyncapi_document(shop_plan())


# -- tests ----------------------------------------------------------------------------------------


def test_document_validates_against_the_official_schema(
    shop: dict[str, Any], validator: jsonschema.Draft7Validator
) -> None:
    validator.validate(shop)
    assert shop["asyncapi"] == "3.0.0"
    assert shop["info"]["title"] == "svc"
    json.dumps(shop)  # plain JSON data, nothing else


def test_every_reference_resolves_inside_the_document(shop: dict[str, Any]) -> None:
    assert sum(1 for _ in walk_refs(shop)) > 0
    assert_refs_resolve(shop)


def test_channels_are_the_queues_their_retry_buckets_and_dlqs(shop: dict[str, Any]) -> None:
    addresses = sorted(c["address"] for c in shop["channels"].values())
    assert addresses == sorted(
        [
            "shop.orders.created",
            "shop.orders.created.retry.0",
            "shop.orders.created.retry.1",
            "shop.orders.created.dlq",
            "shop.files",
            "shop.files.dlq",
        ]
    )


def test_one_receive_operation_per_queue_on_its_channel(shop: dict[str, Any]) -> None:
    operations = list(shop["operations"].values())
    assert len(operations) == 2
    assert {op["action"] for op in operations} == {"receive"}
    by_address = {resolve(shop, op["channel"]["$ref"])["address"]: op for op in operations}
    assert set(by_address) == {ORDERS, FILES}
    for address, operation in by_address.items():
        channel_ref = operation["channel"]["$ref"]
        # AsyncAPI 3: an operation's messages are references into its own channel's messages.
        assert operation["messages"], address
        for message in operation["messages"]:
            assert message["$ref"].startswith(f"{channel_ref}/messages/"), message
            resolve(shop, message["$ref"])
    assert len(by_address[ORDERS]["messages"]) == 3
    assert len(by_address[FILES]["messages"]) == 1


def test_one_message_per_version_and_content(shop: dict[str, Any]) -> None:
    orders = channel_messages(shop, ORDERS)
    assert sorted(version_and_content(m) for m in orders) == [("1", "json"), ("2", "json"), ("2", "text")]
    files = channel_messages(shop, FILES)
    assert [version_and_content(m) for m in files] == [("3", "binary")]
    content_types = {version_and_content(m): m["contentType"] for m in [*orders, *files]}
    assert content_types == {
        ("1", "json"): "application/json",
        ("2", "json"): "application/json",
        ("2", "text"): "text/plain; charset=utf-8",
        ("3", "binary"): "application/octet-stream",
    }


def test_payloads_are_the_handler_schemas(shop: dict[str, Any]) -> None:
    payloads = {version_and_content(m): m["payload"] for m in channel_messages(shop, ORDERS)}
    assert set(payloads[("2", "json")]["properties"]) == {"order_id", "total_cents"}
    assert set(payloads[("2", "json")]["required"]) == {"order_id", "total_cents"}
    assert set(payloads[("1", "json")]["properties"]) == {"order_id", "customer", "lines"}
    assert payloads[("2", "text")]["type"] == "string"
    (file_message,) = channel_messages(shop, FILES)
    assert file_message["payload"]["type"] == "string"


def test_nested_model_definitions_move_to_components_schemas(shop: dict[str, Any]) -> None:
    (v1,) = [m for m in channel_messages(shop, ORDERS) if version_and_content(m) == ("1", "json")]
    customer_ref = v1["payload"]["properties"]["customer"]["$ref"]
    assert customer_ref.startswith("#/components/schemas/")
    customer = resolve(shop, customer_ref)
    assert set(customer["properties"]) == {"customer_ref", "billing_address"}
    address = resolve(shop, customer["properties"]["billing_address"]["$ref"])
    assert set(address["properties"]) == {"street_line", "postcode"}
    line = resolve(shop, v1["payload"]["properties"]["lines"]["items"]["$ref"])
    assert set(line["properties"]) == {"sku", "quantity"}
    for message in shop["components"]["messages"].values():
        assert "$defs" not in message["payload"]
    assert all(ref.startswith(("#/components/", "#/channels/")) for ref in walk_refs(shop))
    assert all(COMPONENT_KEY.match(key) for key in shop["components"]["schemas"])


def test_payload_schema_with_references_accepts_and_rejects_instances(shop: dict[str, Any]) -> None:
    (v1_ref,) = [
        ref["$ref"]
        for ref in channel_by_address(shop, ORDERS)["messages"].values()
        if version_and_content(resolve(shop, ref["$ref"])) == ("1", "json")
    ]
    check = payload_validator(shop, v1_ref)
    good: dict[str, Any] = {
        "order_id": "o-1",
        "customer": {"customer_ref": "c-9", "billing_address": {"street_line": "1 Main St", "postcode": "12345"}},
        "lines": [{"sku": "SKU-1", "quantity": 2}],
    }
    check.validate(good)
    no_postcode = copy.deepcopy(good)
    del no_postcode["customer"]["billing_address"]["postcode"]
    with pytest.raises(jsonschema.ValidationError, match="postcode"):
        check.validate(no_postcode)
    zero_quantity = copy.deepcopy(good)
    zero_quantity["lines"][0]["quantity"] = 0
    with pytest.raises(jsonschema.ValidationError):
        check.validate(zero_quantity)


def test_self_referencing_model_resolves(validator: jsonschema.Draft7Validator) -> None:
    @queue("tree.events", version=1, content="json")
    async def on_tree(tree: Json[Node]) -> None:
        pass

    document = asyncapi_document(plan_of(on_tree))
    validator.validate(document)
    assert_refs_resolve(document)
    (message_ref,) = [ref["$ref"] for ref in channel_by_address(document, "tree.events")["messages"].values()]
    check = payload_validator(document, message_ref)
    check.validate({"label": "root", "children": [{"label": "leaf", "children": []}]})
    with pytest.raises(jsonschema.ValidationError):
        check.validate({"label": "root", "children": [{"children": []}]})


def test_work_queue_messages_require_the_envelope_headers(shop: dict[str, Any]) -> None:
    for message in [*channel_messages(shop, ORDERS), *channel_messages(shop, FILES)]:
        assert set(ENVELOPE) <= set(message["headers"]["required"]), message["name"]


def test_header_schema_follows_the_envelope_contract(shop: dict[str, Any]) -> None:
    (v1,) = [m for m in channel_messages(shop, ORDERS) if version_and_content(m) == ("1", "json")]
    check = jsonschema.Draft7Validator(v1["headers"])
    check.validate(sample_headers())
    check.validate(sample_headers(**{"x-retry-count": 100}))
    check.validate(sample_headers(**{"x-retry-count": 0}))
    rejected = [
        sample_headers(**{"x-lily-event-id": None}),
        sample_headers(**{"x-lily-schema-version": None}),
        sample_headers(**{"x-lily-content-kind": None}),
        sample_headers(**{"x-lily-event-id": str(uuid.uuid4()).upper()}),
        sample_headers(**{"x-lily-event-id": "not-a-uuid"}),
        sample_headers(**{"x-lily-schema-version": "01"}),
        sample_headers(**{"x-lily-schema-version": 1}),
        sample_headers(**{"x-lily-schema-version": "2"}),  # this message is version 1
        sample_headers(**{"x-lily-content-kind": "text"}),  # this message is json
        sample_headers(**{"x-retry-count": 101}),
        sample_headers(**{"x-retry-count": -1}),
        sample_headers(**{"x-retry-count": "1"}),
    ]
    for headers in rejected:
        assert not check.is_valid(headers), headers


def test_headers_and_content_type_written_by_the_publisher_match_the_document(shop: dict[str, Any]) -> None:
    orders = {version_and_content(m): m for m in channel_messages(shop, ORDERS)}
    (files,) = channel_messages(shop, FILES)
    order = {
        "order_id": "o-1",
        "customer": {"customer_ref": "c-1", "billing_address": {"street_line": "1 Main St", "postcode": "1"}},
        "lines": [{"sku": "SKU-1", "quantity": 1}],
    }
    cases = [
        (orders[("1", "json")], prepare_publication(JSON, ORDERS, order, version=1, retry_count=3)),
        (orders[("2", "text")], prepare_publication(TEXT, ORDERS, "a note", version=2)),
        (files, prepare_publication(BINARY, FILES, b"\x00\x01", version=3, traceparent=TRACEPARENT)),
    ]
    for message, publication in cases:
        jsonschema.Draft7Validator(message["headers"]).validate(dict(publication.headers))
        assert message["contentType"] == publication.content_type


def test_retry_buckets_carry_the_work_queue_messages(shop: dict[str, Any]) -> None:
    work = sorted(version_and_content(m) for m in channel_messages(shop, ORDERS))
    for bucket in ("shop.orders.created.retry.0", "shop.orders.created.retry.1"):
        assert sorted(version_and_content(m) for m in channel_messages(shop, bucket)) == work


def library_copy(**overrides: object) -> dict[str, object]:
    headers: dict[str, object] = {
        "x-lily-failure-code": "ORDER_INVALID",
        "x-lily-failure-reason": "no lines",
        "x-lily-failed-queue": ORDERS,
        "x-lily-failed-at": "2025-01-01T12:00:00.123+00:00",
    }
    headers.update(overrides)
    return {k: v for k, v in headers.items() if v is not None}


def broker_dead_letter(**overrides: object) -> dict[str, object]:
    death = {"count": 1, "reason": "rejected", "queue": ORDERS, "time": "2025-01-01T12:00:00+00:00", "exchange": ""}
    return {"x-death": [{**death, "routing-keys": [ORDERS]}], **overrides}


def test_dlq_message_accepts_both_kinds_of_dead_letter_whatever_the_envelope(shop: dict[str, Any]) -> None:
    (message,) = channel_messages(shop, "shop.orders.created.dlq")
    check = jsonschema.Draft7Validator(message["headers"])
    accepted = [
        {**sample_headers(), **library_copy(**{"x-retry-count": 2})},
        # Copies of messages refused for their envelope: it is missing or invalid, and kept as it was.
        library_copy(**{"x-lily-failure-code": "QUEUE_ENVELOPE_INVALID"}),
        {**library_copy(), "x-lily-event-id": "order-7", "x-lily-schema-version": 1},
        {**library_copy(), "x-lily-event-id": str(uuid.uuid4()).upper()},
        # The original, dead-lettered by the broker, with whatever headers it had.
        broker_dead_letter(**sample_headers()),
        broker_dead_letter(**{"x-lily-failure-code": "FORGED", "x-retry-count": "1"}),
    ]
    for headers in accepted:
        check.validate(headers)


def test_dlq_message_refuses_what_no_path_produces(shop: dict[str, Any]) -> None:
    (message,) = channel_messages(shop, "shop.orders.created.dlq")
    check = jsonschema.Draft7Validator(message["headers"])
    refused = [
        sample_headers(),  # neither the failure headers nor x-death
        library_copy(**{"x-lily-failed-at": None}),
        library_copy(**{"x-lily-failed-queue": "another.queue"}),
        library_copy(**{"x-lily-failure-reason": "line\nbreak"}),  # reasons are printable ASCII
        library_copy(**{"x-lily-failure-code": "C" * 65}),
        library_copy(**{"x-retry-count": 101}),
        {"x-death": []},
        {"x-death": [{"count": 1}]},
    ]
    for headers in refused:
        assert not check.is_valid(headers), headers


def test_unsafe_queue_names_get_sanitized_ids_and_keep_their_address(
    validator: jsonschema.Draft7Validator,
) -> None:
    name = "billing events/eu:west #1"

    @queue(name, version=1, content="json")
    async def on_billing(order: Json[OrderV2]) -> None:
        pass

    document = asyncapi_document(plan_of(on_billing, retry={name: RetryPolicy(max_retries=1, delays=(1.0,))}))
    validator.validate(document)
    assert_refs_resolve(document)
    addresses = {c["address"] for c in document["channels"].values()}
    assert addresses == {name, f"{name}.retry.0", f"{name}.dlq"}
    for key in [*document["channels"], *document["operations"], *document["components"]["messages"]]:
        assert COMPONENT_KEY.match(key), key
    (operation,) = document["operations"].values()
    assert resolve(document, operation["channel"]["$ref"])["address"] == name


def test_non_ascii_queue_names_get_ascii_component_keys(validator: jsonschema.Draft7Validator) -> None:
    name = "commandes.créées"

    @queue(name, version=1, content="json")
    async def on_commande(order: Json[OrderV2]) -> None:
        pass

    document = asyncapi_document(plan_of(on_commande))
    validator.validate(document)
    assert channel_by_address(document, name)["address"] == name
    keys = [*document["channels"], *document["operations"], *document["components"]["messages"]]
    assert [k for k in keys if not COMPONENT_KEY.match(k)] == []


def test_queues_whose_sanitized_names_collide_keep_separate_channels() -> None:
    @queue("audit events", version=1, content="json")
    async def on_spaced(order: Json[OrderV2]) -> None:
        pass

    @queue("audit_events", version=1, content="json")
    async def on_underscored(order: Json[OrderV1]) -> None:
        pass

    document = asyncapi_document(plan_of(on_spaced, on_underscored))
    addresses = {c["address"] for c in document["channels"].values()}
    assert {"audit events", "audit_events", "audit events.dlq", "audit_events.dlq"} <= addresses
    assert len(document["operations"]) == 2
    spaced = channel_messages(document, "audit events")
    assert set(spaced[0]["payload"]["properties"]) == {"order_id", "total_cents"}


def test_same_named_nested_models_in_two_versions_stay_distinct() -> None:
    @queue("baskets", version=1, content="json")
    async def on_v1(basket: Json[BasketV1]) -> None:  # type: ignore[valid-type]  # a class made at run time
        pass

    @queue("baskets", version=2, content="json")
    async def on_v2(basket: Json[BasketV2]) -> None:  # type: ignore[valid-type]  # a class made at run time
        pass

    document = asyncapi_document(plan_of(on_v1, on_v2))
    refs = {
        version_and_content(resolve(document, r["$ref"])): r["$ref"]
        for r in channel_by_address(document, "baskets")["messages"].values()
    }
    payload_validator(document, refs[("2", "json")]).validate({"items": [{"product_code": "P-1"}]})
    payload_validator(document, refs[("1", "json")]).validate({"items": [{"sku": "SKU-1"}]})


def test_title_and_version_options_go_to_info() -> None:
    document = asyncapi_document(shop_plan(), title="Shop", version="2.3.4")
    assert document["info"]["title"] == "Shop"
    assert document["info"]["version"] == "2.3.4"


def test_document_is_deterministic_and_leaves_the_plan_alone() -> None:
    plan = shop_plan()
    handlers_before = plan.handlers
    first = asyncapi_document(plan)
    second = asyncapi_document(plan)
    assert first == second
    assert plan.handlers == handlers_before
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda d: d.pop("asyncapi"), id="no-asyncapi-field"),
        pytest.param(lambda d: d.update(asyncapi="2.6.0"), id="wrong-asyncapi-version"),
        pytest.param(lambda d: d.pop("info"), id="no-info"),
        pytest.param(lambda d: next(iter(d["operations"].values())).update(action="bogus"), id="bogus-action"),
        pytest.param(lambda d: next(iter(d["channels"].values())).update(address=42), id="numeric-address"),
        pytest.param(lambda d: d.update(unknown_root_field=True), id="unknown-root-field"),
    ],
)
def test_validator_rejects_broken_documents(
    shop: dict[str, Any], validator: jsonschema.Draft7Validator, mutate: Callable[[dict[str, Any]], object]
) -> None:
    broken = copy.deepcopy(shop)
    mutate(broken)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


# -- outgoing messages: send operations -----------------------------------------------------------


class OrderConfirmed(pydantic.BaseModel):
    order_id: str
    lines: list[Line]


def follow(document: dict[str, Any], ref: str) -> dict[str, Any]:
    """Resolve ``ref``, and the reference found there, until a definition is reached."""
    node: dict[str, Any] = resolve(document, ref)
    while "$ref" in node:
        node = resolve(document, node["$ref"])
    return node


def consumer_with_outgoing() -> Consumer:
    @queue(ORDERS, version=1, content="json")
    async def order_v1(order: Json[OrderV1]) -> None:
        pass

    consumer = Consumer(amqp_url=AMQP_URL, name="svc")
    consumer.include(order_v1)
    consumer.sends("orders.confirmed", version=1, payload=OrderConfirmed)
    consumer.sends("orders.confirmed", version=2, content="text")
    consumer.sends("audit", version=1, content="binary", exchange="events")
    return consumer


def test_declared_outgoing_messages_are_send_operations(validator: jsonschema.Draft7Validator) -> None:
    consumer = consumer_with_outgoing()
    document = asyncapi_document(consumer.plan(), outgoing=consumer.outgoing)
    validator.validate(document)
    assert_refs_resolve(document)
    sends = {key: op for key, op in document["operations"].items() if op["action"] == "send"}
    assert sorted(sends) == ["send.events.audit", "send.orders.confirmed"]
    confirmed = resolve(document, sends["send.orders.confirmed"]["channel"]["$ref"])
    assert confirmed["address"] == "orders.confirmed"
    by_version = {
        version_and_content(follow(document, ref["$ref"])): follow(document, ref["$ref"])
        for ref in sends["send.orders.confirmed"]["messages"]
    }
    assert sorted(by_version) == [("1", "json"), ("2", "text")]
    assert by_version[("1", "json")]["contentType"] == "application/json"
    assert by_version[("2", "text")]["contentType"] == "text/plain; charset=utf-8"
    assert by_version[("2", "text")]["payload"] == {"type": "string"}
    audit = resolve(document, sends["send.events.audit"]["channel"]["$ref"])
    assert audit["address"] == "audit"
    assert "exchange events" in audit["description"]
    (blob,) = [follow(document, ref["$ref"]) for ref in sends["send.events.audit"]["messages"]]
    assert blob["contentType"] == "application/octet-stream"
    assert blob["payload"] == {"type": "string", "format": "binary"}


def test_an_outgoing_payload_schema_checks_what_the_outbox_would_publish() -> None:
    consumer = consumer_with_outgoing()
    document = asyncapi_document(consumer.plan(), outgoing=consumer.outgoing)
    ref = "#/components/messages/send.orders.confirmed.v1.json"
    check = payload_validator(document, ref)
    check.validate({"order_id": "o-1", "lines": [{"sku": "S-1", "quantity": 2}]})
    assert not check.is_valid({"order_id": "o-1", "lines": [{"sku": "S-1", "quantity": 0}]})
    publication = prepare_publication(JSON, "orders.confirmed", {"order_id": "o-1", "lines": []}, version=1)
    jsonschema.Draft7Validator(resolve(document, ref)["headers"]).validate(dict(publication.headers))


def test_without_declarations_there_is_no_send_operation(shop: dict[str, Any]) -> None:
    assert {op["action"] for op in shop["operations"].values()} == {"receive"}


def test_a_standalone_outbox_declares_its_events_for_the_document(validator: jsonschema.Draft7Validator) -> None:
    from pymongo import AsyncMongoClient

    from lily_mongo import ConfigError, Outbox

    outbox = Outbox(AsyncMongoClient("mongodb://127.0.0.1:27017/", connect=False), "shop", name="web")
    outbox.sends("orders.confirmed", version=1, payload=OrderConfirmed)
    with pytest.raises(ConfigError, match="is declared twice"):
        outbox.sends("orders.confirmed", version=1)
    assert [m.routing_key for m in outbox.outgoing] == ["orders.confirmed"]
    alone = asyncapi_document(None, outgoing=outbox.outgoing, title="web")  # a service that consumes nothing
    validator.validate(alone)
    assert alone["info"]["title"] == "web"
    assert list(alone["operations"]) == ["send.orders.confirmed"]
    consumer = consumer_with_outgoing()
    together = asyncapi_document(consumer.plan(), outgoing=[*consumer.outgoing[1:], *outbox.outgoing])
    validator.validate(together)
    assert "send.orders.confirmed" in together["operations"]
