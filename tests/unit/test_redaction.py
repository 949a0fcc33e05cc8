"""Credentials never shown: URLs are redacted with the parser that connects with them (no servers)."""

from __future__ import annotations

import pytest

from lily_mongo import Consumer
from lily_mongo._redact import redact_url, scrub


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("amqp://app:P@ssw0rd@127.0.0.1:5999/", "amqp://app:***@127.0.0.1:5999/"),
        ("amqp://app:a:b@c@rabbit:5672/orders?heartbeat=30", "amqp://app:***@rabbit:5672/orders?heartbeat=30"),
        ("amqps://app:p%40ss@rabbit/", "amqps://app:***@rabbit/"),
        ("amqp://guest:guest@127.0.0.1/", "amqp://guest:***@127.0.0.1/"),
        ("amqp://:only-a-password@rabbit/", "amqp://:***@rabbit/"),
        ("amqp://rabbit:5672/", "amqp://rabbit:5672/"),
        ("amqp://app@rabbit/", "amqp://app@rabbit/"),
        # Not parseable as a URL (an unescaped '/' or '?' in the password): everything before the last '@' goes.
        ("amqp://app:pa/ss@rabbit/", "amqp://***@rabbit/"),
        ("amqp://app:pa?ss@rabbit/", "amqp://***@rabbit/"),
    ],
)
def test_amqp_urls_lose_the_whole_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        (
            "mongodb://app:P@ssw0rd@db1:27017,db2/shop?replicaSet=rs0",
            "mongodb://app:***@db1:27017,db2/shop?replicaSet=rs0",
        ),
        ("mongodb+srv://app:s3cret@cluster.example.com/", "mongodb+srv://app:***@cluster.example.com/"),
        ("mongodb://127.0.0.1:27017/", "mongodb://127.0.0.1:27017/"),
        (
            "mongodb://h/?authMechanism=MONGODB-AWS&authMechanismProperties=AWS_SESSION_TOKEN:tok",
            "mongodb://h/?authMechanism=MONGODB-AWS&authMechanismProperties=***",
        ),
        (
            "mongodb://h/?tls=true&tlsCertificateKeyFilePassword=pem-secret",
            "mongodb://h/?tls=true&tlsCertificateKeyFilePassword=***",
        ),
    ],
)
def test_mongodb_uris_lose_the_whole_password(uri: str, shown: str) -> None:
    assert redact_url(uri) == shown


def test_consumer_repr_hides_a_password_that_contains_an_at_sign() -> None:
    consumer = Consumer(amqp_url="amqp://app:P@ssw0rd@127.0.0.1:5999/", name="orders")
    assert repr(consumer) == "<Consumer name='orders' amqp='amqp://app:***@127.0.0.1:5999/' state=new>"


def test_scrub_removes_the_password_from_a_library_message_in_every_spelling() -> None:
    url = "amqp://app:P@ss w0rd@rabbit/"
    text = f"failed: {url} (P@ss w0rd, P%40ss%20w0rd)"
    assert scrub(text, url) == "failed: amqp://app:***@rabbit/ (***, ***)"
