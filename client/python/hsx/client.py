"""hsx.Client: extract verified hidden states from an hsx-server."""

import concurrent.futures
import random
import time
from collections.abc import Mapping

import grpc
import numpy as np
import xxhash

from .arrays import NUMPY_DTYPES, to_torch
from .v1 import hsx_pb2, hsx_pb2_grpc

DTYPES = {"bf16": hsx_pb2.DTYPE_BF16, "fp16": hsx_pb2.DTYPE_FP16, "fp32": hsx_pb2.DTYPE_FP32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FINAL_NORM = -1
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED)


class IntegrityError(Exception):
    """A response failed verification; nothing from it was returned."""


class ServerError(Exception):
    """The server refused or failed the request (not retried, or out of retries)."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class Sample(Mapping):
    """One verified sample: the keys, shapes and dtypes of an hsx-dump file.

    hidden_states [T, L, H] (layers in ascending capture id), token_ids [T] int64,
    final_norm_hidden_states [T, H] when asked for; plus .capture_ids and .sample_id.
    """

    def __init__(self, tensors, capture_ids, sample_id):
        self._tensors = tensors
        self.capture_ids = list(capture_ids)
        self.sample_id = sample_id

    def __getitem__(self, key):
        return self._tensors[key]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self):
        return len(self._tensors)

    def __repr__(self):
        shapes = {k: tuple(v.shape) for k, v in self._tensors.items()}
        return f"Sample(id={self.sample_id!r}, capture_ids={self.capture_ids}, {shapes})"


def token_hash(token_ids):
    return xxhash.xxh64(np.asarray(token_ids, dtype="<i8").tobytes()).intdigest()


def assemble(responses, token_ids, sample_id, capture_ids, final_norm, use_torch=False):
    """Reads one Extract stream and returns a verified Sample (or raises IntegrityError)."""
    it = iter(responses)
    first = next(it, None)
    if first is None or first.WhichOneof("part") != "header":
        raise IntegrityError(f"sample {sample_id!r}: stream does not start with a header")
    header = first.header
    n, hidden = len(token_ids), header.hidden_size
    if header.sample_id != sample_id or header.num_tokens != n:
        raise IntegrityError(f"sample {sample_id!r}: header is for {header.sample_id!r} with "
                             f"{header.num_tokens} tokens, sent {n}")
    if header.token_ids_xxh64 != token_hash(token_ids):
        raise IntegrityError(f"sample {sample_id!r}: token-id hash differs from the request's")
    if capture_ids is not None and list(header.capture_ids) != sorted(set(capture_ids)):
        raise IntegrityError(f"sample {sample_id!r}: capture ids {list(header.capture_ids)} "
                             f"are not the requested {sorted(set(capture_ids))}")
    if header.final_norm != bool(final_norm) and (capture_ids is not None or final_norm):
        raise IntegrityError(f"sample {sample_id!r}: final-norm state not as requested")
    dtype_name = DTYPE_NAMES.get(header.dtype)
    if dtype_name is None:
        raise IntegrityError(f"sample {sample_id!r}: unknown dtype {header.dtype}")
    dtype = NUMPY_DTYPES[dtype_name]
    order = list(header.capture_ids) + ([FINAL_NORM] if header.final_norm else [])
    row_bytes = hidden * dtype.itemsize
    # Chunks go straight into their final places: captured layers into the
    # [T, L, H] array, the final norm into its own; each tensor's checksum is
    # computed as its rows stream in (they must arrive in order anyway).
    layers = len(header.capture_ids)
    hidden_states = np.empty((n, layers, hidden), dtype=dtype)
    final = np.empty((n, hidden), dtype=dtype) if header.final_norm else None
    targets = [hidden_states[:, l, :] for l in range(layers)] + ([final] if header.final_norm else [])
    hashers = [xxhash.xxh64() for _ in order]
    position = 0  # index into `order` of the tensor being received
    next_row = 0
    trailer = None
    for message in it:
        part = message.WhichOneof("part")
        if part == "chunk":
            chunk = message.chunk
            if position < len(order) and chunk.capture_id != order[position] and next_row == n:
                position, next_row = position + 1, 0
            if position >= len(order) or chunk.capture_id != order[position] or chunk.first_row != next_row:
                raise IntegrityError(f"sample {sample_id!r}: chunk for capture {chunk.capture_id} "
                                     f"row {chunk.first_row} out of order")
            if chunk.num_rows <= 0 or next_row + chunk.num_rows > n or len(chunk.data) != chunk.num_rows * row_bytes:
                raise IntegrityError(f"sample {sample_id!r}: malformed chunk for capture {chunk.capture_id}")
            hashers[position].update(chunk.data)
            rows = np.frombuffer(chunk.data, dtype=dtype).reshape(chunk.num_rows, hidden)
            targets[position][next_row:next_row + chunk.num_rows] = rows
            next_row += chunk.num_rows
        elif part == "trailer":
            trailer = message.trailer
        elif part == "summary":
            raise IntegrityError("summary responses carry no tensors; use the raw stub for them")
    if trailer is None:
        raise IntegrityError(f"sample {sample_id!r}: stream ended without a trailer")
    if not (position == len(order) - 1 and next_row == n) and order:
        raise IntegrityError(f"sample {sample_id!r}: stream ended before all rows arrived")
    if trailer.token_ids_xxh64 != header.token_ids_xxh64:
        raise IntegrityError(f"sample {sample_id!r}: trailer token hash differs from the header's")
    sums = {c.capture_id: c.xxh64 for c in trailer.checksums}
    for k, t in enumerate(order):
        if sums.get(t) != hashers[k].intdigest():
            raise IntegrityError(f"sample {sample_id!r}: checksum mismatch for capture {t}")
    if not _all_finite(hidden_states) or (final is not None and not _all_finite(final)):
        raise IntegrityError(f"sample {sample_id!r}: non-finite values in the states")
    for l, t in enumerate(header.capture_ids):
        if not _any_nonzero(targets[l]):
            raise IntegrityError(f"sample {sample_id!r}: capture {t} is all zeros")
    tensors = {"hidden_states": hidden_states, "token_ids": np.asarray(token_ids, dtype=np.int64)}
    if header.final_norm:
        tensors["final_norm_hidden_states"] = final
    if use_torch:
        tensors = {k: to_torch(v) for k, v in tensors.items()}
    return Sample(tensors, header.capture_ids, sample_id)


def _bits(array):
    """The raw bits of a float array, as unsigned integers of the same width."""
    return array.view(np.uint32 if array.dtype.itemsize == 4 else np.uint16)


def _all_finite(array):
    # Exponent all ones means inf or NaN, whatever the format.
    exponent = {4: 0x7F800000, 2: 0x7F80 if array.dtype == NUMPY_DTYPES["bf16"] else 0x7C00}[array.dtype.itemsize]
    return not np.any((_bits(array) & exponent) == exponent)


def _any_nonzero(array):
    sign = 0x80000000 if array.dtype.itemsize == 4 else 0x8000
    return bool(np.any(_bits(array) & ~np.array(sign, dtype=_bits(array).dtype)))


class Client:
    """A connection to one hsx-server.

    target: "host:port" (or any gRPC target such as "dns:///svc:50051").
    token: bearer token sent as "authorization: Bearer <token>".
    tls: None (plaintext), True (TLS with system roots), or a dict with any of
         ca / cert / key (PEM bytes or file paths; cert+key for mTLS).
    retries, backoff: UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED are
         retried with exponential backoff and jitter; a retry restarts the sample.
    """

    def __init__(self, target, token=None, tls=None, timeout=600.0, retries=8, backoff=0.2,
                 options=None):
        channel_options = [("grpc.max_receive_message_length", 64 << 20)] + list(options or [])
        if tls:
            credentials = grpc.ssl_channel_credentials(**_tls_args(tls))
            self._channel = grpc.secure_channel(target, credentials, options=channel_options)
        else:
            self._channel = grpc.insecure_channel(target, options=channel_options)
        self._stub = hsx_pb2_grpc.HiddenStatesStub(self._channel)
        self._metadata = [("authorization", f"Bearer {token}")] if token else []
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._counter = 0

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def model_info(self):
        """The server's ModelInfo as a dict (field names as in the proto)."""
        from google.protobuf.json_format import MessageToDict

        info = self._call(lambda: self._stub.GetModelInfo(
            hsx_pb2.GetModelInfoRequest(), timeout=30, metadata=self._metadata))
        return MessageToDict(info, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

    def extract(self, token_ids, capture=None, dtype=None, final_norm=False, torch=False,
                sample_id=None):
        """One sample's verified states (see Sample). capture: list of ids or None
        for the server's default; dtype: "bf16" | "fp16" | "fp32" | None."""
        token_ids = [int(t) for t in token_ids]
        if sample_id is None:
            self._counter += 1
            sample_id = f"py-{self._counter}"
        request = hsx_pb2.ExtractRequest(
            sample_id=str(sample_id), token_ids=token_ids, capture_ids=list(capture or []),
            dtype=DTYPES[dtype] if dtype else hsx_pb2.DTYPE_UNSPECIFIED, final_norm=final_norm)
        return self._call(lambda: assemble(
            self._stub.Extract(request, timeout=self.timeout, metadata=self._metadata),
            token_ids, str(sample_id), capture, final_norm, use_torch=torch))

    def extract_many(self, samples, concurrency=8, **kwargs):
        """Yields (index, Sample) in completion order, with at most `concurrency`
        samples in flight or waiting to be consumed. samples: token-id lists or
        dicts with "input_ids" (and optionally "id")."""
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            pending = {}
            source = enumerate(samples)
            exhausted = False
            while True:
                while not exhausted and len(pending) < concurrency:
                    try:
                        index, item = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    ids, sid = _ids_and_id(item, index)
                    pending[pool.submit(self.extract, ids, sample_id=sid, **kwargs)] = index
                if not pending:
                    return
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    index = pending.pop(future)
                    yield index, future.result()

    def _call(self, fn):
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


def _ids_and_id(item, index):
    if isinstance(item, Mapping):
        return item["input_ids"], str(item.get("id", index))
    return item, str(index)


def _tls_args(tls):
    if tls is True:
        return {}
    def read(value):
        if value is None or isinstance(value, bytes):
            return value
        with open(value, "rb") as f:
            return f.read()
    return {"root_certificates": read(tls.get("ca")), "private_key": read(tls.get("key")),
            "certificate_chain": read(tls.get("cert"))}
