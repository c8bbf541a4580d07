"""hsx.StreamDecoder: the checks and reassembly of one Extract response stream,
the Python port of C++'s StreamAssembler, and the Sample it gives."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from . import fp8
from .arrays import NUMPY_DTYPES, to_torch
from .response_parser import ChunkView
from .sample import Sample
from .v1 import hsx_pb2

DTYPES = {"bf16": hsx_pb2.DTYPE_BF16, "fp16": hsx_pb2.DTYPE_FP16, "fp32": hsx_pb2.DTYPE_FP32,
          "fp8": hsx_pb2.DTYPE_FP8_E4M3}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FINAL_NORM = -1
# ExtractRequest.checksum: what a client may ask the Trailer's checksums to be (docs/api.md, "Checksums").
CHECKSUMS = {"xxh64": hsx_pb2.CHECKSUM_XXH64, "xxh3": hsx_pb2.CHECKSUM_XXH3_64}
_CHECKSUM_NAMES = {hsx_pb2.CHECKSUM_XXH64: "xxh64", hsx_pb2.CHECKSUM_XXH3_64: "xxh3_64"}
_HASHERS = {hsx_pb2.CHECKSUM_XXH64: xxhash.xxh64, hsx_pb2.CHECKSUM_XXH3_64: xxhash.xxh3_64}


class IntegrityError(Exception):
    """A response failed verification; nothing from it was returned."""


class _Reject(Exception):
    """A check failed (StreamDecoder turns it into IntegrityError)."""


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
        self._scales: list[np.ndarray] = []  # fp8: the scales of the layers [T, L, 1], then the final norm's [T, 1]
        self._scale_targets: list[np.ndarray] = []  # fp8: each tensor's scales as bytes [T, 4]
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
               use_torch: bool = False, index: int | None = None, dequantize: bool = True) -> Sample:
        """After the stream ended (status OK): the verified Sample (fp8: dequantized to
        bf16, or with dequantize=False the e4m3 values and their float32 scales)."""
        where = f"sample {self._expect.sample_id!r}"
        if self._error is not None:
            raise IntegrityError(f"{where}: {self._error}")
        if not self._trailer:
            raise IntegrityError(f"{where}: the stream ended without a trailer ({self._current} of "
                                 f"{len(self._tensors)} tensors complete)")
        layers = len(self._header.capture_ids)
        if self._expect.dtype == "fp8":
            return self._finish_fp8(where, token_ids, loss_mask, use_torch, index, dequantize)
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
        return make_sample(self._hidden_states, self._final, list(self._header.capture_ids), self._expect.sample_id,
                           token_ids, loss_mask, use_torch, index)

    def _finish_fp8(self, where: str, token_ids: Sequence[int], loss_mask: Sequence[int] | None, use_torch: bool,
                    index: int | None, dequantize: bool) -> Sample:
        """finish() for fp8: the values and scales (split as they came) checked (every
        scale finite and positive, no NaN, no layer all zeros), then dequantized unless
        not asked to."""
        values, scales, final, final_scales = self._hidden_states, self._scales[0], self._final, None
        problem = fp8.first_problem(values, scales, [_tensor_name(c) for c in self._header.capture_ids])
        if problem is None and final is not None:
            final_scales = self._scales[-1]
            problem = fp8.first_problem(final[:, None, :], final_scales[:, None, :], ["the final-norm state"])
        if problem is not None:
            raise IntegrityError(f"{where}: {problem}")
        if dequantize:
            values, scales = fp8.dequantize(values, scales), None
            final, final_scales = (None if final is None else fp8.dequantize(final, final_scales)), None
        return make_sample(values, final, list(self._header.capture_ids), self._expect.sample_id, token_ids,
                           loss_mask, use_torch, index, hidden_scales=scales, final_scales=final_scales)

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
        # Chunks go straight into their final places, the file's layout: captured layers
        # into the [T, L, H] array, the final norm into its own; fp8 rows (a scale, then H
        # e4m3 bytes) split as they come, their scales into [T, L, 1] and [T, 1] float32.
        self._hidden_states = np.empty((tokens, len(ids), hidden), dtype=dtype)
        self._final = np.empty((tokens, hidden), dtype=dtype) if h.final_norm else None
        self._tensors = ids + ([FINAL_NORM] if h.final_norm else [])
        self._scales = []
        if e.dtype == "fp8":
            self._row_bytes = hidden + fp8.SCALE_BYTES
            self._scales = [np.empty((tokens, len(ids), 1), dtype=np.float32)]
            if h.final_norm:
                self._scales.append(np.empty((tokens, 1), dtype=np.float32))
        # What a chunk's rows are read as (fp8: bytes), and each tensor's rows as such.
        self._dtype = np.dtype(np.uint8) if e.dtype == "fp8" else dtype
        self._row_values = self._row_bytes // self._dtype.itemsize
        self._targets = [self._hidden_states.view(self._dtype)[:, l, :] for l in range(len(ids))]
        self._scale_targets = [self._scales[0].view(np.uint8)[:, l, :] for l in range(len(ids))] if self._scales else []
        if h.final_norm:
            self._targets.append(self._final.view(self._dtype))
            if self._scales:
                self._scale_targets.append(self._scales[-1].view(np.uint8))
        self._values = [_ValueScan(e.dtype) for _ in self._tensors] if e.dtype != "fp8" else []
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
        data = np.frombuffer(c.data, dtype=self._dtype).reshape(c.num_rows, self._row_values)
        if self._scale_targets:  # fp8: each row's scale to the scales, its values to the values
            self._scale_targets[self._current][rows:rows + c.num_rows] = data[:, :fp8.SCALE_BYTES]
            data = data[:, fp8.SCALE_BYTES:]
        self._targets[self._current][rows:rows + c.num_rows] = data
        if self._values:
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


def make_sample(hidden_states: np.ndarray, final_norm: np.ndarray | None, capture_ids: list[int], sample_id: str,
                token_ids: Sequence[int], loss_mask: Sequence[int] | None, use_torch: bool,
                index: int | None, hidden_scales: np.ndarray | None = None,
                final_scales: np.ndarray | None = None) -> Sample:
    """The Sample of a verified stream, whichever decoder received it; fp8 not
    dequantized has its scales too (the file's *_scales tensors)."""
    tensors = {"hidden_states": hidden_states, "token_ids": np.asarray(token_ids, dtype=np.int64)}
    if hidden_scales is not None:
        tensors[fp8.SCALES["hidden_states"]] = hidden_scales
    if loss_mask is not None:
        tensors["loss_mask"] = np.asarray(loss_mask, dtype=np.int64)
    if final_norm is not None:
        tensors["final_norm_hidden_states"] = final_norm
    if final_scales is not None:
        tensors[fp8.SCALES["final_norm_hidden_states"]] = final_scales
    if use_torch:
        tensors = {k: to_torch(v) for k, v in tensors.items()}
    return Sample(tensors, capture_ids=capture_ids, sample_id=sample_id, index=index)


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
             loss_mask: Sequence[int] | None = None, use_torch: bool = False, index: int | None = None,
             dequantize: bool = True) -> Sample:
    """Reads one Extract stream and returns a verified Sample (or raises IntegrityError;
    a gRPC error of the stream propagates as grpc.RpcError); fp8 dequantized unless
    dequantize=False (StreamDecoder.finish)."""
    decoder = StreamDecoder(expect)
    for message in responses:
        decoder.consume(message)
    return decoder.finish(expect.token_ids, loss_mask, use_torch, index, dequantize)
