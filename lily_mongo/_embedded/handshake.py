"""``hello`` as a replica set's primary: the embedded server runs transactions, which MongoDB runs only there.

mongoeco's ``hello`` describes a standalone server (no ``setName``) yet the server
accepts transactions; a standalone MongoDB refuses them (IllegalOperation). Here it
answers as the one member and primary of a replica set (docs/emulator.md, "hello"):
``setName``, ``hosts``, ``primary`` and ``me`` naming the address the client reached
it at, so that a driver discovering the set from a plain URI
(``mongodb://127.0.0.1:27017/``) finds the member it already talks to;
``directConnection=true`` and ``replicaSet=<the set's name>`` work too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from bson import ObjectId
from mongoeco.wire._executor_handlers import WireSpecialCommandHandlers

__all__ = ["SET_NAME", "ReplicaSetHandlers"]

SET_NAME: Final = "lily-embedded"  # the replica set name, for URIs that give one (`replicaSet=lily-embedded`)
_ELECTION: Final = ObjectId("7fffffff0000000000000001")  # one primary, never re-elected


class ReplicaSetHandlers(WireSpecialCommandHandlers):
    """mongoeco's special commands, with ``hello`` (and ``isMaster``) as a replica set primary's."""

    def __init__(self, *, member: Callable[[Any], str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._member = member

    async def _handle_handshake(self, context: Any) -> dict[str, object]:
        response: dict[str, object] = await super()._handle_handshake(context)
        me = self._member(context.connection)
        response.update(
            setName=SET_NAME,
            setVersion=1,
            electionId=_ELECTION,
            hosts=[me],
            primary=me,
            me=me,
            secondary=False,
        )
        return response
