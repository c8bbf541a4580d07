"""The shared malformed-stream table (tests/streams/malformed_streams.json) through
the Python client: hsx.StreamDecoder behind Client's own error handling, fed
the table's messages instead of a server's, both as the generated parser gives them
and serialized and read back by Client's response deserializer (parse_response);
and through the native receive path (hsx._native, where it is built), fed the
serialized messages and the end status, judged by the same code as a native
call's stream and turned into a Sample or an exception by Client's own handling.
tests/unit/stream_table_test.cc runs the same table through the C++ assembler;
each case must reach the same verdict, with the same message fragment, in all."""

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

import hsx
from hsx.client import _native, native_expectation, native_sample
from hsx.response_parser import parse_response
from hsx.stream_decoder import StreamExpectation, assemble
from hsx.v1 import hsx_pb2

STREAMS = Path(__file__).resolve().parents[1] / "streams"
TABLE = json.loads((STREAMS / "malformed_streams.json").read_text())["cases"]


class StreamEnded(grpc.RpcError):
    """How grpcio ends a response iterator whose call failed."""

    def __init__(self, code, message):
        self._code, self._message = code, message

    def code(self):
        return self._code

    def details(self):
        return self._message


def responses(case, wire=False):
    """The case's messages as the generated parser gives them, or (wire) as
    Client's deserializer gives them from their serialized bytes."""
    for message in case["messages"]:
        response = json_format.ParseDict(message, hsx_pb2.ExtractResponse())
        yield parse_response(response.SerializeToString()) if wire else response
    if "end" in case:
        raise StreamEnded(grpc.StatusCode[case["end"]["code"]], case["end"]["message"])


def replay(case, expect):
    """The case through the native module: its outcome as a Sample, or the exception."""
    messages = [json_format.ParseDict(m, hsx_pb2.ExtractResponse()).SerializeToString() for m in case["messages"]]
    end = case.get("end", {"code": "OK", "message": ""})
    outcome = _native.replay(messages, grpc.StatusCode[end["code"]].value[0], end["message"],
                             native_expectation(expect))
    return native_sample(outcome, expect)


def judge(case, wire):
    """(verdict, message) of the Python client for one case: as Client.extract handles a stream."""
    r = case["request"]
    expect = StreamExpectation(sample_id=r["sample_id"], token_ids=tuple(r["token_ids"]),
                               capture_ids=tuple(r["capture_ids"]), final_norm=r["final_norm"], dtype=r["dtype"],
                               checksum=r["checksum"],
                               hidden_size=r["hidden_size"], num_layers=r["num_layers"], model_name=r["model_name"])
    client = hsx.Client("127.0.0.1:1", retries=0)  # never connects: only its error handling is used
    try:
        if wire == "native":
            client._call(lambda: replay(case, expect))
        else:
            client._call(lambda: assemble(responses(case, wire), expect))
    except hsx.IntegrityError as error:
        return "data_loss", str(error)
    except hsx.ServerError as error:
        return error.code.name, str(error)
    finally:
        client.close()
    return "ok", ""


NATIVE = pytest.param("native", marks=pytest.mark.skipif(_native is None, reason="hsx._native is not built"))


@pytest.mark.parametrize("wire", [False, True, NATIVE], ids=["parsed", "wire", "native"])
@pytest.mark.parametrize("case", TABLE, ids=[c["name"] for c in TABLE])
def test_same_verdict_as_the_cpp_assembler(case, wire):
    verdict, message = judge(case, wire)
    assert verdict == case["verdict"], f"{case['what']}: {message}"
    assert case["message"] in message, f"{case['what']}: expected {case['message']!r} in {message!r}"


def test_table_holds_every_class_of_malformed_stream():
    names = {c["name"] for c in TABLE}
    assert {"sample_id", "token_hash", "capture_ids", "hidden", "gap", "overlap", "partial", "order", "checksum",
            "trailer_token_hash", "no_trailer", "nan", "zero", "invalid", "dtype", "duplicate_trailer"} <= names


def test_table_is_what_its_generator_writes():
    proc = subprocess.run([sys.executable, "-c", "import make_malformed_streams as m, sys; sys.stdout.write(m.text())"],
                          cwd=STREAMS, capture_output=True, text=True, check=True)
    assert proc.stdout == (STREAMS / "malformed_streams.json").read_text(), \
        "malformed_streams.json differs from make_malformed_streams.py's output: rerun the script"


def test_an_accepted_stream_is_the_sample_sent():
    case = next(c for c in TABLE if c["name"] == "ok_final_norm")
    r = case["request"]
    expect = StreamExpectation(sample_id="s", token_ids=tuple(r["token_ids"]), capture_ids=tuple(r["capture_ids"]),
                               final_norm=True, hidden_size=4, num_layers=8, model_name="fake")
    sample = assemble(responses(case, wire=True), expect, loss_mask=[1, 0, 1, 1, 0], index=3)
    assert isinstance(sample, hsx.Sample) and sample.index == 3 and sample.sample_id == "s"
    assert sample.capture_ids == r["capture_ids"]
    assert sample["hidden_states"].shape == (5, 4, 4) and sample["final_norm_hidden_states"].shape == (5, 4)
    assert sample["token_ids"].tolist() == r["token_ids"] and sample["loss_mask"].tolist() == [1, 0, 1, 1, 0]
    chunks = [m["chunk"] for m in case["messages"] if "chunk" in m]
    first = json_format.ParseDict({"chunk": chunks[0]}, hsx_pb2.ExtractResponse()).chunk
    assert sample["hidden_states"][:2, 0].tobytes() == first.data  # capture id 2, rows 0..1
