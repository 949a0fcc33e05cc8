"""Publisher preparation and error mapping (no broker)."""

from __future__ import annotations

import uuid
from typing import Any

import aiormq.exceptions
import pydantic
import pytest
from pamqp import commands as spec

from lily_mongo import ConfigError, CustomPublishContent, PublishError
from lily_mongo._amqp import basic_publish
from lily_mongo.publisher import JSON, TEXT, prepare_publication


class Order(pydantic.BaseModel):
    order_id: str
    cents: int


def test_json_publication_has_canonical_headers_and_mime() -> None:
    event = uuid.UUID("0f8fad5b-d9cb-469f-a165-70867728950e")
    publication = prepare_publication(JSON, "orders", Order(order_id="a", cents=5), version=7, event_id=event)
    assert publication.body == b'{"order_id":"a","cents":5}'
    assert publication.content_type == "application/json"
    assert publication.headers == {
        "x-lily-event-id": "0f8fad5b-d9cb-469f-a165-70867728950e",
        "x-lily-schema-version": "7",
        "x-lily-content-kind": "json",
    }
    assert publication.event_id == event


def test_event_id_is_generated_when_absent_and_is_a_fresh_uuid4() -> None:
    first = prepare_publication(TEXT, "q", "a", version=1).event_id
    second = prepare_publication(TEXT, "q", "a", version=1).event_id
    assert first != second
    assert first.version == 4


def test_event_id_text_must_be_canonical() -> None:
    with pytest.raises(ConfigError, match="event_id"):
        prepare_publication(TEXT, "q", "a", version=1, event_id="0F8FAD5B-D9CB-469F-A165-70867728950E")


def test_nil_event_id_is_refused() -> None:
    with pytest.raises(ConfigError, match="nil"):
        prepare_publication(TEXT, "q", "a", version=1, event_id=uuid.UUID(int=0))


@pytest.mark.parametrize("version", [0, 65536, -1, True, "1", 1.0])
def test_version_outside_1_to_65535_is_refused(version: Any) -> None:
    with pytest.raises(ConfigError, match=r"version must be an integer 1\.\.65535"):
        prepare_publication(TEXT, "q", "a", version=version)


@pytest.mark.parametrize("key", ["x-lily-event-id", "x-lily-anything", "x-retry-count"])
def test_reserved_headers_cannot_be_set_through_headers(key: str) -> None:
    with pytest.raises(ConfigError, match="reserved header"):
        prepare_publication(TEXT, "q", "a", version=1, headers={key: "x"})


def test_retry_count_keyword_is_validated_like_a_consumer_would() -> None:
    assert prepare_publication(TEXT, "q", "a", version=1, retry_count=100).headers["x-retry-count"] == 100
    with pytest.raises(ConfigError, match="x-retry-count"):
        prepare_publication(TEXT, "q", "a", version=1, retry_count=101)


def test_body_over_the_bound_is_refused_before_publishing() -> None:
    with pytest.raises(ConfigError, match="QUEUE_BODY_TOO_LARGE"):
        prepare_publication(TEXT, "q", "ab", version=1, max_body=1)


def test_routing_key_over_200_bytes_is_refused() -> None:
    prepare_publication(TEXT, "é" * 100, "a", version=1)
    with pytest.raises(ConfigError, match=r"routing_key .* is 202 bytes, outside 1\.\.200 bytes"):
        prepare_publication(TEXT, "é" * 101, "a", version=1)


def test_custom_content_needs_a_canonical_token() -> None:
    avro: CustomPublishContent[bytes] = CustomPublishContent(
        kind="avro.v2", content_type="application/avro", encode=lambda v: bytes(v)
    )
    assert prepare_publication(avro, "q", b"\x01", version=1).headers["x-lily-content-kind"] == "avro.v2"
    with pytest.raises(ConfigError, match="kind"):
        CustomPublishContent(kind="Avro", content_type="application/avro", encode=lambda v: bytes(v))
    with pytest.raises(ConfigError, match="content_type"):
        CustomPublishContent(kind="avro", content_type="", encode=lambda v: bytes(v))


def test_text_payload_must_be_str() -> None:
    with pytest.raises(ConfigError, match="text payload must be a str"):
        prepare_publication(TEXT, "q", b"bytes", version=1)  # type: ignore[misc]  # bytes for text, on purpose


class _Channel:
    """Stands in for an aiormq channel: returns or raises what the broker would."""

    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome
        self.calls: list[dict[str, Any]] = []

    async def basic_publish(self, body: bytes, **kwargs: Any) -> Any:
        self.calls.append({"body": body, **kwargs})
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


async def _publish(channel: _Channel) -> None:
    await basic_publish(
        channel,  # type: ignore[arg-type]
        exchange="",
        routing_key="q",
        body=b"x",
        headers={"x-retry-count": 1},
        content_type="text/plain",
        timeout=0.5,
    )


async def test_confirmed_publish_is_mandatory_with_a_fresh_message_id() -> None:
    channel = _Channel(spec.Basic.Ack(delivery_tag=1))
    await _publish(channel)
    await _publish(channel)
    assert all(call["mandatory"] is True for call in channel.calls)
    ids = [call["properties"].message_id for call in channel.calls]
    assert len(set(ids)) == 2


@pytest.mark.parametrize(
    ("outcome", "kind"),
    [
        (TimeoutError(), "timeout"),
        (aiormq.exceptions.DeliveryError(None, spec.Basic.Nack(delivery_tag=1)), "nacked"),
        (aiormq.exceptions.ChannelInvalidStateError("closed"), "closed"),
        (ConnectionResetError(), "closed"),
        (None, "nacked"),
    ],
)
async def test_publish_failures_map_to_publish_error(outcome: Any, kind: str) -> None:
    with pytest.raises(PublishError) as caught:
        await _publish(_Channel(outcome))
    assert caught.value.kind == kind
