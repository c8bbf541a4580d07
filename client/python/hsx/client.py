"""hsx.Client: extract verified hidden states from an hsx-server."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import grpc.experimental
import numpy as np
from google.protobuf.message import DecodeError

from .arrays import NUMPY_DTYPES
from .capture import parse_capture
from .response_parser import parse_response
from .sample import Sample
from .stream_decoder import CHECKSUMS, DTYPE_NAMES, DTYPES, IntegrityError, StreamExpectation, assemble, make_sample
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

T = TypeVar("T")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED)
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class ServerError(Exception):
    """The server refused or failed the request (not retried, or out of retries)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


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
                  use_torch: bool = False, index: int | None = None, dequantize: bool = True) -> Sample:
    """The Sample of a stream that hsx._native received and judged (its Outcome), or
    what the pure-Python path raises for the same stream: NativeRpcError for the
    call's status, IntegrityError for a stream that failed a check. The arrays wrap
    the module's buffers (no copy) and are writable. `dequantize` must be what the
    module was asked (its outcome holds the scales exactly when it was not)."""
    if outcome.kind == "rpc":
        raise NativeRpcError(_STATUS_CODES.get(outcome.code, grpc.StatusCode.UNKNOWN), outcome.message)
    if outcome.kind != "ok":
        raise IntegrityError(f"sample {expect.sample_id!r}: {outcome.message}")
    # fp8: the module checked the rows (scales included) as they arrived, split into the file's
    # e4m3 values and float32 scales, and hands them on so (dequantize=False) or dequantized to
    # bf16 (format/fp8.h's DequantizeFp8ToBf16: what hsx.fp8.dequantize gives, bit for bit).
    raw_fp8 = expect.dtype == "fp8" and not dequantize
    dtype = NUMPY_DTYPES["bf16" if expect.dtype == "fp8" and dequantize else expect.dtype]
    tokens, layers, hidden = outcome.tokens, len(outcome.capture_ids), outcome.hidden
    hidden_states = np.frombuffer(outcome.hidden_states, dtype).reshape(tokens, layers, hidden)
    final_norm = hidden_scales = final_scales = None
    if outcome.final_norm is not None:
        final_norm = np.frombuffer(outcome.final_norm, dtype).reshape(tokens, hidden)
    if raw_fp8:
        hidden_scales = np.frombuffer(outcome.hidden_scales, np.float32).reshape(tokens, layers, 1)
        if outcome.final_scales is not None:
            final_scales = np.frombuffer(outcome.final_scales, np.float32).reshape(tokens, 1)
    return make_sample(hidden_states, final_norm, list(outcome.capture_ids), expect.sample_id, expect.token_ids,
                       loss_mask, use_torch, index, hidden_scales=hidden_scales, final_scales=final_scales)


# hsx-dump's --stream-window default and bounds (client/dump/remote_extractor.h; a test of
# test_python_client.py checks them against hsx-dump's).
DEFAULT_STREAM_WINDOW = 4 << 20
_MIN_STREAM_WINDOW, _MAX_STREAM_WINDOW = 64 << 10, 1 << 30


class Client:
    """A connection to one hsx-server.

    target: "host:port" (or any gRPC target such as "dns:///svc:50051").
    token: bearer token sent as "authorization: Bearer <token>".
    tls: None (plaintext), True (TLS with system roots), or a dict with any of
         ca / cert / key (PEM bytes or file paths; cert+key for mTLS).
    retries, backoff: UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED are
         retried with exponential backoff and jitter; a retry restarts the sample.

    stream_window: the HTTP/2 flow-control window of each sample's stream, how far the
         server may send ahead of what this client has read: 4 MiB by default (hsx-dump's
         --stream-window), 64 KiB to 1 GiB, or 0 for gRPC's automatic window (BDP probing),
         whose buffers grow: with it the native path faulted in 2-3 times the fresh pages
         per pass and cost more CPU per byte (docs/BENCHMARKS.md). 4 MiB per stream allows
         4 GB/s per stream at a 1 ms round trip. `options` given for the same channel
         arguments override it.
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

    fp8 samples (dtype="fp8": e4m3 with a float32 scale per token per layer, hsx.fp8) are
    given dequantized to bf16 by default; extract(..., dequantize=False) gives them as
    received, the tensors read_sample(path, dequantize=False) gives for hsx-dump's file of
    the same sample (e4m3 hidden_states and its float32 hidden_states_scales, likewise the
    final norm): for a trainer that dequantizes on its GPU, half the bytes to copy there.
    """

    def __init__(self, target: str, token: str | None = None, tls: bool | dict[str, Any] | None = None,
                 timeout: float = 600.0, retries: int = 8, backoff: float = 0.2,
                 options: Sequence[tuple[str, Any]] | None = None, native: bool | None = None,
                 stream_window: int = DEFAULT_STREAM_WINDOW) -> None:
        options = [("grpc.max_receive_message_length", 64 << 20), *_window_options(stream_window), *(options or [])]
        self._metadata = [("authorization", f"Bearer {token}")] if token else []
        self._token = token or ""
        # The native path makes every call (Extract and GetModelInfo) on its own channel: one
        # connection per server, and grpcio's channel is not made at all.
        self._native = _native_channel(native, target, tls, options)
        self._channel: grpc.Channel | None = None
        if self._native is None:
            # SingleThreadedUnaryStream (grpcio's experimental.ChannelOptions): each Extract runs on
            # the thread that iterates it instead of handing every message over from grpcio's
            # thread; 0.91-0.95x the client's CPU per byte (bench/python_ab.py, docs/BENCHMARKS.md).
            channel_options = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1), *options]
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

    def extract(self, token_ids: Sequence[int], capture: Sequence[int] | str | None = None,
                dtype: str | None = None, final_norm: bool = False, torch: bool = False, sample_id: str | None = None,
                loss_mask: Sequence[int] | None = None, index: int | None = None, checksum: str = "xxh3",
                dequantize: bool = True) -> Sample:
        """One sample's verified states (see hsx.Sample). capture: capture ids, a name
        ("eagle3", "all", or a trainer's exact set "speculators" | "specforge" | "modelopt";
        hsx.capture) or None for the server's default set; dtype: "bf16" | "fp16" | "fp32" | "fp8" | None (the
        server's default); loss_mask: copied into the Sample (it never leaves the client);
        checksum: "xxh3" | "xxh64", how the stream is verified (XXH3 costs a third of
        XXH64 per byte; a server that predates the choice sends XXH64, which is then verified);
        dequantize: for fp8, True gives bf16 states, False the e4m3 values and their float32
        *_scales tensors as received (read_sample's keyword; no effect on other dtypes)."""
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
        if isinstance(capture, str):  # a name, resolved against the served model's layer count
            capture, final_norm = parse_capture(capture, info.num_layers, final_norm)
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
        dequantize = bool(dequantize)
        if self._native is not None:
            return self._call(lambda: native_sample(
                self._native.extract(request.SerializeToString(), native_expectation(expect), self.timeout,
                                     self._token, dequantize), expect, loss_mask, torch, index, dequantize))
        return self._call(lambda: assemble(
            self._extract(request, timeout=self.timeout, metadata=self._metadata),
            expect, loss_mask=loss_mask, use_torch=torch, index=index, dequantize=dequantize))

    def extract_many(self, samples: Iterable[Sequence[int] | Mapping[str, Any]], concurrency: int = 8,
                     **kwargs: Any) -> Iterator[tuple[int, Sample]]:
        """Yields (index, Sample) in completion order, with at most `concurrency`
        samples in flight or waiting to be consumed. samples: token-id lists or
        dicts with "input_ids" (and optionally "id" and "loss_mask"). The Sample's
        .index is its position in `samples`. kwargs: extract's (capture, dtype,
        final_norm, torch, checksum, dequantize)."""
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


def _window_options(stream_window: int) -> list[tuple[str, int]]:
    """The channel arguments of Client's stream_window (none for 0, gRPC's automatic window)."""
    if isinstance(stream_window, bool) or not isinstance(stream_window, int) or not (
            stream_window == 0 or _MIN_STREAM_WINDOW <= stream_window <= _MAX_STREAM_WINDOW):
        raise ValueError(f"stream_window={stream_window!r}: expected 0 (gRPC's automatic window) or a number of "
                         f"bytes from {_MIN_STREAM_WINDOW} (64 KiB) to {_MAX_STREAM_WINDOW} (1 GiB)")
    if stream_window == 0:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", stream_window)]


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
