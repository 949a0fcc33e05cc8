"""The HTTP probes a command serves (``/healthz``, ``/readyz``, ``/metrics``), and a free port for them."""

from __future__ import annotations

import socket

import aiohttp


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, str] | None:
    """Status and body, or None while nothing listens."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
            return response.status, await response.text()
    except aiohttp.ClientConnectionError:
        return None


async def answers(session: aiohttp.ClientSession, url: str, status: int = 200) -> bool:
    """Whether ``url`` answers ``status`` now."""
    answer = await get(session, url)
    return answer is not None and answer[0] == status
