"""A cluster's nodes in ``amqp_url``: a list of URLs or one URL with a host list, checked and
redacted the same way everywhere a URL is taken (docs/deployment.md, "Clusters"; no servers)."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import AsyncMongoClient

from lily_mongo import ConfigError, Consumer, Outbox, Publisher, Relay
from lily_mongo._checks import check_amqp_url
from lily_mongo._nodes import split_nodes
from lily_mongo._redact import redact_url

THREE = "amqp://app:s3cret@rabbit-1:5672,rabbit-2:5673,rabbit-3/orders?heartbeat=30"
LISTED = [
    "amqp://app:s3cret@rabbit-1:5672/orders?heartbeat=30",
    "amqp://app:s3cret@rabbit-2:5673/orders?heartbeat=30",
    "amqp://app:s3cret@rabbit-3/orders?heartbeat=30",
]


def test_a_host_list_is_cut_into_one_url_per_node_in_its_order() -> None:
    assert split_nodes(THREE) == tuple(LISTED)
    assert split_nodes("amqp://guest:guest@127.0.0.1:5672/") == ("amqp://guest:guest@127.0.0.1:5672/",)


def test_a_list_of_urls_and_a_host_list_are_the_same_setting() -> None:
    assert check_amqp_url("amqp_url", LISTED) == THREE
    assert check_amqp_url("amqp_url", tuple(LISTED)) == THREE
    assert check_amqp_url("amqp_url", THREE) == THREE
    assert check_amqp_url("amqp_url", ["amqp://h/"]) == "amqp://h/"


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([], ["amqp_url", "1..16 node URLs", "list of 0"]),
        (["amqp://h/"] * 17, ["amqp_url", "1..16 node URLs", "list of 17"]),
        ("amqp://" + ",".join(f"h{i}" for i in range(17)) + "/", ["amqp_url", "1..16 nodes", "got 17"]),
        (["amqp://h1/", 5], ["amqp_url[1]", "amqp:// or amqps:// URL", "int"]),
        ("amqp://app:pw@h1,,h2/", ["amqp_url", "with a host", "amqp://app:***@h1,,h2/"]),
        ("amqp://h1:5672,h2:x/", ["amqp_url", "with a host", "h2:x"]),
        ("http://h1,h2/", ["amqp_url", "amqp:// or amqps://", "http://h1,h2/"]),
    ],
)
def test_a_node_list_outside_its_bounds_is_refused_naming_field_value_and_bound(value: Any, words: list[str]) -> None:
    with pytest.raises(ConfigError) as refused:
        check_amqp_url("amqp_url", value)
    for word in words:
        assert word in str(refused.value)


@pytest.mark.parametrize(
    "second",
    [
        "amqp://app:other@rabbit-2/orders?heartbeat=30",  # password
        "amqp://ops:s3cret@rabbit-2/orders?heartbeat=30",  # user
        "amqp://app:s3cret@rabbit-2/billing?heartbeat=30",  # virtual host
        "amqp://app:s3cret@rabbit-2/orders?heartbeat=10",  # options
        "amqps://app:s3cret@rabbit-2/orders?heartbeat=30",  # scheme
    ],
)
def test_listed_nodes_that_differ_in_more_than_host_and_port_are_refused(second: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_amqp_url("amqp_url", [LISTED[0], second])
    text = str(refused.value)
    assert "amqp_url[1] must differ from amqp_url[0] in its host and port only" in text
    assert "s3cret" not in text
    assert "other" not in text
    assert redact_url(second) in text


def test_a_host_list_loses_its_password_and_keeps_every_host() -> None:
    assert redact_url(THREE) == "amqp://app:***@rabbit-1:5672,rabbit-2:5673,rabbit-3/orders?heartbeat=30"


def test_every_url_taking_api_takes_a_node_list() -> None:
    consumer = Consumer(amqp_url=LISTED, name="orders")
    assert consumer.settings.amqp_url == THREE
    assert "s3cret" not in repr(consumer)
    assert "rabbit-3" in repr(consumer)
    Publisher(LISTED)
    client: AsyncMongoClient[Any] = AsyncMongoClient("mongodb://127.0.0.1:1/", connect=False)
    Outbox(client, "shop", amqp_url=LISTED)
    Relay(client, "shop", amqp_url=THREE)
    with pytest.raises(ConfigError, match=r"amqp_url\[0\]"):
        Relay(client, "shop", amqp_url=["mongodb://x/"])
    with pytest.raises(ConfigError, match=r"amqp_url\[1\]"):
        Publisher([LISTED[0], "amqp://app:x@rabbit-2/orders"])
