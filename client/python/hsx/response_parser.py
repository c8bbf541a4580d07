"""The Extract stream's response deserializer: a chunk read as a view of the
received bytes, anything else by the generated parser, with the same result."""

from __future__ import annotations

from typing import Any, NamedTuple

from .v1 import hsx_pb2


class ChunkView(NamedTuple):
    """A Chunk's fields, its data a view of the received message's bytes (no copy)."""

    capture_id: int
    first_row: int
    num_rows: int
    data: bytes | memoryview


def parse_response(message: bytes) -> hsx_pb2.ExtractResponse | ChunkView:
    """The Extract stream's response deserializer: a ChunkView for a chunk as the
    generated serializer writes it (ExtractResponse{chunk: Chunk{capture_id = 1,
    first_row = 2, num_rows = 3, data = 4}}, each field at most once; what
    format/response_framing.h sends), else the generated parser's
    ExtractResponse. The generated parser copies a chunk's data twice (into the
    message, and again on every read of .data); here it is a view of the
    message. Anything else, unknown fields, repeats or malformed bytes included,
    goes to the generated parser, so the result (or the DecodeError) is always
    what it gives."""
    return _parse_chunk(message) or hsx_pb2.ExtractResponse.FromString(message)


_CHUNK_TAG = (2 << 3) | 2  # ExtractResponse.chunk, length-delimited
_CHUNK_VARINTS = {(1 << 3) | 0: 0, (2 << 3) | 0: 1, (3 << 3) | 0: 2}  # tag -> index in ChunkView
_DATA_TAG = (4 << 3) | 2


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of the varint at pos as an unsigned 64-bit value;
    (-1, pos) for one that is truncated, longer than 10 bytes or over 64 bits."""
    value, shift = 0, 0
    while pos < len(buf) and shift < 70:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (value, pos) if value < (1 << 64) else (-1, pos)
        shift += 7
    return -1, pos


def _parse_chunk(buf: bytes) -> ChunkView | None:
    """The ChunkView of a message that is one chunk and nothing else, each of its
    fields at most once; None for any other message (parse_response's fast path)."""
    if not buf or buf[0] != _CHUNK_TAG:
        return None
    size, pos = _varint(buf, 1)
    if size < 0 or pos + size != len(buf):
        return None
    fields: list[Any] = [0, 0, 0, b""]
    seen = set()
    while pos < len(buf):
        tag = buf[pos]  # one byte: the known tags are below 128 (a longer encoding goes to the generated parser)
        pos += 1
        if tag in seen:
            return None
        seen.add(tag)
        if tag in _CHUNK_VARINTS:
            value, pos = _varint(buf, pos)
            if value < 0:
                return None
            fields[_CHUNK_VARINTS[tag]] = value
        elif tag == _DATA_TAG:
            size, pos = _varint(buf, pos)
            if size < 0 or pos + size > len(buf):
                return None
            fields[3] = memoryview(buf)[pos:pos + size]
            pos += size
        else:  # an unknown field, or a known one with another wire type
            return None
    capture_id, first_row, num_rows, data = fields
    # Two's complement as the generated parser reads them: int32 keeps the low 32 bits.
    return ChunkView(_signed(capture_id & 0xFFFFFFFF, 32), _signed(first_row, 64), _signed(num_rows, 64), data)


def _signed(value: int, bits: int) -> int:
    return value - (1 << bits) if value >= 1 << (bits - 1) else value
