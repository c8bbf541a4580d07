"""The shared malformed-stream table (tests/streams/malformed_streams.json) through
the Python client: hsx.StreamDecoder behind Client's own error handling, fed
the table's messages instead of a server's, both as the generated parser gives them
and serialized and read back by Client's response deserializer (parse_response);
and through the native receive path (hsx._native, where it is built), fed the
serialized messages and the end status, judged by the same code as a native
call's stream and turned into a Sample or an exception by Client's own handling.
tests/unit/stream_table_test.cc runs the same table through the C++ assembler;
each case must reach the same verdict, with the same message fragment, in all; the fp8
cases also with fp8 handed on as received (dequantize=False)."""

import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
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


def replay(case, expect, dequantize=True):
    """The case through the native module: its outcome as a Sample, or the exception."""
    messages = [json_format.ParseDict(m, hsx_pb2.ExtractResponse()).SerializeToString() for m in case["messages"]]
    end = case.get("end", {"code": "OK", "message": ""})
    outcome = _native.replay(messages, grpc.StatusCode[end["code"]].value[0], end["message"],
                             native_expectation(expect), dequantize)
    return native_sample(outcome, expect, dequantize=dequantize)


def expectation(case):
    """The case's request as the client's StreamExpectation."""
    r = case["request"]
    return StreamExpectation(sample_id=r["sample_id"], token_ids=tuple(r["token_ids"]),
                             capture_ids=tuple(r["capture_ids"]), final_norm=r["final_norm"], dtype=r["dtype"],
                             checksum=r["checksum"],
                             hidden_size=r["hidden_size"], num_layers=r["num_layers"], model_name=r["model_name"])


def receive(case, wire, dequantize=True):
    """The case's Sample on one receive path (wire: False, True or "native"), or its exception."""
    expect = expectation(case)
    if wire == "native":
        return replay(case, expect, dequantize)
    return assemble(responses(case, wire), expect, dequantize=dequantize)


def judge(case, wire, dequantize=True):
    """(verdict, message) of the Python client for one case: as Client.extract handles a stream."""
    client = hsx.Client("127.0.0.1:1", retries=0)  # never connects: only its error handling is used
    try:
        client._call(lambda: receive(case, wire, dequantize))
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


FP8_CASES = [c for c in TABLE if c["request"]["dtype"] == "fp8"]


@pytest.mark.parametrize("wire", [False, True, NATIVE], ids=["parsed", "wire", "native"])
@pytest.mark.parametrize("case", FP8_CASES, ids=[c["name"] for c in FP8_CASES])
def test_fp8_as_received_gets_the_same_verdict(case, wire):
    """dequantize=False (fp8 handed on as received) makes every check it makes by default:
    each fp8 case of the table gets its verdict and message."""
    verdict, message = judge(case, wire, dequantize=False)
    assert verdict == case["verdict"], f"{case['what']}: {message}"
    assert case["message"] in message, f"{case['what']}: expected {case['message']!r} in {message!r}"


def split_rows(data, hidden):
    """fp8 rows as sent (a float32 scale, then `hidden` e4m3 bytes, each): (values, scales) bytes."""
    rows = [data[at:at + 4 + hidden] for at in range(0, len(data), 4 + hidden)]
    return b"".join(row[4:] for row in rows), b"".join(row[:4] for row in rows)


@pytest.mark.parametrize("wire", [False, True, NATIVE], ids=["parsed", "wire", "native"])
def test_an_accepted_fp8_stream_as_received_is_the_rows_sent(wire):
    """dequantize=False: the sample holds the chunks' rows split into e4m3 values [T, L, H] and
    float32 scales [T, L, 1] (final norm: [T, H], [T, 1]), laid out as the file's tensors; and
    dequantize has no effect on a bf16 stream."""
    case = next(c for c in TABLE if c["name"] == "ok_fp8_final_norm")
    r = case["request"]
    tokens, layers, hidden = len(r["token_ids"]), len(r["capture_ids"]), r["hidden_size"]
    sample = receive(case, wire, dequantize=False)
    assert set(sample) == {"hidden_states", "hidden_states_scales", "final_norm_hidden_states",
                           "final_norm_hidden_states_scales", "token_ids"}
    assert sample["hidden_states"].dtype == hsx.fp8.FP8 and sample["hidden_states"].shape == (tokens, layers, hidden)
    assert sample["hidden_states_scales"].dtype == np.float32
    assert sample["hidden_states_scales"].shape == (tokens, layers, 1)
    assert sample["final_norm_hidden_states"].shape == (tokens, hidden)
    assert sample["final_norm_hidden_states_scales"].shape == (tokens, 1)
    data = {}  # each tensor's rows as sent, the chunks' data joined
    for m in case["messages"]:
        if "chunk" in m:
            chunk = json_format.ParseDict(m, hsx_pb2.ExtractResponse()).chunk
            data[chunk.capture_id] = data.get(chunk.capture_id, b"") + chunk.data
    for l, capture_id in enumerate(r["capture_ids"]):
        values, scales = split_rows(data[capture_id], hidden)
        assert sample["hidden_states"][:, l].tobytes() == values, capture_id
        assert sample["hidden_states_scales"][:, l].tobytes() == scales, capture_id
    values, scales = split_rows(data[-1], hidden)
    assert sample["final_norm_hidden_states"].tobytes() == values
    assert sample["final_norm_hidden_states_scales"].tobytes() == scales
    bf16 = next(c for c in TABLE if c["name"] == "ok_final_norm")
    plain, as_received = receive(bf16, wire), receive(bf16, wire, dequantize=False)
    assert set(plain) == set(as_received) == {"hidden_states", "final_norm_hidden_states", "token_ids"}
    for key in plain:
        assert plain[key].dtype == as_received[key].dtype and plain[key].tobytes() == as_received[key].tobytes()


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
