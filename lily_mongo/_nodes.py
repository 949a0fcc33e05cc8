"""The nodes of a cluster in one AMQP URL: a comma-separated host list, split and joined. Pure.

``amqp://user:password@host1:5672,host2:5672,host3:5672/vhost?heartbeat=30`` names three
nodes that share everything but their host and port (docs/deployment.md, "Clusters"):
:func:`split_nodes` gives the single-node URLs a connection tries in turn, and
:func:`join_nodes` writes a list of single-node URLs back as one such URL, after checking
that they differ in their host and port only. yarl (what aio-pika and aiormq parse URLs
with) refuses a host list, so it never sees one: each node's URL is an ordinary URL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_NODES", "NodeList", "NodeMismatch", "join_nodes", "split_nodes"]

MAX_NODES = 16


class NodeMismatch(ValueError):
    """A node of a list differs from the first one in more than its host and port."""

    def __init__(self, index: int) -> None:
        super().__init__(f"node {index + 1} differs from node 1 in more than its host and port")
        self.index = index  # in the list, from 0


@dataclass(frozen=True)
class NodeList:
    """An AMQP URL cut around its host list: ``scheme://userinfo@`` + hosts + ``/path?query``."""

    head: str  # "amqp://user:password@" (or "amqp://")
    hosts: tuple[str, ...]  # "host:port" or "host", as written
    tail: str  # "/vhost?query" (or "")

    @classmethod
    def parse(cls, url: str) -> NodeList:
        scheme, sep, rest = url.partition("://")
        if not sep:
            raise ValueError("no scheme")
        end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
        authority, tail = rest[:end], rest[end:]
        userinfo, at, hostlist = authority.rpartition("@")
        hosts = tuple(host.strip() for host in hostlist.split(","))
        if not all(hosts):
            raise ValueError("an empty host in the host list")
        return cls(f"{scheme}://{userinfo}{at}", hosts, tail)

    def node(self, host: str) -> str:
        return f"{self.head}{host}{self.tail}"


def split_nodes(url: str) -> tuple[str, ...]:
    """The single-node URLs of ``url``, in its order (one for a URL with one host).

    Raises ValueError when the host list has an empty entry; each URL returned still has
    to be checked as a URL."""
    if "," not in url:
        return (url,)
    parsed = NodeList.parse(url)
    return tuple(parsed.node(host) for host in parsed.hosts)


def join_nodes(urls: Sequence[str]) -> str:
    """One URL naming the nodes of ``urls`` (single-node URLs), in their order.

    Raises :class:`NodeMismatch` for the first node that differs from the first one in anything
    but its host and port (scheme, user, password, virtual host, options)."""
    first = NodeList.parse(urls[0])
    hosts: list[str] = []
    for index, url in enumerate(urls):
        parsed = NodeList.parse(url)
        if (parsed.head, parsed.tail) != (first.head, first.tail):
            raise NodeMismatch(index)
        hosts.extend(parsed.hosts)
    return NodeList(first.head, tuple(hosts), first.tail).node(",".join(hosts))
