"""Reading AsyncAPI documents: local references, a message's version and content kind."""

from __future__ import annotations

from typing import Any


def resolve(document: dict[str, Any], ref: str) -> Any:
    """Follow a local JSON pointer (RFC 6901) inside ``document``; KeyError when it points nowhere."""
    assert ref.startswith("#/"), f"not a local reference: {ref!r}"
    node: Any = document
    for token in ref[2:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            node = node[int(token)]
        elif isinstance(node, dict) and token in node:
            node = node[token]
        else:
            raise KeyError(f"{ref!r} does not resolve (missing {token!r})")
    return node


def version_and_content(message: dict[str, Any]) -> tuple[str, str]:
    """A message's (schema version, content kind), from the constants of its header schema."""
    properties = message["headers"]["properties"]
    return properties["x-lily-schema-version"]["const"], properties["x-lily-content-kind"]["const"]
