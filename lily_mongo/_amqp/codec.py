"""The AMQP 0-9-1 frame layouts a consumer reads, walked once each: the one home of that knowledge.

Three walkers, each used both ways:

* :func:`read_delivery` reads a ``basic.deliver`` (or a ``basic.get-ok``);
* :func:`read_content_header` reads a content header (its property flags, the
  properties present, in wire order);
* :func:`read_table` reads a field table (the header table, nested tables).

Strict (``problems`` is None), they are the direct decoding of the hot frames:
they build exactly the objects ``pamqp.frame.unmarshal`` builds, attribute for
attribute (``tests/property/test_frame_decoding_props.py`` compares them), and
raise for anything they do not read to the last byte (text that is not UTF-8
included), so that pamqp gets the frame instead. Lenient (``problems`` is a
list), they read text that is not valid UTF-8 with U+FFFD in place of the bad
bytes and append a sentence naming the field to ``problems``: what the lenient
reader (:mod:`lily_mongo._amqp.lenient`) writes into its rewrite of such a frame.
A property-layout cache (:data:`Layouts`, one per connection) remembers, per
property-flags value, the properties present: a queue sees a handful.

pamqp objects are built without their ``__init__`` (which would validate its
defaults first), as pamqp's own unmarshal fills them: through
:data:`lily_mongo._fast.new_instance`.
"""

from __future__ import annotations

import struct
from typing import Any

from pamqp import body as pamqp_body
from pamqp import commands as spec
from pamqp import decode
from pamqp import header as pamqp_header
from pamqp.heartbeat import Heartbeat

from .._fast import new_instance
from .._text import sanitize

__all__ = [
    "DELIVER",
    "FRAME_BODY",
    "FRAME_END",
    "FRAME_HEAD",
    "FRAME_HEADER",
    "FRAME_HEARTBEAT",
    "FRAME_METHOD",
    "FRAME_TYPES",
    "GET_OK",
    "PROPERTY_NAMES",
    "Layouts",
    "Unusual",
    "decode_frame",
    "read_content_header",
    "read_delivery",
    "read_table",
]

FRAME_HEAD = 7  # type (1), channel (2), payload size (4)
FRAME_END = 0xCE
FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_TYPES = frozenset((FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT))
DELIVER = spec.Basic.Deliver.index.to_bytes(4)
GET_OK = spec.Basic.GetOk.index.to_bytes(4)
_DELIVER_ID = DELIVER[3]

# The Basic.Properties layout, in wire order: (name, flag bit, pamqp type name).
_PROPERTIES = tuple(
    (name, spec.Basic.Properties.flags[name], spec.Basic.Properties.amqp_type(name))
    for name in spec.Basic.Properties.attributes()
)
PROPERTY_NAMES: tuple[str, ...] = tuple(name for name, _, _ in _PROPERTIES)
_AMQP_NAMES = {"message_type": "type"}  # pamqp's attribute names that differ from the AMQP property names
_PROPERTY_LABELS = {name: f"property {_AMQP_NAMES.get(name, name)}" for name in PROPERTY_NAMES}

Layouts = dict[int, tuple[tuple[str, str], ...]]
"""Property flags -> (name, type) of each property present, in wire order (one cache per connection)."""

_Deliver = spec.Basic.Deliver
_GetOk = spec.Basic.GetOk
_Properties = spec.Basic.Properties
_ContentHeader = pamqp_header.ContentHeader
_HEADER_HEAD = struct.Struct(">HHQ").unpack_from
# Header table values read here; the rest (floats, decimals, timestamps, byte arrays, unknown
# tags, and arrays when strict) go to pamqp's decoder.
_INT = {
    0x62: struct.Struct(">b").unpack_from,  # b
    0x42: struct.Struct(">B").unpack_from,  # B
    0x73: struct.Struct(">h").unpack_from,  # s
    0x75: struct.Struct(">H").unpack_from,  # u
    0x49: struct.Struct(">l").unpack_from,  # I
    0x69: struct.Struct(">L").unpack_from,  # i
    0x6C: struct.Struct(">q").unpack_from,  # l
    0x4C: struct.Struct(">q").unpack_from,  # L (pamqp reads it signed too)
}
_INT_WIDTH = {0x62: 1, 0x42: 1, 0x73: 2, 0x75: 2, 0x49: 4, 0x69: 4, 0x6C: 8, 0x4C: 8}


class Unusual(ValueError):
    """A frame the strict reading does not read to its last byte: pamqp reads it instead."""


def _repaired(raw: bytes, what: str, problems: list[str] | None) -> str:
    """``raw`` (not valid UTF-8) as text with U+FFFD for its bad bytes, noted in ``problems``;
    strict (``problems`` None) refuses it."""
    if problems is None:
        raise Unusual(f"{what} is not valid UTF-8")
    problems.append(f"{what} is not valid UTF-8")
    text = raw.decode("utf-8", "replace")
    while len(text.encode("utf-8")) > 255:  # still a short string
        text = text[:-1]
    return text


def _short_string(frame: bytes, offset: int, what: str, problems: list[str] | None) -> tuple[str, int]:
    """The short string at ``offset`` of ``frame`` (its length octet first): (its text, its end)."""
    start = offset + 1
    end = start + frame[offset]
    raw = frame[start:end]
    try:
        return raw.decode(), end
    except UnicodeDecodeError:
        return _repaired(raw, what, problems), end


def read_delivery(frame: bytes, problems: list[str] | None = None) -> spec.Basic.Deliver | spec.Basic.GetOk:
    """The ``basic.deliver`` (or ``basic.get-ok``) in the whole method frame ``frame``."""
    consumer_tag: str | None
    if frame[10] == _DELIVER_ID:
        consumer_tag, offset = _short_string(frame, 11, "the consumer tag", problems)
    else:
        consumer_tag = None
        offset = 11
    delivery_tag = int.from_bytes(frame[offset : offset + 8], signed=True)
    redelivered = bool(frame[offset + 8] & 1)
    exchange, end = _short_string(frame, offset + 9, "the exchange name", problems)
    routing_key, end = _short_string(frame, end, "the routing key", problems)
    method: spec.Basic.Deliver | spec.Basic.GetOk
    if consumer_tag is None:
        get_ok = method = new_instance(_GetOk)
        get_ok.message_count = int.from_bytes(frame[end : end + 4], signed=True)
        end += 4
    else:
        deliver = method = new_instance(_Deliver)
        deliver.consumer_tag = consumer_tag
    if end != len(frame) - 1 and problems is None:
        raise Unusual("basic.deliver does not end where its fields do")
    method.delivery_tag = delivery_tag
    method.redelivered = redelivered
    method.exchange = exchange
    method.routing_key = routing_key
    return method


def _layout(flags: int, layouts: Layouts, strict: bool) -> tuple[tuple[str, str], ...]:
    if flags & 1 and strict:
        raise Unusual("a second property flag word")
    layout = layouts[flags & 0xFFFE] = tuple((name, kind) for name, bit, kind in _PROPERTIES if flags & bit)
    return layout


def read_content_header(
    frame: bytes, layouts: Layouts, problems: list[str] | None = None
) -> pamqp_header.ContentHeader:
    """The content header in the whole frame ``frame``, its properties as pamqp reads them."""
    class_id, weight, body_size = _HEADER_HEAD(frame, 7)
    flags = (frame[19] << 8) | frame[20]
    offset = 21
    layout = layouts.get(flags)
    if layout is None:
        layout = _layout(flags, layouts, problems is None)
        word = flags
        while word & 1:  # lenient: skip further flag words (no Basic property lives there)
            word = int.from_bytes(frame[offset : offset + 2])
            offset += 2
    properties: spec.Basic.Properties = new_instance(_Properties)
    # Basic.Properties() without a property: what pamqp starts from.
    properties.content_type = properties.content_encoding = properties.headers = None
    properties.delivery_mode = properties.priority = properties.correlation_id = None
    properties.reply_to = properties.expiration = properties.message_id = None
    properties.timestamp = properties.message_type = properties.user_id = properties.app_id = None
    properties.cluster_id = ""
    limit = len(frame) - 1
    for name, kind in layout:
        value: Any
        if kind == "shortstr":
            value, offset = _short_string(frame, offset, _PROPERTY_LABELS[name], problems)
        elif kind == "table":
            offset, value = read_table(frame, offset, limit, problems)
        elif kind == "octet":
            value = frame[offset]
            offset += 1
        else:
            consumed, value = decode.by_type(frame[offset:limit], kind)
            offset += consumed
        setattr(properties, name, value)
    if offset != limit and (problems is None or offset > limit):
        raise Unusual("the properties do not end where the frame does")
    header: pamqp_header.ContentHeader = new_instance(_ContentHeader)
    header.class_id = class_id
    header.weight = weight
    header.body_size = body_size
    header.properties = properties
    return header


def _name_label(parent: str | None) -> str:
    return "a header name" if parent is None else f"a nested header name in {sanitize(parent, 40)!r}"


def read_table(
    frame: bytes, offset: int, bound: int, problems: list[str] | None = None, parent: str | None = None
) -> tuple[int, dict[str, Any]]:
    """The field table at ``offset`` of ``frame``: (its end, its value). Every value must end inside it.

    ``bound`` is where the enclosing table (or the frame's payload) ends; ``parent`` is the
    name of the entry holding this table (None for the header table itself).
    """
    limit = len(frame) - 1  # pamqp's decoders see the payload from the value on
    start = offset + 4
    end = start + int.from_bytes(frame[offset:start])
    if end > bound:
        raise Unusual("a field table runs past its bound")
    table: dict[str, Any] = {}
    offset = start
    while offset < end:
        start = offset + 1
        offset = start + frame[offset]
        raw = frame[start:offset]
        try:
            key = raw.decode()
        except UnicodeDecodeError:
            key = _repaired(raw, _name_label(parent), problems)
        tag = frame[offset]
        offset += 1
        value: Any
        if tag == 0x53:  # S: long string, bytes when it is not UTF-8 (as pamqp reads it)
            start = offset + 4
            offset = start + int.from_bytes(frame[offset:start])
            raw = frame[start:offset]
            try:
                value = raw.decode()
            except UnicodeDecodeError:
                value = raw
        elif tag in _INT:
            value = _INT[tag](frame, offset)[0]
            offset += _INT_WIDTH[tag]
        elif tag == 0x74:  # t
            value = bool(frame[offset])
            offset += 1
        elif tag == 0x46:  # F
            offset, value = read_table(frame, offset, end, problems, key)
        elif tag == 0x41 and problems is not None:  # A, read leniently: its tables may hold bad names
            offset, value = _read_array(frame, offset, end, problems, key)
        elif tag == 0x56 or tag == 0:  # V and NUL: void
            value = None
        else:
            consumed, value = decode.embedded_value(frame[offset - 1 : limit])
            offset += consumed - 1
        if offset > end:
            raise Unusual("a field table value runs past its table")
        table[key] = value
    if offset != end:
        raise Unusual("a field table does not end where its values do")
    return end, table


def _read_array(frame: bytes, offset: int, bound: int, problems: list[str], parent: str) -> tuple[int, list[Any]]:
    """A field array, read leniently (strict reading leaves arrays to pamqp)."""
    start = offset + 4
    end = start + int.from_bytes(frame[offset:start])
    if end > bound:
        raise Unusual("a field array runs past its bound")
    items: list[Any] = []
    offset = start
    while offset < end:
        tag = frame[offset]
        item: Any
        if tag == 0x46:  # F
            offset, item = read_table(frame, offset + 1, end, problems, parent)
        elif tag == 0x41:  # A
            offset, item = _read_array(frame, offset + 1, end, problems, parent)
        else:
            consumed, item = decode.embedded_value(frame[offset : len(frame) - 1])
            offset += consumed
        items.append(item)
    if offset != end:
        raise Unusual("a field array does not end where its values do")
    return end, items


def decode_frame(frame: bytes, layouts: Layouts) -> tuple[int, int, Any] | None:
    """``pamqp.frame.unmarshal(frame)`` for the frames a consumer sees all the time, read directly:
    basic.deliver, content headers, bodies, heartbeats. None for any other frame; raises for a
    frame it does not read to the last byte (either way, pamqp's reading is the one that counts)."""
    size = len(frame)
    if frame[-1] != FRAME_END or int.from_bytes(frame[3:7]) != size - 8:
        return None
    kind = frame[0]
    channel = (frame[1] << 8) | frame[2]
    if kind == FRAME_BODY:
        return (size, channel, pamqp_body.ContentBody(frame[7:-1])) if size > 8 else None
    if kind == FRAME_HEADER:
        return (size, channel, read_content_header(frame, layouts)) if size > 8 else None
    if kind == FRAME_METHOD:
        if frame[7:11] != DELIVER:
            return None
        return size, channel, read_delivery(frame)
    if kind == FRAME_HEARTBEAT and size == 8:
        return 8, channel, Heartbeat()
    return None
