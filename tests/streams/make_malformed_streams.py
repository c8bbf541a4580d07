#!/usr/bin/env python3
"""Writes malformed_streams.json: the shared table of Extract response streams,
well-formed and malformed, with the verdict every client must reach.

Both stream decoders run it: the C++ assembler (format/stream_assembler.h, plus
hsx-dump's VerifySample) in tests/unit/stream_table_test.cc, and the Python
client's (hsx.StreamDecoder, through hsx.Client's error handling) in
tests/python/test_stream_table.py. A case is a request (what the client asked
and what it knows of the model), the messages the server sent (protobuf JSON,
as json_format / JsonStringToMessage read them), the status the stream ended
with, and the verdict: "ok", "data_loss" (the client rejects the stream) or a
status code name (the server's status reaches the caller), plus a fragment the
error message must contain (the same text in both languages).

The table is data: edit this script and rerun it (test_stream_table.py checks
that the file is what the script writes).

    python tests/streams/make_malformed_streams.py   # rewrites malformed_streams.json
"""

import copy
import json
import random
import struct
import sys
from pathlib import Path

import xxhash

OUT = Path(__file__).resolve().parent / "malformed_streams.json"

TOKENS = [11, 7, 1999, 0, 42]  # T = 5
CAPTURE = [2, 4, 5, 8]
HIDDEN = 4
LAYERS = 8
MODEL = "fake"
ROWS_PER_CHUNK = 2
SIZES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
SCALE_BYTES = {"fp8": 4}  # fp8: each row is its float32 scale, then its e4m3 values
PROTO_DTYPE = {"bf16": "DTYPE_BF16", "fp16": "DTYPE_FP16", "fp32": "DTYPE_FP32", "fp8": "DTYPE_FP8_E4M3"}
PROTO_CHECKSUM = {"xxh64": "CHECKSUM_XXH64", "xxh3": "CHECKSUM_XXH3_64"}
FINAL = -1


def token_hash(ids):
    return xxhash.xxh64(b"".join(struct.pack("<q", i) for i in ids)).intdigest()


def values(rng, count, dtype):
    """`count` finite, non-zero values of `dtype`, little-endian."""
    if dtype == "fp32":
        return b"".join(struct.pack("<f", rng.choice((-1, 1)) * rng.uniform(0.5, 3.0)) for _ in range(count))
    if dtype == "fp8":  # rows of HIDDEN: a scale in [0.001, 0.02), then e4m3 codes (never 0x7f / 0xff, NaN)
        return b"".join(struct.pack("<f", rng.uniform(0.001, 0.02))
                        + bytes(rng.randrange(0x01, 0x7f) | rng.choice((0, 0x80)) for _ in range(HIDDEN))
                        for _ in range(count // HIDDEN))
    lo, hi = (0x3C00, 0x4100) if dtype == "bf16" else (0x3800, 0x4200)  # about 0.5 .. 8 either way
    return b"".join((rng.randrange(lo, hi) | rng.choice((0, 0x8000))).to_bytes(2, "little") for _ in range(count))


class Stream:
    """A well-formed stream for the base request, as tensors and messages that cases edit."""

    def __init__(self, final_norm=False, dtype="bf16", seed=0, checksum=None):
        """checksum: None (a server older than the field: no Header.checksum, XXH64 asked and sent),
        "xxh64" or "xxh3" (asked for, named in the header and sent)."""
        rng = random.Random(seed)
        self.dtype = dtype
        self.checksum = checksum
        self.order = CAPTURE + ([FINAL] if final_norm else [])
        self.data = {c: bytearray(values(rng, len(TOKENS) * HIDDEN, dtype)) for c in self.order}
        self.header = {"sample_id": "s", "num_tokens": len(TOKENS), "token_ids_xxh64": token_hash(TOKENS),
                       "capture_ids": list(CAPTURE), "final_norm": final_norm, "hidden_size": HIDDEN,
                       "dtype": PROTO_DTYPE[dtype], "model_name": MODEL, "num_layers": LAYERS}
        if checksum:
            self.header["checksum"] = PROTO_CHECKSUM[checksum]
        self.request = {"sample_id": "s", "token_ids": TOKENS, "capture_ids": CAPTURE, "final_norm": final_norm,
                        "dtype": dtype, "checksum": checksum or "xxh64", "hidden_size": HIDDEN, "num_layers": LAYERS,
                        "model_name": MODEL}

    def row_bytes(self):
        return HIDDEN * SIZES[self.dtype] + SCALE_BYTES.get(self.dtype, 0)

    def set_value(self, capture, row, column, raw):
        at = row * self.row_bytes() + SCALE_BYTES.get(self.dtype, 0) + column * SIZES[self.dtype]
        self.data[capture][at:at + len(raw)] = raw

    def set_scale(self, capture, row, scale):
        """fp8: row `row`'s scale, as float32 bits."""
        at = row * self.row_bytes()
        self.data[capture][at:at + 4] = struct.pack("<f", scale)

    def chunks(self, capture):
        rb = self.row_bytes()
        return [{"capture_id": capture, "first_row": r, "num_rows": min(ROWS_PER_CHUNK, len(TOKENS) - r),
                 "data": bytes(self.data[capture][r * rb:(r + min(ROWS_PER_CHUNK, len(TOKENS) - r)) * rb])}
                for r in range(0, len(TOKENS), ROWS_PER_CHUNK)]

    def trailer(self):
        if self.checksum == "xxh3":
            sums = [{"capture_id": c, "xxh3_64": xxhash.xxh3_64(bytes(self.data[c])).intdigest()} for c in self.order]
        else:
            sums = [{"capture_id": c, "xxh64": xxhash.xxh64(bytes(self.data[c])).intdigest()} for c in self.order]
        return {"checksums": sums,
                "token_ids_xxh64": token_hash(TOKENS)}

    def messages(self):
        out = [{"header": dict(self.header)}]
        for c in self.order:
            out += [{"chunk": chunk} for chunk in self.chunks(c)]
        out.append({"trailer": self.trailer()})
        return out


def chunk_at(messages, capture, first_row):
    return next(i for i, m in enumerate(messages)
                if "chunk" in m and m["chunk"]["capture_id"] == capture and m["chunk"]["first_row"] == first_row)


def case(name, what, verdict, message, stream=None, edit=None, end=None, request=None):
    stream = stream or Stream()
    messages = stream.messages()
    if edit:
        messages = edit(messages) or messages
    entry = {"name": name, "what": what, "request": dict(stream.request, **(request or {})),
             "messages": [encode(m) for m in messages], "verdict": verdict, "message": message}
    if end:
        entry["end"] = end
    return entry


def encode(message):
    """protobuf JSON: fixed64 as decimal strings, bytes as base64, field names as in the proto."""
    import base64

    def fix(value, key=None):
        if isinstance(value, dict):
            return {k: fix(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, (bytes, bytearray)):
            return base64.b64encode(bytes(value)).decode()
        if key in ("token_ids_xxh64", "xxh64", "xxh3_64"):
            return str(value)
        return value

    return fix(copy.deepcopy(message))


def set_header(**fields):
    return lambda m: m[0]["header"].update(fields)


def control_cases():
    """Well-formed streams: accepted by both."""
    out = []
    add = out.append
    add(case("ok", "a well-formed stream", "ok", ""))
    add(case("ok_final_norm", "with the final-norm state", "ok", "", stream=Stream(final_norm=True, seed=1)))
    add(case("ok_fp32", "fp32 requested and sent", "ok", "", stream=Stream(dtype="fp32", seed=2)))
    add(case("ok_model_unknown", "the client does not know the model (hidden size, layers, name 0/empty)", "ok",
             "", request={"hidden_size": 0, "num_layers": 0, "model_name": ""}))
    return out


def fault_cases():
    """The 14 faults of tests/python/test_remote_dump.py (FAULTS), as messages."""
    out = []
    add = out.append
    add(case("sample_id", "the header echoes another sample id", "data_loss",
             "the header is for sample_id 'someone-else', requested 's'", edit=set_header(sample_id="someone-else")))
    add(case("token_hash", "the header's token hash is not the request's", "data_loss",
             "the header's token-id hash", edit=set_header(token_ids_xxh64=token_hash(TOKENS) ^ 1)))
    add(case("capture_ids", "the header has other capture ids", "data_loss",
             "the header has capture ids [3,4,5,8], requested [2,4,5,8]", edit=set_header(capture_ids=[3, 4, 5, 8])))
    add(case("hidden", "the header's hidden size is not the model's", "data_loss",
             f"the header has hidden size {2 * HIDDEN}, the model {HIDDEN}", edit=set_header(hidden_size=2 * HIDDEN)))

    def gap(m):
        del m[chunk_at(m, 2, 2)]
    add(case("gap", "rows [2, 4) of the first tensor are missing", "data_loss",
             "chunk rows [4, 5) of capture id 2: expected first row 2 (a gap)", edit=gap))

    def overlap(m):
        s = Stream()
        rb = s.row_bytes()
        m.insert(chunk_at(m, 2, 2), {"chunk": {"capture_id": 2, "first_row": 1, "num_rows": 2,
                                               "data": bytes(s.data[2][rb:3 * rb])}})
    add(case("overlap", "a chunk repeats row 1", "data_loss",
             "chunk rows [1, 3) of capture id 2: expected first row 2 (an overlap)", edit=overlap))

    def partial(m):
        m[1]["chunk"]["data"] = m[1]["chunk"]["data"][:-1]
    add(case("partial", "the first chunk lacks its last byte", "data_loss",
             f"holds {2 * HIDDEN * 2 - 1} bytes, expected {2 * HIDDEN * 2} (whole rows", edit=partial))

    def order(m):
        first = [x for x in m if "chunk" in x and x["chunk"]["capture_id"] == 2]
        second = [x for x in m if "chunk" in x and x["chunk"]["capture_id"] == 4]
        rest = [x for x in m[1:] if x not in first and x not in second]
        m[1:] = second + first + rest
    add(case("order", "the second tensor comes first", "data_loss",
             "a chunk of capture id 4 while capture id 2 has 0 of 5 rows (expected layer after layer", edit=order))

    def checksum(m):
        m[-1]["trailer"]["checksums"][3]["xxh64"] ^= 1 << 40
    add(case("checksum", "the trailer's checksum of capture id 8 does not match its bytes", "data_loss",
             "capture id 8: the received bytes hash to", edit=checksum))

    def trailer_token_hash(m):
        m[-1]["trailer"]["token_ids_xxh64"] ^= 1
    add(case("trailer_token_hash", "the trailer's token hash is not the request's", "data_loss",
             "the trailer's token-id hash", edit=trailer_token_hash))
    add(case("no_trailer", "the stream ends (OK) after every chunk, without a trailer", "data_loss",
             "the stream ended without a trailer (4 of 4 tensors complete)", edit=lambda m: m[:-1]))
    nan = Stream()
    nan.set_value(4, 1, 1, (0x7FC0).to_bytes(2, "little"))
    add(case("nan", "a NaN in capture id 4 (checksums match)", "data_loss",
             "non-finite value (nan) in capture id 4 row 1 column 1", stream=nan))
    zero = Stream()
    zero.data[5] = bytearray(len(zero.data[5]))
    add(case("zero", "capture id 5 is all zeros (checksums match)", "data_loss", "capture id 5 is all zeros",
             stream=zero))
    add(case("invalid", "the server ends the stream with INVALID_ARGUMENT after the first tensor",
             "INVALID_ARGUMENT", "fake invalid", edit=lambda m: m[:1 + 3],
             end={"code": "INVALID_ARGUMENT", "message": "fake invalid"}))
    return out


def header_and_order_cases():
    """A header that is not the request's or the model's, and messages out of order."""
    out = []
    add = out.append
    add(case("dtype", "the header's dtype is not the requested one", "data_loss",
             "the header has dtype DTYPE_FP16, requested DTYPE_BF16", edit=set_header(dtype="DTYPE_FP16")))
    add(case("duplicate_trailer", "a second trailer after the first", "data_loss", "a message after the trailer",
             edit=lambda m: m + [copy.deepcopy(m[-1])]))
    add(case("second_header", "a second header before the chunks", "data_loss", "a second header",
             edit=lambda m: m[:1] + [copy.deepcopy(m[0])] + m[1:]))
    add(case("header_after_trailer", "a header after the trailer", "data_loss", "a message after the trailer",
             edit=lambda m: m + [copy.deepcopy(m[0])]))
    add(case("chunk_after_trailer", "a chunk after the trailer", "data_loss", "a message after the trailer",
             edit=lambda m: m + [copy.deepcopy(m[1])]))
    add(case("chunk_before_header", "the stream starts with a chunk", "data_loss", "a chunk before the header",
             edit=lambda m: m[1:]))
    add(case("trailer_before_header", "the stream is only a trailer", "data_loss", "a trailer before the header",
             edit=lambda m: m[-1:]))
    add(case("empty_message", "a message with no part set", "data_loss", "an empty response message",
             edit=lambda m: m[:2] + [{}] + m[2:]))
    add(case("summary", "a summary, which was not requested", "data_loss", "a summary, which was not requested",
             edit=lambda m: m[:1] + [{"summary": {"tensors": [{"capture_id": 2, "mean": 1.0}]}}] + m[1:]))
    add(case("num_tokens", "the header counts another number of tokens", "data_loss",
             f"the header has {len(TOKENS) + 1} tokens, the request {len(TOKENS)}",
             edit=set_header(num_tokens=len(TOKENS) + 1)))
    add(case("final_norm_flipped", "the header has the final norm, which was not requested", "data_loss",
             "the header has final_norm true, requested the opposite", edit=set_header(final_norm=True)))
    add(case("num_layers", "the header's layer count is not the model's", "data_loss",
             f"the header has {LAYERS + 1} layers, the model {LAYERS}", edit=set_header(num_layers=LAYERS + 1)))
    add(case("model_name", "the header names another model", "data_loss",
             f"the header is from model 'other', expected '{MODEL}'", edit=set_header(model_name="other")))
    add(case("hidden_zero", "the header's hidden size is 0 (model unknown)", "data_loss",
             "the header has hidden size 0", edit=set_header(hidden_size=0),
             request={"hidden_size": 0, "num_layers": 0, "model_name": ""}))
    return out


def trailer_and_row_cases():
    """A trailer's checksums that do not cover the tensors sent, and rows out of place."""
    out = []
    add = out.append

    def extra_checksum(m):
        m[-1]["trailer"]["checksums"].append({"capture_id": 3, "xxh64": 1})
    add(case("extra_checksum", "the trailer has a checksum for a tensor that was not sent", "data_loss",
             "the trailer has a checksum for capture id 3, which was not sent", edit=extra_checksum))

    def two_checksums(m):
        m[-1]["trailer"]["checksums"].append(dict(m[-1]["trailer"]["checksums"][0]))
    add(case("two_checksums", "the trailer has two checksums for capture id 2", "data_loss",
             "the trailer has two checksums for capture id 2", edit=two_checksums))

    def missing_checksum(m):
        del m[-1]["trailer"]["checksums"][2]
    add(case("missing_checksum", "the trailer lacks capture id 5's checksum", "data_loss",
             "the trailer has no checksum for capture id 5", edit=missing_checksum))
    add(case("early_trailer", "the trailer comes before the last chunk", "data_loss",
             "the trailer came while capture id 8 had 4 of 5 rows", edit=lambda m: m[:-2] + m[-1:]))
    add(case("ended_midway", "the stream ends (OK) in the middle of capture id 4", "data_loss",
             "the stream ended without a trailer (1 of 4 tensors complete)", edit=lambda m: m[:1 + 3 + 2]))

    def chunk_after_all(m):
        m.insert(len(m) - 1, copy.deepcopy(m[-2]))
    add(case("chunk_after_all", "a chunk after every tensor was complete", "data_loss",
             "a chunk of capture id 8 after every tensor was complete", edit=chunk_after_all))

    def rows_beyond(m):
        s = Stream()
        c = m[chunk_at(m, 2, 4)]["chunk"]
        c["num_rows"] = 3
        c["data"] = bytes(s.data[2][4 * s.row_bytes():]) * 3
    add(case("rows_beyond", "the last chunk of capture id 2 claims rows [4, 7) of 5", "data_loss",
             "chunk rows [4, 7) of capture id 2 are outside [0, 5)", edit=rows_beyond))

    def zero_rows(m):
        m.insert(2, {"chunk": {"capture_id": 2, "first_row": 2, "num_rows": 0}})
    add(case("zero_rows", "a chunk of no rows", "data_loss", "chunk rows [2, 2) of capture id 2 are outside [0, 5)",
             edit=zero_rows))
    return out


def value_cases():
    """The final-norm state out of place, and values a check must refuse."""
    out = []
    add = out.append

    def final_first(m):
        fin = [x for x in m if "chunk" in x and x["chunk"]["capture_id"] == FINAL]
        m[1:] = fin + [x for x in m[1:] if x not in fin]
    add(case("final_norm_first", "the final-norm state before the captured layers", "data_loss",
             "a chunk of the final-norm state while capture id 2 has 0 of 5 rows",
             stream=Stream(final_norm=True, seed=1), edit=final_first))
    fz = Stream(final_norm=True, seed=3)
    fz.data[FINAL] = bytearray(len(fz.data[FINAL]))
    add(case("final_norm_zero", "the final-norm state is all zeros (checksums match)", "data_loss",
             "the final-norm state is all zeros", stream=fz))
    finf = Stream(final_norm=True, seed=4)
    finf.set_value(FINAL, 3, 2, (0xFF80).to_bytes(2, "little"))
    add(case("final_norm_inf", "-inf in the final-norm state", "data_loss",
             "non-finite value (-inf) in the final-norm state row 3 column 2", stream=finf))
    nz = Stream(seed=5)
    nz.data[5] = bytearray(b"\x00\x80" * (len(TOKENS) * HIDDEN))
    add(case("negative_zero", "capture id 5 is all -0.0", "data_loss", "capture id 5 is all zeros", stream=nz))
    f32 = Stream(dtype="fp32", seed=6)
    f32.set_value(8, 4, 3, struct.pack("<f", float("inf")))
    add(case("fp32_inf", "+inf in fp32", "data_loss", "non-finite value (inf) in capture id 8 row 4 column 3",
             stream=f32))
    add(case("fp32_served_bf16_requested", "fp32 rows where bf16 was requested (the header says fp32)",
             "data_loss", "the header has dtype DTYPE_FP32, requested DTYPE_BF16", stream=Stream(dtype="fp32"),
             request={"dtype": "bf16"}))
    return out


def checksum_and_status_cases():
    """The checksum a client asks for (ExtractRequest.checksum), and the status a stream ends with."""
    out = []
    add = out.append
    add(case("ok_xxh64_named", "XXH64 asked for and named in the header", "ok", "", stream=Stream(checksum="xxh64")))
    xxh3 = Stream(checksum="xxh3", seed=7)
    add(case("ok_xxh3", "XXH3 asked for, named in the header and sent", "ok", "", stream=xxh3))
    add(case("ok_xxh3_older_server", "XXH3 asked for; a server older than the field sends XXH64 and no "
             "Header.checksum", "ok", "", request={"checksum": "xxh3"}))

    def xxh3_checksum(m):
        m[-1]["trailer"]["checksums"][3]["xxh3_64"] ^= 1 << 40
    add(case("xxh3_checksum", "the trailer's XXH3 of capture id 8 does not match its bytes", "data_loss",
             "capture id 8: the received bytes hash to", stream=xxh3, edit=xxh3_checksum))

    def xxh3_sent_as_xxh64(m):
        m[-1]["trailer"] = Stream(seed=7).trailer()
    add(case("xxh3_trailer_has_xxh64", "the header says XXH3, the trailer carries XXH64 values", "data_loss",
             "capture id 2: the received bytes hash to", stream=xxh3, edit=xxh3_sent_as_xxh64))
    add(case("checksum_not_asked", "the header says XXH3 where XXH64 was asked for", "data_loss",
             "the header has checksum xxh3_64, requested xxh64", stream=xxh3, request={"checksum": "xxh64"}))
    add(case("checksum_downgraded", "the header says XXH64 where XXH3 was asked for", "data_loss",
             "the header has checksum xxh64, requested xxh3_64", stream=Stream(checksum="xxh64"),
             request={"checksum": "xxh3"}))
    add(case("checksum_unknown", "the header names a checksum this client does not know", "data_loss",
             "the header has an unknown checksum 7", edit=set_header(checksum=7)))
    add(case("unavailable_midway", "the server ends the stream with UNAVAILABLE (retryable)", "UNAVAILABLE",
             "fake unavailable", edit=lambda m: m[:4], end={"code": "UNAVAILABLE", "message": "fake unavailable"}))
    add(case("bad_stream_beats_status", "a malformed message, then the stream ends with UNAVAILABLE: the "
             "client reports (and does not retry) the malformed stream", "data_loss", "a second header",
             edit=lambda m: m[:2] + [copy.deepcopy(m[0])], end={"code": "UNAVAILABLE", "message": "fake"}))
    return out


def fp8_cases():
    """fp8 (e4m3 with a float32 scale per row): a stream both accept, every scale finite and positive, no NaN
    payload byte, and the checksum covering scales and payload."""
    out = []
    add = out.append
    add(case("ok_fp8", "fp8 requested and sent: rows of a scale and e4m3 bytes", "ok", "",
             stream=Stream(dtype="fp8", seed=8)))
    add(case("ok_fp8_final_norm", "fp8 with the final-norm state, in XXH3", "ok", "",
             stream=Stream(dtype="fp8", final_norm=True, seed=9, checksum="xxh3")))
    for name, scale, text in (("nan", float("nan"), "nan"), ("inf", float("inf"), "inf"), ("zero", 0.0, "0"),
                              ("negative", -0.5, "-0.5")):
        bad = Stream(dtype="fp8", seed=10)
        bad.set_scale(4, 1, scale)
        add(case(f"fp8_scale_{name}", f"fp8: the scale of capture id 4 row 1 is {text} (checksums match)",
                 "data_loss", f"scale ({text}) of capture id 4 row 1 is not finite and positive", stream=bad))
    fin = Stream(dtype="fp8", final_norm=True, seed=11)
    fin.set_scale(FINAL, 4, -0.0)
    add(case("fp8_final_norm_scale", "fp8: the final-norm state's row 4 has scale -0 (checksums match)",
             "data_loss", "scale (-0) of the final-norm state row 4 is not finite and positive", stream=fin))
    nan = Stream(dtype="fp8", seed=12)
    nan.set_value(5, 2, 3, b"\xff")
    add(case("fp8_payload_nan", "fp8: a NaN byte (0xff) in capture id 5 (checksums match)", "data_loss",
             "non-finite value (nan) in capture id 5 row 2 column 3", stream=nan))

    def flip_payload(m):
        data = bytearray(m[chunk_at(m, 4, 2)]["chunk"]["data"])
        data[4 + 1] ^= 0x01  # row 2's value 1
        m[chunk_at(m, 4, 2)]["chunk"]["data"] = bytes(data)
    add(case("fp8_payload_corrupted", "fp8: a payload byte of capture id 4 changed in transit", "data_loss",
             "capture id 4: the received bytes hash to", stream=Stream(dtype="fp8", seed=13), edit=flip_payload))

    def flip_scale(m):
        data = bytearray(m[chunk_at(m, 8, 0)]["chunk"]["data"])
        data[Stream(dtype="fp8").row_bytes() + 1] ^= 0x10  # row 1's scale, still finite and positive
        m[chunk_at(m, 8, 0)]["chunk"]["data"] = bytes(data)
    add(case("fp8_scale_corrupted", "fp8: a scale of capture id 8 changed in transit (still a valid scale)",
             "data_loss", "capture id 8: the received bytes hash to", stream=Stream(dtype="fp8", seed=14),
             edit=flip_scale))

    def no_scales(m):
        m[1]["chunk"]["data"] = m[1]["chunk"]["data"][:2 * HIDDEN]
    add(case("fp8_rows_without_scales", "fp8: a chunk of 2 rows holds the values without their scales",
             "data_loss", f"holds {2 * HIDDEN} bytes, expected {2 * (HIDDEN + 4)} (whole rows",
             stream=Stream(dtype="fp8", seed=15), edit=no_scales))
    add(case("fp8_served_bf16_requested", "fp8 rows where bf16 was requested (the header says fp8)", "data_loss",
             "the header has dtype DTYPE_FP8_E4M3, requested DTYPE_BF16", stream=Stream(dtype="fp8"),
             request={"dtype": "bf16"}))
    return out


def cases():
    """Every case, in the table's order."""
    return (control_cases() + fault_cases() + header_and_order_cases() + trailer_and_row_cases() + value_cases()
            + checksum_and_status_cases() + fp8_cases())


def table():
    return {"about": "Shared malformed-stream table. Written by make_malformed_streams.py; read by "
                     "tests/unit/stream_table_test.cc and tests/python/test_stream_table.py.",
            "cases": cases()}


def text():
    """One line per message, so that a diff shows which message a case changed."""
    t = table()
    lines = ["{", f' "about": {json.dumps(t["about"])},', ' "cases": [']
    for k, c in enumerate(t["cases"]):
        head = {key: value for key, value in c.items() if key != "messages"}
        lines.append("  " + json.dumps(head)[:-1] + ', "messages": [')
        lines += ["   " + json.dumps(m) + ("," if i + 1 < len(c["messages"]) else "") for i, m in enumerate(c["messages"])]
        lines.append("  ]}" + ("," if k + 1 < len(t["cases"]) else ""))
    lines += [" ]", "}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    OUT.write_text(text())
    print(f"wrote {len(table()['cases'])} cases to {OUT}", file=sys.stderr)
