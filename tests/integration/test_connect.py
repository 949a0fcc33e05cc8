"""What a refused AMQP connection says: which party refused, never the password (real broker)."""

from __future__ import annotations

import pytest
from yarl import URL

from lily_mongo import Publisher, TransportError


async def refusal(url: str) -> str:
    with pytest.raises(TransportError) as caught:
        async with Publisher(url):
            pass
    return str(caught.value)


async def test_a_closed_port_is_not_reachable_and_a_password_with_at_signs_stays_hidden() -> None:
    message = await refusal("amqp://app:P@ssw0rd@127.0.0.1:1/")
    assert message == "RabbitMQ is not reachable at amqp://app:***@127.0.0.1:1/ (connection refused)"


async def test_bad_credentials_are_a_refused_login_not_an_unreachable_broker(amqp: str) -> None:
    url = str(URL(amqp).with_password("not-the-password"))
    message = await refusal(url)
    assert "refused the login" in message
    assert "not reachable" not in message
    assert "not-the-password" not in message


async def test_a_missing_virtual_host_is_named_without_a_frame_object(amqp: str) -> None:
    url = str(URL(amqp).with_path("/no-such-vhost-here"))
    message = await refusal(url)
    assert "refused to open virtual host 'no-such-vhost-here'" in message
    assert "object at 0x" not in message
