"""hsx.response_parser.parse_response, the Python client's Extract deserializer: chunks are
read by hand (their data a view of the message), everything else by the generated
parser. Whatever bytes it gets, it must give what the generated parser gives: the
same fields, or the same DecodeError."""

import random

import pytest
from google.protobuf.message import DecodeError

from hsx.response_parser import ChunkView, parse_response
from hsx.v1 import hsx_pb2


def generated(buf):
    """(kind, value) of the generated parser: ("chunk", fields), ("message", msg) or ("error", None)."""
    try:
        message = hsx_pb2.ExtractResponse.FromString(buf)
    except DecodeError:
        return "error", None
    if message.WhichOneof("part") == "chunk":
        c = message.chunk
        return "chunk", (c.capture_id, c.first_row, c.num_rows, bytes(c.data))
    return "message", message


def ours(buf):
    try:
        result = parse_response(buf)
    except DecodeError:
        return "error", None
    if isinstance(result, ChunkView):
        return "chunk", (result.capture_id, result.first_row, result.num_rows, bytes(result.data))
    if result.WhichOneof("part") == "chunk":
        c = result.chunk
        return "chunk", (c.capture_id, c.first_row, c.num_rows, bytes(c.data))
    return "message", result


def chunk_bytes(capture_id=3, first_row=0, num_rows=2, data=b"\x01\x02\x03\x04"):
    return hsx_pb2.ExtractResponse(chunk=hsx_pb2.Chunk(capture_id=capture_id, first_row=first_row,
                                                       num_rows=num_rows, data=data)).SerializeToString()


def varint(value):
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def wrap(inner):
    """ExtractResponse{chunk: <inner bytes>}."""
    return b"\x12" + varint(len(inner)) + inner


def test_a_servers_chunk_is_read_in_place():
    buf = chunk_bytes(capture_id=-1, first_row=(1 << 40) + 5, num_rows=7, data=bytes(range(256)) * 3)
    view = parse_response(buf)
    assert isinstance(view, ChunkView)  # the fast path, not the generated parser
    assert (view.capture_id, view.first_row, view.num_rows) == (-1, (1 << 40) + 5, 7)
    assert isinstance(view.data, memoryview) and view.data.obj is buf  # no copy
    assert bytes(view.data) == bytes(range(256)) * 3


def test_default_fields_are_omitted_on_the_wire_and_read_as_zero():
    buf = hsx_pb2.ExtractResponse(chunk=hsx_pb2.Chunk()).SerializeToString()
    assert buf == b"\x12\x00"
    assert parse_response(buf) == ChunkView(0, 0, 0, b"")


@pytest.mark.parametrize("name,inner", [
    ("fields out of order", b"\x22\x02ab" + b"\x18\x02" + b"\x10\x05" + b"\x08\x03"),
    ("overlong varints", b"\x08\x83\x80\x00" + b"\x18\x82\x00" + b"\x22\x01z"),
    ("capture id past 32 bits", b"\x08" + varint((1 << 35) + 7) + b"\x22\x00"),
    ("a repeated scalar: the last wins", b"\x08\x01\x08\x02\x22\x00"),
    ("repeated data: the last wins", b"\x22\x01a\x22\x01b"),
    ("an unknown field", b"\x08\x01\x28\x07\x22\x00"),
    ("a field with the wrong wire type", b"\x0d\x01\x00\x00\x00\x22\x00"),
    ("an eleven-byte varint", b"\x08" + b"\xff" * 10 + b"\x01"),
    ("a varint over 64 bits", b"\x08" + b"\xff" * 9 + b"\x7f"),
    ("a truncated varint", b"\x08\xff"),
    ("data past the end", b"\x22\x05ab"),
    ("field number 0", b"\x00\x01"),
])
def test_unusual_encodings_read_as_the_generated_parser_reads_them(name, inner):
    buf = wrap(inner)
    assert ours(buf) == generated(buf), name


@pytest.mark.parametrize("name,buf", [
    ("two chunks merge", chunk_bytes(capture_id=3) + wrap(b"\x10\x09")),
    ("a header, then a chunk: the last part wins",
     hsx_pb2.ExtractResponse(header=hsx_pb2.Header(sample_id="s")).SerializeToString() + chunk_bytes()),
    ("a chunk, then a trailer", chunk_bytes() + hsx_pb2.ExtractResponse(
        trailer=hsx_pb2.Trailer(token_ids_xxh64=5)).SerializeToString()),
    ("a chunk's length past the end", b"\x12\x09\x08\x01"),
    ("a chunk's length short of the end", b"\x12\x02\x08\x01\x10\x02"),
    ("empty", b""),
])
def test_messages_that_are_not_one_plain_chunk_go_to_the_generated_parser(name, buf):
    assert ours(buf) == generated(buf), name


def test_other_parts_are_the_generated_messages():
    for message in (hsx_pb2.ExtractResponse(header=hsx_pb2.Header(sample_id="s", num_tokens=5, capture_ids=[1, 2])),
                    hsx_pb2.ExtractResponse(trailer=hsx_pb2.Trailer(token_ids_xxh64=1 << 63)),
                    hsx_pb2.ExtractResponse(summary=hsx_pb2.Summary()), hsx_pb2.ExtractResponse()):
        assert parse_response(message.SerializeToString()) == message


def test_random_corruptions_read_as_the_generated_parser_reads_them():
    rng = random.Random(13)
    fast = 0
    for _ in range(3000):
        buf = bytearray(chunk_bytes(capture_id=rng.choice([-1, 0, 3, 61, -(1 << 31)]),
                                    first_row=rng.choice([0, 1, 300, (1 << 63) - 1, -5]),
                                    num_rows=rng.choice([0, 1, 2, 1 << 20]), data=rng.randbytes(rng.randrange(0, 40))))
        for _ in range(rng.randrange(1, 4)):
            what, at = rng.randrange(4), rng.randrange(len(buf) + 1)
            if what == 0 and at < len(buf):
                buf[at] = rng.randrange(256)
            elif what == 1:
                buf.insert(at, rng.randrange(256))
            elif what == 2 and at < len(buf):
                del buf[at]
            else:
                del buf[at:]
        buf = bytes(buf)
        assert ours(buf) == generated(buf), buf.hex()
        fast += isinstance(parse_response(buf) if ours(buf)[0] != "error" else None, ChunkView)
    assert fast > 100  # the corruptions the fast path reads itself were compared too
