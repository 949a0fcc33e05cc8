"""The AMQP wire layer: how the package reads, settles and publishes frames through aiormq.

One module per concern, lowest first:

* :mod:`.acks`: which ACK frames a flush writes (pure);
* :mod:`.codec`: the frame layouts (basic.deliver, content header, field table),
  each walked by one function, strictly (the direct decoding) or leniently;
* :mod:`.errors`: the table mapping AMQP client errors to lily errors;
* :mod:`.properties`: the message properties lily writes (LongInt retry counts);
* :mod:`.lenient`: the lenient frame reader between a connection's socket and its receiver;
* :mod:`.receiver`: lily's frame receiver (whole frames, hot ones decoded directly);
* :mod:`.coalescer`: one consuming channel's ACK frames, coalesced;
* :mod:`.inbound`: one consumed delivery as the engine reads and settles it;
* :mod:`.publishing`: mandatory, confirmed publishes, and copies of a delivery;
* :mod:`.patches`: every reach into aiormq's, aio-pika's and asyncio's internals,
  behind one version check with a stock fallback;
* :mod:`.connections`: opening connections, and what a refused one says.
"""

from __future__ import annotations

from .coalescer import AckCoalescer
from .connections import LenientTransport, connect_amqp, connected_node, frame_path
from .errors import AMQP_ERRORS, AmqpFailure, amqp_failure, channel_errors, map_amqp_errors
from .inbound import AmqpMessage
from .lenient import MALFORMED_HEADER, LenientFrameReader
from .patches import connection_unblocked, unbounded_frame_queue
from .properties import LONG_INT_HEADERS, LilyProperties, encode_headers_table
from .publishing import basic_publish, publish_properties, republish

__all__ = [
    "AMQP_ERRORS",
    "LONG_INT_HEADERS",
    "MALFORMED_HEADER",
    "AckCoalescer",
    "AmqpFailure",
    "AmqpMessage",
    "LenientFrameReader",
    "LenientTransport",
    "LilyProperties",
    "amqp_failure",
    "basic_publish",
    "channel_errors",
    "connect_amqp",
    "connected_node",
    "connection_unblocked",
    "encode_headers_table",
    "frame_path",
    "map_amqp_errors",
    "publish_properties",
    "republish",
    "unbounded_frame_queue",
]
