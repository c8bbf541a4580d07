"""hsx.Client: extract verified hidden states from an hsx-server."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import grpc
import grpc.experimental
import numpy as np
import xxhash
from google.protobuf.message import DecodeError

from .arrays import NUMPY_DTYPES, to_torch
from .sample import Sample
from .v1 import hsx_pb2, hsx_pb2_grpc


def _load_native() -> tuple[Any, str]:
    """The native receive path (client/python/native/hsx_native.cc) where it was built and
    loads here: (the module, ""), or (None, why not)."""
    if importlib.util.find_spec(f"{__package__}._native") is None:
        return None, "not built"
    try:
        from . import _native as module
    except ImportError as error:  # built, but not loadable here (e.g. no libgrpc++)
        return None, str(error)
    return module, ""


_native, _NATIVE_MISSING = _load_native()

DTYPES = {"bf16": hsx_pb2.DTYPE_BF16, "fp16": hsx_pb2.DTYPE_FP16, "fp32": hsx_pb2.DTYPE_FP32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FINAL_NORM = -1
# ExtractRequest.checksum: what a client may ask the Trailer's checksums to be (docs/api.md, "Checksums").
CHECKSUMS = {"xxh64": hsx_pb2.CHECKSUM_XXH64, "xxh3": hsx_pb2.CHECKSUM_XXH3_64}
_CHECKSUM_NAMES = {hsx_pb2.CHECKSUM_XXH64: "xxh64", hsx_pb2.CHECKSUM_XXH3_64: "xxh3_64"}
_HASHERS = {hsx_pb2.CHECKSUM_XXH64: xxhash.xxh64, hsx_pb2.CHECKSUM_XXH3_64: xxhash.xxh3_64}
T = TypeVar("T")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED)
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class IntegrityError(Exception):
    """A response failed verification; nothing from it was returned."""


class ServerError(Exception):
    """The server refused or failed the request (not retried, or out of retries)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def token_hash(token_ids: Sequence[int]) -> int:
    """XXH64 (seed 0) of the token ids as little-endian int64: the Header's and Trailer's token_ids_xxh64."""
    return xxhash.xxh64(np.asarray(token_ids, dtype="<i8").tobytes()).intdigest()


@dataclass(frozen=True)
class StreamExpectation:
    """What one Extract stream must match: the request and, where known (> 0 /
    non-empty), the model. The fields of C++'s StreamExpectation
    (format/stream_assembler.h); final_norm may be None (either is accepted) for
    a request that leaves the capture set to the server, which then adds the
    final norm if it runs with --final-norm."""

    sample_id: str
    token_ids: tuple[int, ...]
    capture_ids: tuple[int, ...]
    final_norm: bool | None = False
    dtype: str = "bf16"
    checksum: str = "xxh64"  # asked for: "xxh64" or "xxh3" (a server older than the field sends XXH64)
    hidden_size: int = 0
    num_layers: int = 0
    model_name: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def token_ids_xxh64(self) -> int:
        return token_hash(self.token_ids)


def _tensor_name(capture_id: int) -> str:
    return "the final-norm state" if capture_id < 0 else f"capture id {capture_id}"


def _ids_text(ids: Sequence[int]) -> str:
    return "[" + ",".join(str(i) for i in ids) + "]"


def _dtype_name(value: int) -> str:
    try:
        return hsx_pb2.DType.Name(value)
    except ValueError:  # as C++'s DType_Name: no name for an unknown value
        return ""


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


class StreamDecoder:
    """The checks and reassembly of one Extract response stream, message by
    message: a port of the C++ StreamAssembler (format/stream_assembler.cc) with
    the same checks in the same order and the same messages, followed by the
    value checks hsx-dump applies before writing (finite values, no all-zero
    tensor). tests/streams/malformed_streams.json holds the cases both run.

    For a stream it accepts: the header echoes the request (sample id, token
    count, token-id hash, capture ids, dtype, final norm) and the model (hidden
    size, layers, name, where known); chunks hold whole rows, tensor after tensor
    in the header's order, rows in order without gaps or overlaps; every
    tensor's checksum (XXH64, or XXH3 when asked for and the header says so)
    equals the trailer's; the trailer's token hash is the
    request's; nothing follows the trailer. Any violation raises IntegrityError
    naming it, and the decoder accepts nothing more after one.
    """

    def __init__(self, expect: StreamExpectation) -> None:
        self._expect = expect
        self._token_hash = expect.token_ids_xxh64
        self._error: str | None = None
        self._header: hsx_pb2.Header | None = None
        self._trailer = False
        self._tensors: list[int] = []  # capture ids in order, then FINAL_NORM
        self._targets: list[np.ndarray] = []
        self._current = 0  # the tensor being received
        self._rows = 0  # rows of it received
        self._checksum = hsx_pb2.CHECKSUM_XXH64  # the header's, once it came
        self._hasher = xxhash.xxh64()
        self._digests: list[int] = []
        self._hidden_states: np.ndarray | None = None
        self._final: np.ndarray | None = None
        self._values: list[_ValueScan] = []  # per tensor

    @property
    def complete(self) -> bool:
        """True once a valid trailer arrived."""
        return self._trailer

    def consume(self, response: hsx_pb2.ExtractResponse | ChunkView) -> None:
        """Takes the next message (as parse_response gives it, or the generated
        ExtractResponse); raises IntegrityError if the stream is wrong."""
        if self._error is None:
            try:
                self._dispatch(response)
                return
            except _Reject as reject:
                self._error = str(reject)
        raise IntegrityError(f"sample {self._expect.sample_id!r}: {self._error}")

    def finish(self, token_ids: Sequence[int], loss_mask: Sequence[int] | None = None,
               use_torch: bool = False, index: int | None = None) -> Sample:
        """After the stream ended (status OK): the verified Sample."""
        where = f"sample {self._expect.sample_id!r}"
        if self._error is not None:
            raise IntegrityError(f"{where}: {self._error}")
        if not self._trailer:
            raise IntegrityError(f"{where}: the stream ended without a trailer ({self._current} of "
                                 f"{len(self._tensors)} tensors complete)")
        layers = len(self._header.capture_ids)
        checks = [(self._hidden_states, [_tensor_name(c) for c in self._header.capture_ids], self._values[:layers])]
        if self._final is not None:
            checks.append((self._final[:, None, :], ["the final-norm state"], self._values[layers:]))
        try:
            # The chunks were scanned as they came; _check_values finds and names
            # the first bad value (in row order) where a scan saw one.
            for array, names, scans in checks:
                if not all(scan.clean for scan in scans):
                    _check_values(array, names)
                    raise AssertionError(f"hsx internal error: a value scan flagged {', '.join(names)}, "
                                         "_check_values found nothing")
        except _Reject as reject:
            raise IntegrityError(f"{where}: {reject}") from None
        return _make_sample(self._hidden_states, self._final, list(self._header.capture_ids), self._expect.sample_id,
                            token_ids, loss_mask, use_torch, index)

    def _dispatch(self, response: hsx_pb2.ExtractResponse | ChunkView) -> None:
        if self._trailer:
            raise _Reject("a message after the trailer")
        if isinstance(response, ChunkView):
            self._on_chunk(response)
            return
        part = response.WhichOneof("part")
        if part == "header":
            self._on_header(response.header)
        elif part == "chunk":
            c = response.chunk
            self._on_chunk(ChunkView(c.capture_id, c.first_row, c.num_rows, c.data))
        elif part == "trailer":
            self._on_trailer(response.trailer)
        elif part == "summary":
            raise _Reject("a summary, which was not requested")
        else:
            raise _Reject("an empty response message")

    def _on_header(self, h: hsx_pb2.Header) -> None:
        e = self._expect
        if self._header is not None:
            raise _Reject("a second header")
        ids = list(h.capture_ids)
        if h.sample_id != e.sample_id:
            raise _Reject(f"the header is for sample_id '{h.sample_id}', requested '{e.sample_id}'")
        if h.num_tokens != e.num_tokens:
            raise _Reject(f"the header has {h.num_tokens} tokens, the request {e.num_tokens}")
        if h.token_ids_xxh64 != self._token_hash:
            raise _Reject(f"the header's token-id hash {h.token_ids_xxh64:016x} differs from the request's "
                          f"{self._token_hash:016x} (states of other tokens)")
        if ids != list(e.capture_ids):
            raise _Reject(f"the header has capture ids {_ids_text(ids)}, requested {_ids_text(e.capture_ids)}")
        if e.final_norm is not None and h.final_norm != e.final_norm:
            raise _Reject(f"the header has final_norm {'true' if h.final_norm else 'false'}, "
                          "requested the opposite")
        if h.dtype != DTYPES[e.dtype]:
            raise _Reject(f"the header has dtype {_dtype_name(h.dtype)}, requested {_dtype_name(DTYPES[e.dtype])}")
        # No checksum in the header: a server older than the field, which sends XXH64.
        checksum = h.checksum or hsx_pb2.CHECKSUM_XXH64
        if checksum not in _CHECKSUM_NAMES:
            raise _Reject(f"the header has an unknown checksum {checksum}")
        if checksum != CHECKSUMS[e.checksum] and h.checksum:
            raise _Reject(f"the header has checksum {_CHECKSUM_NAMES[checksum]}, "
                          f"requested {_CHECKSUM_NAMES[CHECKSUMS[e.checksum]]}")
        if h.hidden_size < 1 or h.hidden_size > (1 << 20) or (e.hidden_size > 0 and h.hidden_size != e.hidden_size):
            model = f", the model {e.hidden_size}" if e.hidden_size > 0 else ""
            raise _Reject(f"the header has hidden size {h.hidden_size}{model}")
        if e.num_layers > 0 and h.num_layers != 0 and h.num_layers != e.num_layers:
            raise _Reject(f"the header has {h.num_layers} layers, the model {e.num_layers}")
        if e.model_name and h.model_name and h.model_name != e.model_name:
            raise _Reject(f"the header is from model '{h.model_name}', expected '{e.model_name}'")
        self._header = h
        dtype = NUMPY_DTYPES[e.dtype]
        tokens, hidden = e.num_tokens, h.hidden_size
        self._row_bytes = hidden * dtype.itemsize
        self._dtype = dtype
        # Chunks go straight into their final places: captured layers into the
        # [T, L, H] array, the final norm into its own.
        self._hidden_states = np.empty((tokens, len(ids), hidden), dtype=dtype)
        self._targets = [self._hidden_states[:, l, :] for l in range(len(ids))]
        self._tensors = ids
        if h.final_norm:
            self._final = np.empty((tokens, hidden), dtype=dtype)
            self._targets.append(self._final)
            self._tensors = ids + [FINAL_NORM]
        self._values = [_ValueScan(e.dtype) for _ in self._tensors]
        self._checksum = checksum
        self._hasher = _HASHERS[checksum]()

    def _on_chunk(self, c: ChunkView) -> None:
        if self._header is None:
            raise _Reject("a chunk before the header")
        if self._current >= len(self._tensors):
            raise _Reject(f"a chunk of {_tensor_name(c.capture_id)} after every tensor was complete")
        want, tokens, rows = self._tensors[self._current], self._expect.num_tokens, self._rows
        span = f"chunk rows [{c.first_row}, {c.first_row + c.num_rows}) of {_tensor_name(want)}"
        if c.capture_id != want:
            raise _Reject(f"a chunk of {_tensor_name(c.capture_id)} while {_tensor_name(want)} has {rows} of "
                          f"{tokens} rows (expected layer after layer: capture ids ascending, then the final norm)")
        if c.first_row != rows:
            raise _Reject(f"{span}: expected first row {rows}" + (" (a gap)" if c.first_row > rows else " (an overlap)"))
        if c.num_rows < 1 or c.num_rows > tokens - rows:
            raise _Reject(f"{span} are outside [0, {tokens})")
        if len(c.data) != c.num_rows * self._row_bytes:
            raise _Reject(f"a chunk of {c.num_rows} rows of {_tensor_name(want)} holds {len(c.data)} bytes, expected "
                          f"{c.num_rows * self._row_bytes} (whole rows of {self._header.hidden_size} values)")
        # The rows are read where grpcio put them: hashed, copied into place once, scanned.
        self._hasher.update(c.data)
        self._targets[self._current][rows:rows + c.num_rows] = np.frombuffer(c.data, dtype=self._dtype).reshape(
            c.num_rows, self._header.hidden_size)
        self._values[self._current].scan(c.data)
        self._rows += c.num_rows
        if self._rows == tokens:
            self._digests.append(self._hasher.intdigest())
            self._hasher.reset()
            self._current += 1
            self._rows = 0

    def _on_trailer(self, t: hsx_pb2.Trailer) -> None:
        if self._header is None:
            raise _Reject("a trailer before the header")
        if self._current < len(self._tensors):
            raise _Reject(f"the trailer came while {_tensor_name(self._tensors[self._current])} had {self._rows} of "
                          f"{self._expect.num_tokens} rows")
        if t.token_ids_xxh64 != self._token_hash:
            raise _Reject(f"the trailer's token-id hash {t.token_ids_xxh64:016x} differs from the request's "
                          f"{self._token_hash:016x}")
        seen = [False] * len(self._tensors)
        for checksum in t.checksums:
            if checksum.capture_id not in self._tensors:
                raise _Reject(f"the trailer has a checksum for {_tensor_name(checksum.capture_id)}, which was not sent")
            i = self._tensors.index(checksum.capture_id)
            if seen[i]:
                raise _Reject(f"the trailer has two checksums for {_tensor_name(self._tensors[i])}")
            seen[i] = True
            said = checksum.xxh3_64 if self._checksum == hsx_pb2.CHECKSUM_XXH3_64 else checksum.xxh64
            if said != self._digests[i]:
                raise _Reject(f"{_tensor_name(self._tensors[i])}: the received bytes hash to {self._digests[i]:016x} "
                              f"({_CHECKSUM_NAMES[self._checksum]}), the trailer says {said:016x} "
                              "(corrupted in transit or assembled wrongly)")
        for i, ok in enumerate(seen):
            if not ok:
                raise _Reject(f"the trailer has no checksum for {_tensor_name(self._tensors[i])}")
        self._trailer = True


def _make_sample(hidden_states: np.ndarray, final_norm: np.ndarray | None, capture_ids: list[int], sample_id: str,
                 token_ids: Sequence[int], loss_mask: Sequence[int] | None, use_torch: bool,
                 index: int | None) -> Sample:
    """The Sample of a verified stream, whichever decoder received it."""
    tensors = {"hidden_states": hidden_states, "token_ids": np.asarray(token_ids, dtype=np.int64)}
    if loss_mask is not None:
        tensors["loss_mask"] = np.asarray(loss_mask, dtype=np.int64)
    if final_norm is not None:
        tensors["final_norm_hidden_states"] = final_norm
    if use_torch:
        tensors = {k: to_torch(v) for k, v in tensors.items()}
    return Sample(tensors, capture_ids=capture_ids, sample_id=sample_id, index=index)


class NativeRpcError(grpc.RpcError):
    """A native call's gRPC status, raised as grpcio raises one, so that Client's
    retries treat both receive paths alike."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self._code, self._message = code, message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message


def native_expectation(expect: StreamExpectation) -> dict[str, Any]:
    """StreamExpectation as hsx._native takes it (C++'s StreamExpectation's fields)."""
    return {"sample_id": expect.sample_id, "num_tokens": expect.num_tokens, "token_ids_xxh64": expect.token_ids_xxh64,
            "capture_ids": list(expect.capture_ids), "final_norm": expect.final_norm, "dtype": expect.dtype,
            "checksum": expect.checksum, "hidden_size": expect.hidden_size, "num_layers": expect.num_layers,
            "model_name": expect.model_name}


def native_sample(outcome: Any, expect: StreamExpectation, loss_mask: Sequence[int] | None = None,
                  use_torch: bool = False, index: int | None = None) -> Sample:
    """The Sample of a stream that hsx._native received and judged (its Outcome), or
    what the pure-Python path raises for the same stream: NativeRpcError for the
    call's status, IntegrityError for a stream that failed a check. The arrays wrap
    the module's buffers (no copy) and are writable."""
    if outcome.kind == "rpc":
        raise NativeRpcError(_STATUS_CODES.get(outcome.code, grpc.StatusCode.UNKNOWN), outcome.message)
    if outcome.kind != "ok":
        raise IntegrityError(f"sample {expect.sample_id!r}: {outcome.message}")
    dtype = NUMPY_DTYPES[expect.dtype]
    hidden_states = np.frombuffer(outcome.hidden_states, dtype).reshape(
        outcome.tokens, len(outcome.capture_ids), outcome.hidden)
    final_norm = None
    if outcome.final_norm is not None:
        final_norm = np.frombuffer(outcome.final_norm, dtype).reshape(outcome.tokens, outcome.hidden)
    return _make_sample(hidden_states, final_norm, list(outcome.capture_ids), expect.sample_id, expect.token_ids,
                        loss_mask, use_torch, index)


class _Reject(Exception):
    """A check failed (StreamDecoder turns it into IntegrityError)."""


_EXPONENT = {"bf16": 0x7F80, "fp16": 0x7C00, "fp32": 0x7F800000}


def _check_values(array: np.ndarray, names: list[str]) -> None:
    """[T, L, H]: every value finite (the first bad one named, scanning in row
    order as hsx-dump does), then no layer all zeros (-0.0 counts as zero)."""
    name = next(k for k, v in NUMPY_DTYPES.items() if v == array.dtype)
    bits = array.view(np.uint32 if array.dtype.itemsize == 4 else np.uint16)
    exponent = _EXPONENT[name]
    bad = (bits & exponent) == exponent
    if bad.any():
        t, l, i = np.unravel_index(int(np.argmax(bad)), bad.shape)
        value = float(array[t, l, i])
        text = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        raise _Reject(f"non-finite value ({text}) in {names[l]} row {t} column {i}")
    magnitude = (1 << (8 * array.dtype.itemsize - 1)) - 1  # every bit but the sign
    nonzero = (bits & np.array(magnitude, dtype=bits.dtype)).any(axis=(0, 2))
    for l, ok in enumerate(nonzero):
        if not ok:
            raise _Reject(f"{names[l]} is all zeros")


class _ValueScan:
    """Whether one tensor's values, scanned chunk by chunk as they arrive, are
    all finite with at least one non-zero: the checks _check_values makes, in two
    read-only vectorised passes. A value's bits without the sign (its magnitude)
    are at least the exponent mask exactly when its exponent is all ones (inf or
    nan), and zero exactly when it is +-0; so the largest magnitude says both.
    It is the larger of the largest value read as a signed integer (the values
    with the sign clear) and the largest read as unsigned, less the sign bit (the
    values with the sign set). clean is False when either check fails;
    _check_values then names the failure."""

    def __init__(self, dtype: str) -> None:
        bits = 8 * NUMPY_DTYPES[dtype].itemsize
        self._int = np.dtype(f"<i{bits // 8}")
        self._uint = np.dtype(f"<u{bits // 8}")
        self._sign = 1 << (bits - 1)
        self._exponent = _EXPONENT[dtype]
        self._finite = True
        self._nonzero = False

    @property
    def clean(self) -> bool:
        return self._finite and self._nonzero

    def scan(self, data: bytes | memoryview) -> None:
        """Takes the next rows' bytes."""
        signed = np.frombuffer(data, dtype=self._int)
        sign_clear = max(int(signed.max()), 0)  # negative when every value has the sign set
        sign_set = max(int(signed.view(self._uint).max()) - self._sign, 0)  # below the sign bit when none has it
        largest = max(sign_clear, sign_set)
        self._finite &= largest < self._exponent
        self._nonzero |= largest > 0


def assemble(responses: Iterable[hsx_pb2.ExtractResponse | ChunkView], expect: StreamExpectation,
             loss_mask: Sequence[int] | None = None, use_torch: bool = False, index: int | None = None) -> Sample:
    """Reads one Extract stream and returns a verified Sample (or raises IntegrityError;
    a gRPC error of the stream propagates as grpc.RpcError)."""
    decoder = StreamDecoder(expect)
    for message in responses:
        decoder.consume(message)
    return decoder.finish(expect.token_ids, loss_mask, use_torch, index)


class Client:
    """A connection to one hsx-server.

    target: "host:port" (or any gRPC target such as "dns:///svc:50051").
    token: bearer token sent as "authorization: Bearer <token>".
    tls: None (plaintext), True (TLS with system roots), or a dict with any of
         ca / cert / key (PEM bytes or file paths; cert+key for mTLS).
    retries, backoff: UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED are
         retried with exponential backoff and jitter; a retry restarts the sample.

    native: how streams are received. None (the default): by the native module
         hsx._native where it was built and the environment does not set HSX_NATIVE=0,
         else by grpcio and StreamDecoder; True: the native module or ImportError;
         False: grpcio. Both make the same checks and give the same Samples; the
         native path costs about 0.6 times grpcio's CPU per byte (docs/BENCHMARKS.md).
         The first native client sets glibc's malloc thresholds and arena limit for
         the process (client/README.md says why); HSX_NATIVE_MALLOPT=0 leaves them
         alone.

    Every stream is checked against the request and the model the server announced
    (GetModelInfo, asked once before the first sample): by StreamDecoder, or by the
    C++ StreamAssembler that hsx-dump uses.
    """

    def __init__(self, target: str, token: str | None = None, tls: bool | dict[str, Any] | None = None,
                 timeout: float = 600.0, retries: int = 8, backoff: float = 0.2,
                 options: Sequence[tuple[str, Any]] | None = None, native: bool | None = None) -> None:
        self._metadata = [("authorization", f"Bearer {token}")] if token else []
        self._token = token or ""
        # The native path makes every call (Extract and GetModelInfo) on its own channel: one
        # connection per server, and grpcio's channel is not made at all.
        self._native = _native_channel(native, target, tls, [("grpc.max_receive_message_length", 64 << 20)] +
                                       list(options or []))
        self._channel: grpc.Channel | None = None
        if self._native is None:
            # SingleThreadedUnaryStream (grpcio's experimental.ChannelOptions): each Extract runs on
            # the thread that iterates it instead of handing every message over from grpcio's
            # thread; 0.91-0.95x the client's CPU per byte (bench/python_ab.py, docs/BENCHMARKS.md).
            channel_options = [("grpc.max_receive_message_length", 64 << 20),
                               (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)] + list(options or [])
            if tls:
                credentials = grpc.ssl_channel_credentials(**_tls_args(tls))
                self._channel = grpc.secure_channel(target, credentials, options=channel_options)
            else:
                self._channel = grpc.insecure_channel(target, options=channel_options)
            self._stub = hsx_pb2_grpc.HiddenStatesStub(self._channel)
            # Extract with parse_response: chunks' rows are read where grpcio put them.
            self._extract = self._channel.unary_stream(
                "/hsx.v1.HiddenStates/Extract", request_serializer=hsx_pb2.ExtractRequest.SerializeToString,
                response_deserializer=parse_response)
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._counter = itertools.count(1)
        self._info: hsx_pb2.ModelInfo | None = None
        self._info_lock = threading.Lock()

    @property
    def native(self) -> bool:
        """Whether streams are received by the native module (see the class doc)."""
        return self._native is not None

    def close(self) -> None:
        if self._native is not None:
            self._native.close()
        if self._channel is not None:
            self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def model_info(self) -> dict[str, Any]:
        """The server's ModelInfo as a dict (field names as in the proto), asked now;
        later samples are checked against it."""
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(self._model_info(refresh=True), preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

    def _model_info(self, refresh: bool = False) -> hsx_pb2.ModelInfo:
        """ModelInfo, asked once (or again with refresh)."""
        with self._info_lock:
            if self._info is None or refresh:
                self._info = self._call(self._ask_model_info)
            return self._info

    def _ask_model_info(self) -> hsx_pb2.ModelInfo:
        request = hsx_pb2.GetModelInfoRequest()
        if self._native is None:
            return self._stub.GetModelInfo(request, timeout=30, metadata=self._metadata)
        code, message, response = self._native.unary("/hsx.v1.HiddenStates/GetModelInfo", request.SerializeToString(),
                                                     30.0, self._token)
        if code != 0:
            raise NativeRpcError(_STATUS_CODES.get(code, grpc.StatusCode.UNKNOWN), message)
        try:
            return hsx_pb2.ModelInfo.FromString(response)
        except DecodeError as error:  # INTERNAL, as grpcio reports a response its deserializer refuses
            raise NativeRpcError(grpc.StatusCode.INTERNAL,
                                 f"GetModelInfo: the response is not a ModelInfo ({error})") from None

    def extract(self, token_ids: Sequence[int], capture: Sequence[int] | None = None, dtype: str | None = None,
                final_norm: bool = False, torch: bool = False, sample_id: str | None = None,
                loss_mask: Sequence[int] | None = None, index: int | None = None, checksum: str = "xxh3") -> Sample:
        """One sample's verified states (see hsx.Sample). capture: capture ids, or None
        for the server's default set; dtype: "bf16" | "fp16" | "fp32" | None (the
        server's default); loss_mask: copied into the Sample (it never leaves the client);
        checksum: "xxh3" | "xxh64", how the stream is verified (XXH3 costs a third of
        XXH64 per byte; a server that predates the choice sends XXH64, which is then verified)."""
        token_ids = [int(t) for t in token_ids]
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum {checksum!r}: expected one of {sorted(CHECKSUMS)}")
        if loss_mask is not None and len(loss_mask) != len(token_ids):
            raise ValueError(f"loss_mask has {len(loss_mask)} values for {len(token_ids)} tokens")
        if sample_id is None:
            sample_id = f"py-{next(self._counter)}"
        info = self._model_info()
        expect = StreamExpectation(
            sample_id=str(sample_id), token_ids=tuple(token_ids),
            capture_ids=tuple(sorted(set(int(c) for c in capture)) if capture else tuple(info.default_capture_ids)),
            # A request without capture ids gets the final norm too if the server runs with --final-norm.
            final_norm=True if final_norm else (False if capture else None),
            dtype=dtype or DTYPE_NAMES.get(info.default_dtype, "bf16"), checksum=checksum,
            hidden_size=info.hidden_size, num_layers=info.num_layers, model_name=info.model_name)
        request = hsx_pb2.ExtractRequest(
            sample_id=expect.sample_id, token_ids=token_ids, capture_ids=list(capture or []),
            dtype=DTYPES[dtype] if dtype else hsx_pb2.DTYPE_UNSPECIFIED, final_norm=final_norm,
            checksum=CHECKSUMS[checksum])
        if self._native is not None:
            return self._call(lambda: native_sample(
                self._native.extract(request.SerializeToString(), native_expectation(expect), self.timeout,
                                     self._token), expect, loss_mask, torch, index))
        return self._call(lambda: assemble(
            self._extract(request, timeout=self.timeout, metadata=self._metadata),
            expect, loss_mask=loss_mask, use_torch=torch, index=index))

    def extract_many(self, samples: Iterable[Sequence[int] | Mapping[str, Any]], concurrency: int = 8,
                     **kwargs: Any) -> Iterator[tuple[int, Sample]]:
        """Yields (index, Sample) in completion order, with at most `concurrency`
        samples in flight or waiting to be consumed. samples: token-id lists or
        dicts with "input_ids" (and optionally "id" and "loss_mask"). The Sample's
        .index is its position in `samples`."""
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            pending: dict[concurrent.futures.Future, int] = {}
            source = enumerate(samples)
            exhausted = False
            while True:
                while not exhausted and len(pending) < concurrency:
                    try:
                        index, item = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    ids, sid, mask = _fields(item, index)
                    pending[pool.submit(self.extract, ids, sample_id=sid, loss_mask=mask, index=index,
                                        **kwargs)] = index
                if not pending:
                    return
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                # No name in this frame holds a finished future (it holds its sample) while
                # suspended: a sample the caller has let go of is freed before the next calls
                # start, and the native path reuses its memory for them.
                ready = [(pending.pop(future), future) for future in done]
                del done
                while ready:
                    index = ready[0][0]
                    yield index, ready.pop(0)[1].result()

    def _call(self, fn: Callable[[], T]) -> T:
        """fn(), retrying the retryable statuses; any other status raises ServerError."""
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except grpc.RpcError as error:
                code = error.code()
                if code not in RETRYABLE or attempt == self.retries:
                    raise ServerError(code, error.details()) from None
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")


def _fields(item: Sequence[int] | Mapping[str, Any], index: int) -> tuple[Sequence[int], str, Sequence[int] | None]:
    """(token ids, sample id, loss mask or None) of one input of extract_many."""
    if isinstance(item, Mapping):
        return item["input_ids"], str(item.get("id", index)), item.get("loss_mask")
    return item, str(index), None


def _native_channel(native: bool | None, target: str, tls: bool | dict[str, Any] | None,
                    options: list[tuple[str, Any]]) -> Any:
    """The native module's channel, or None for grpcio's path (see Client's native)."""
    if native is None:
        native = _native is not None and os.environ.get("HSX_NATIVE", "1") != "0"
    if not native:
        return None
    if _native is None:
        raise ImportError(f"hsx._native cannot be used ({_NATIVE_MISSING}); it is built from client/python/native/ "
                          "by scripts/setup.sh --python")
    pem = _tls_args(tls) if tls else {}
    return _native.Channel(target, tls=bool(tls), ca=pem.get("root_certificates") or b"",
                           cert=pem.get("certificate_chain") or b"", key=pem.get("private_key") or b"",
                           options=options)


def _tls_args(tls: bool | dict[str, Any]) -> dict[str, bytes | None]:
    if tls is True:
        return {}

    def read(value: str | bytes | None) -> bytes | None:
        if value is None or isinstance(value, bytes):
            return value
        with open(value, "rb") as f:
            return f.read()
    return {"root_certificates": read(tls.get("ca")), "private_key": read(tls.get("key")),
            "certificate_chain": read(tls.get("cert"))}
