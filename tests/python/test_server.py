"""hsx-server end to end: real server processes on loopback, real gRPC clients.

Covers the API (GetModelInfo, Extract round trip against hsx-dump byte for
byte, checksums, chunking), the standard services (reflection through a
generic client, health before/after load, Prometheus metrics), every class of
bad request, auth, TLS/mTLS, drain on SIGTERM, and the memory bound under a
client that stops reading.
"""

import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import threading
import time
from datetime import datetime

import grpc
import pytest
import xxhash
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file

from hsx_server import HsxServer

N_LAYERS = 8  # the tiny preset
HIDDEN = 128
VOCAB = 2048
EAGLE3 = [2, 4, 5, 8]
MAX_CHUNK = 10000  # not a multiple of a row: chunks must still hold whole rows
MAX_TOKENS = 1024
DTYPE_SIZE = {1: 2, 2: 2, 3: 4}
DTYPE_NAME = {1: "bf16", 2: "fp16", 3: "fp32"}


# --- XXH64, written out here so that the server's checksums are checked by an
# independent implementation (the spec: github.com/Cyan4973/xxHash, doc/xxhash_spec.md).
def xxh64(data: bytes, seed: int = 0) -> int:
    """XXH64 from the xxhash package (the reference C implementation), not ours."""
    return xxhash.xxh64(data, seed=seed).intdigest()


def token_hash(ids):
    return xxh64(struct.pack(f"<{len(ids)}q", *ids))


def test_xxh64_reference_vectors():
    # The published XXH64 test vectors: the checksums below are the library's.
    assert xxh64(b"") == 0xEF46DB3751D8E999
    assert xxh64(b"a") == 0xD24EC4F1A98C6E5B
    assert xxh64(b"abc") == 0x44BC2CF5AD770999
    assert xxhash.xxh3_64(b"").intdigest() == 0x2D06800538D394C2  # XXH3-64 of nothing, seed 0


# --- helpers


def random_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def read_stream(call):
    """Splits an Extract response stream into (header, chunks, summary, trailer), checking the order."""
    header, chunks, summary, trailer = None, [], None, None
    for message in call:
        part = message.WhichOneof("part")
        assert trailer is None, "message after the trailer"
        if part == "header":
            assert header is None and not chunks and summary is None
            header = message.header
        else:
            assert header is not None, f"{part} before the header"
            if part == "chunk":
                assert summary is None
                chunks.append(message.chunk)
            elif part == "summary":
                assert summary is None and not chunks
                summary = message.summary
            else:
                trailer = message.trailer
    assert trailer is not None, "stream ended without a trailer"
    return header, chunks, summary, trailer


def reassemble(header, chunks, max_chunk_bytes):
    """{capture_id: bytes of [T, H]}, checking chunk order, whole rows and sizes."""
    size = DTYPE_SIZE[header.dtype]
    row_bytes = header.hidden_size * size
    rows_per_chunk = max_chunk_bytes // row_bytes
    order = list(header.capture_ids) + ([-1] if header.final_norm else [])
    tensors, seen = {}, []
    for chunk in chunks:
        if not seen or seen[-1] != chunk.capture_id:
            assert chunk.capture_id not in tensors, f"capture id {chunk.capture_id} split up"
            seen.append(chunk.capture_id)
            tensors[chunk.capture_id] = bytearray()
        data = tensors[chunk.capture_id]
        assert chunk.first_row * row_bytes == len(data), "rows missing or out of order"
        assert chunk.num_rows >= 1
        assert len(chunk.data) == chunk.num_rows * row_bytes, "not whole rows"
        assert len(chunk.data) <= max_chunk_bytes, "chunk over --max-chunk-bytes"
        last = chunk.first_row + chunk.num_rows == header.num_tokens
        assert last or chunk.num_rows == rows_per_chunk, "a chunk other than the last is not full"
        data += chunk.data
    assert seen == order, f"tensors in order {seen}, expected {order}"
    for cid, data in tensors.items():
        assert len(data) == header.num_tokens * row_bytes, f"capture id {cid}: wrong size"
    return {cid: bytes(data) for cid, data in tensors.items()}


def check_trailer(header, trailer, tensors, ids, xxh3=False):
    """The token hash, and each tensor's checksum by the xxhash package: XXH64 (the default) or,
    when the request asked for it (xxh3), XXH3-64 with the XXH64 fields left unset."""
    assert trailer.token_ids_xxh64 == header.token_ids_xxh64 == token_hash(ids)
    assert header.checksum == (2 if xxh3 else 1)  # CHECKSUM_XXH3_64, CHECKSUM_XXH64: always named
    assert [c.capture_id for c in trailer.checksums] == list(tensors)
    for checksum in trailer.checksums:
        data = tensors[checksum.capture_id]
        if xxh3:
            assert checksum.xxh3_64 == xxhash.xxh3_64(data).intdigest(), f"capture id {checksum.capture_id}"
            assert checksum.xxh3_64_hex == f"{checksum.xxh3_64:016x}"
            assert checksum.xxh64 == 0 and checksum.xxh64_hex == ""
        else:
            assert checksum.xxh64 == xxh64(data), f"capture id {checksum.capture_id}"
            assert checksum.xxh3_64 == 0 and checksum.xxh3_64_hex == ""


def tensor_bytes(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def scrape(server):
    return server.scrape()


def wait_for(predicate, timeout=20, what="condition"):
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def error_of(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


# --- fixtures


@pytest.fixture(scope="module")
def tiny(make_model):
    return make_model("k2", seed=0)


@pytest.fixture(scope="module")
def server(bin_dir, tiny):
    with HsxServer(bin_dir, tiny, "--max-chunk-bytes", MAX_CHUNK, "--max-tokens-per-sample", MAX_TOKENS) as s:
        yield s


@pytest.fixture
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture
def stub(hsx_pb, channel):
    return hsx_pb[1].HiddenStatesStub(channel)


# --- standard services


def test_generic_reflection_client_lists_and_describes(server, hsx_pb):
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"hsx.v1.HiddenStates", "grpc.health.v1.Health"} <= services
        assert any("ServerReflection" in s for s in services), services
        pool = descriptor_pool.DescriptorPool(db)
        service = pool.FindServiceByName("hsx.v1.HiddenStates")
        methods = {m.name: m for m in service.methods}
        assert set(methods) == {"GetModelInfo", "Extract"}
        assert methods["Extract"].input_type.full_name == "hsx.v1.ExtractRequest"
        assert methods["Extract"].output_type.full_name == "hsx.v1.ExtractResponse"
        assert getattr(methods["Extract"], "server_streaming", True)
        info_fields = {f.name for f in pool.FindMessageTypeByName("hsx.v1.ModelInfo").fields}
        assert {"num_layers", "hidden_size", "vocab_size", "default_capture_ids", "layer_convention",
                "max_tokens_per_sample", "server_version"} <= info_fields
        response = pool.FindMessageTypeByName("hsx.v1.ExtractResponse")
        assert {f.name for f in response.oneofs_by_name["part"].fields} == {"header", "chunk", "summary", "trailer"}
        # Call GetModelInfo with classes built from the reflected descriptors only.
        request_cls = message_factory.GetMessageClass(methods["GetModelInfo"].input_type)
        reply_cls = message_factory.GetMessageClass(methods["GetModelInfo"].output_type)
        call = ch.unary_unary("/hsx.v1.HiddenStates/GetModelInfo", request_serializer=request_cls.SerializeToString,
                              response_deserializer=reply_cls.FromString)
        reply = call(request_cls(), timeout=10)
        assert reply.num_layers == N_LAYERS and reply.hidden_size == HIDDEN


def test_health_not_serving_until_loaded_and_checked(bin_dir, make_model, hsx_pb):
    # A model big enough that load + self-check take a noticeable moment.
    model = make_model("k2", seed=1, preset="small", extra_args=["--layers", "2"])
    srv = HsxServer(bin_dir, model, "--threads", "1", metrics=False)
    srv.start(wait_serving=False)
    try:
        observed = []  # per poll: (status of "", status of "hsx.v1.HiddenStates")
        loading_error = None
        deadline = time.time() + 60
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(srv.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            stub = hsx_pb[1].HiddenStatesStub(ch)
            while time.time() < deadline:
                statuses = tuple(health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                                 for name in ("", "hsx.v1.HiddenStates"))
                if not observed:
                    assert "ready:" not in srv.text()
                observed.append(statuses)
                if statuses == (serving, serving):
                    serving_seen_at = time.time()
                    break
                if loading_error is None:
                    loading_error = error_of(lambda: list(stub.Extract(
                        hsx_pb[0].ExtractRequest(token_ids=[1, 2, 3]), timeout=5)))
                time.sleep(0.01)
            assert observed[0] == (not_serving, not_serving), observed[:3]
            assert observed[-1] == (serving, serving), observed[-3:]
            for k in range(2):  # each name: NOT_SERVING, then SERVING for good
                column = [o[k] for o in observed]
                first = column.index(serving)
                assert set(column[:first]) == {not_serving} and set(column[first:]) == {serving}
            # SERVING only once the "ready" line is out (it is logged before health flips).
            wait_for(lambda: "ready:" in srv.text(), 5, "the ready line")
            log = srv.text()
            assert log.index("loaded") < log.index("self-check passed") < log.index("ready:")
            stamp = re.search(r"^(\S+) I hsx-server: ready:", log, re.M).group(1)
            ready_at = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
            assert ready_at <= serving_seen_at + 0.002, (stamp, serving_seen_at)
            assert loading_error.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in loading_error.details()
            list(stub.Extract(hsx_pb[0].ExtractRequest(token_ids=[1, 2, 3]), timeout=30))
    finally:
        assert srv.stop() == 0


def test_model_info_agrees_with_inspect(run, tiny, server, stub, hsx_pb):
    info = stub.GetModelInfo(hsx_pb[0].GetModelInfoRequest(), timeout=10)
    report = json.loads(run("hsx-inspect", "--model", tiny, "--json").stdout)
    inspect = report["architecture"]
    config = json.loads((tiny / "config.json").read_text())
    assert info.num_layers == inspect["num_hidden_layers"] == N_LAYERS
    assert info.hidden_size == inspect["hidden_size"]
    assert info.vocab_size == inspect["vocab_size"]
    assert list(info.default_capture_ids) == inspect["eagle3_capture_ids"] == EAGLE3
    assert info.architecture == config["architectures"][0]
    assert info.model_name == tiny.name == report["name"]
    assert info.model_revision == report["revision"] and len(info.model_revision) == 16
    assert info.compute_precision == "bf16" and info.default_dtype == hsx_pb[0].DTYPE_BF16
    assert "residual stream entering decoder layer k" in info.layer_convention
    assert info.last_layer_state == "pre-norm"
    assert info.tensor_parallel == 1 and info.device == "cpu"
    assert info.max_tokens_per_sample == MAX_TOKENS
    assert info.max_concurrent_requests == 256 and info.max_batch_tokens == 8192
    assert info.max_chunk_bytes == MAX_CHUNK
    assert re.fullmatch(r"\d+\.\d+\.\d+", info.server_version)


# --- Extract


def dump(run, model, tmp_path, rows, capture, dtype, final_norm):
    inputs = tmp_path / f"in-{dtype}.jsonl"
    inputs.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    out = tmp_path / f"out-{dtype}-{capture}-{final_norm}"
    args = ["--model", model, "--input", inputs, "--out", out, "--capture", capture, "--dtype", dtype]
    run("hsx-dump", *args, *(["--final-norm"] if final_norm else []))
    return [load_file(str(out / f"hs_{i}.safetensors")) for i in range(len(rows))]


@pytest.mark.parametrize("dtype,capture,final_norm", [
    (1, None, False),        # the defaults: bf16, the server's eagle3 set
    (3, [0, 3, 8], True),    # fp32, explicit ids, the final norm
    (2, [8, 1, 1], True),    # fp16, unsorted with a duplicate
])
def test_extract_round_trip_matches_dump(run, tiny, server, stub, hsx_pb, tmp_path, dtype, capture, final_norm):
    pb = hsx_pb[0]
    rows = [random_ids(n, seed=n) for n in (1, 77, 300)]
    ids_wanted = sorted(set(capture)) if capture else EAGLE3
    files = dump(run, tiny, tmp_path, rows, ",".join(map(str, ids_wanted)) if capture else "eagle3",
                 DTYPE_NAME[dtype], final_norm)
    calls = [stub.Extract(pb.ExtractRequest(sample_id=f"s{i}", token_ids=ids, capture_ids=capture or [],
                                            dtype=dtype if capture else 0, final_norm=final_norm), timeout=60)
             for i, ids in enumerate(rows)]  # all in flight at once: they share batches
    for i, (ids, call, ref) in enumerate(zip(rows, calls, files)):
        header, chunks, summary, trailer = read_stream(call)
        assert summary is None
        assert header.sample_id == f"s{i}" and header.num_tokens == len(ids)
        assert list(header.capture_ids) == ids_wanted and header.final_norm == final_norm
        assert header.hidden_size == HIDDEN and header.dtype == dtype and header.num_layers == N_LAYERS
        assert header.model_name == tiny.name and "decoder layer k" in header.layer_convention
        tensors = reassemble(header, chunks, MAX_CHUNK)
        check_trailer(header, trailer, tensors, ids)
        hidden = ref["hidden_states"]
        assert tuple(hidden.shape) == (len(ids), len(ids_wanted), HIDDEN)
        for j, cid in enumerate(ids_wanted):
            assert tensors[cid] == tensor_bytes(hidden[:, j, :]), f"sample {i} capture id {cid}"
        if final_norm:
            assert tensors[-1] == tensor_bytes(ref["final_norm_hidden_states"])
        else:
            assert "final_norm_hidden_states" not in ref


@pytest.mark.parametrize("dtype", [1, 2, 3])
def test_xxh3_checksums_when_asked(server, stub, hsx_pb, dtype):
    """ExtractRequest.checksum = CHECKSUM_XXH3_64: the same bytes, XXH3 in the trailer (checked with the
    xxhash package), in every dtype (bf16 rows are sent in place, fp16 and fp32 encoded), summary too."""
    pb = hsx_pb[0]
    ids = random_ids(130, seed=dtype)
    request = dict(token_ids=ids, capture_ids=[0, 4, 8], final_norm=True, dtype=dtype)
    plain = read_stream(stub.Extract(pb.ExtractRequest(**request), timeout=30))
    header, chunks, _, trailer = read_stream(stub.Extract(
        pb.ExtractRequest(**request, checksum=pb.CHECKSUM_XXH3_64), timeout=30))
    tensors = reassemble(header, chunks, MAX_CHUNK)
    assert tensors == reassemble(plain[0], plain[1], MAX_CHUNK)
    check_trailer(plain[0], plain[3], tensors, ids)
    check_trailer(header, trailer, tensors, ids, xxh3=True)
    summary = read_stream(stub.Extract(pb.ExtractRequest(**request, checksum=pb.CHECKSUM_XXH3_64, summary=True),
                                       timeout=30))
    check_trailer(summary[0], summary[3], tensors, ids, xxh3=True)


def test_summary_mode(server, stub, hsx_pb):
    pb = hsx_pb[0]
    ids = random_ids(50, seed=5)
    header, chunks, summary, trailer = read_stream(stub.Extract(
        pb.ExtractRequest(sample_id="sum", token_ids=ids, capture_ids=[0, 8], final_norm=True, dtype=3,
                          summary=True), timeout=30))
    assert not chunks and summary is not None
    full = reassemble(*read_stream(stub.Extract(
        pb.ExtractRequest(token_ids=ids, capture_ids=[0, 8], final_norm=True, dtype=3), timeout=30))[:2], MAX_CHUNK)
    assert [t.capture_id for t in summary.tensors] == [0, 8, -1]
    for stats in summary.tensors:
        values = torch.frombuffer(bytearray(full[stats.capture_id]), dtype=torch.float32).double()
        assert stats.mean == pytest.approx(values.mean().item(), rel=1e-6, abs=1e-9)
        assert stats.std == pytest.approx(values.std(unbiased=False).item(), rel=1e-6)
        assert stats.min == values.min().item() and stats.max == values.max().item()
        assert list(stats.first_values) == values[:8].float().tolist()
    check_trailer(header, trailer, full, ids)


# --- bad requests

BAD = [
    # (name, request fields, code, message fragment)
    ("empty", dict(token_ids=[]), "INVALID_ARGUMENT", "token_ids: empty"),
    ("out of range", dict(token_ids=[1, 2, VOCAB]), "INVALID_ARGUMENT", f"token_ids[2] = {VOCAB} is outside"),
    ("negative", dict(token_ids=[1, -5, 3]), "INVALID_ARGUMENT", "token_ids[1] = -5 is outside"),
    ("over length", dict(token_ids=[7] * (MAX_TOKENS + 1)), "INVALID_ARGUMENT",
     f"{MAX_TOKENS + 1} tokens exceed max_tokens_per_sample {MAX_TOKENS}"),
    ("capture id", dict(token_ids=[1, 2], capture_ids=[2, N_LAYERS + 1]), "INVALID_ARGUMENT",
     f"capture_ids[1] = {N_LAYERS + 1} is outside 0..{N_LAYERS}"),
    ("negative capture id", dict(token_ids=[1, 2], capture_ids=[-1]), "INVALID_ARGUMENT", "capture_ids[0] = -1"),
    ("long sample id", dict(sample_id="x" * 2000, token_ids=[1]), "INVALID_ARGUMENT", "sample_id"),
    ("unknown checksum", dict(token_ids=[1, 2], checksum=9), "INVALID_ARGUMENT", "checksum: unknown enum value 9"),
    # 6000 two-byte varints: over the default --max-request-bytes (8 + 5 * 1024 + 4096).
    ("oversized", dict(token_ids=[1000] * 6000), "RESOURCE_EXHAUSTED", "larger than max"),
]


@pytest.mark.parametrize("name,fields,code,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_its_status(server, stub, hsx_pb, name, fields, code, fragment):
    pb = hsx_pb[0]
    err = error_of(lambda: list(stub.Extract(pb.ExtractRequest(**fields), timeout=30)))
    assert err.code() == getattr(grpc.StatusCode, code), err
    assert fragment in err.details(), err.details()
    # ... and the server keeps serving.
    assert len(list(stub.Extract(pb.ExtractRequest(token_ids=[3, 4, 5]), timeout=30))) >= 3


def test_unknown_dtype_on_the_raw_wire(server, channel, stub, hsx_pb):
    pb = hsx_pb[0]
    raw = pb.ExtractRequest(sample_id="raw", token_ids=[1, 2, 3]).SerializeToString() + bytes([0x20, 7])  # dtype = 7
    extract = channel.unary_stream("/hsx.v1.HiddenStates/Extract", request_serializer=None,
                                   response_deserializer=pb.ExtractResponse.FromString)
    err = error_of(lambda: list(extract(raw, timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dtype" in err.details() and "7" in err.details()
    assert len(list(stub.Extract(pb.ExtractRequest(token_ids=[3]), timeout=30))) >= 3


def test_auth_token(bin_dir, tiny, hsx_pb, tmp_path):
    pb, pb_grpc = hsx_pb
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with HsxServer(bin_dir, tiny, "--auth-token-file", token_file, metrics=False) as srv, \
            grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.HiddenStatesStub(ch)
        request = pb.ExtractRequest(token_ids=[1, 2, 3])
        err = error_of(lambda: list(stub.Extract(request, timeout=30)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization" in err.details()
        err = error_of(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        err = error_of(lambda: list(stub.Extract(request, metadata=[("authorization", "Bearer wrong")], timeout=30)))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "token" in err.details()
        err = error_of(lambda: list(stub.Extract(request, metadata=[("authorization", "Basic abc")], timeout=30)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        good = [("authorization", "Bearer s3cret-token")]
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=good, timeout=10).num_layers == N_LAYERS
        assert len(list(stub.Extract(request, metadata=good, timeout=30))) == 6
        # Health and reflection need no token (probes, grpcurl list).
        assert srv.health("hsx.v1.HiddenStates") == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
        assert "hsx.v1.HiddenStates" in ProtoReflectionDescriptorDatabase(ch).get_services()


# --- limits and memory

LONG = 2048  # tokens; capture all + final norm in fp32: 10 x 2048 x 128 x 4 B = 10 MiB per response
LIMITED_CHUNK = 256 << 10
LIMITED_BUFFER = 1 << 20
LIMITED_STREAMS = 3


@pytest.fixture(scope="module")
def limited(bin_dir, tiny):
    # A fixed mmap threshold makes glibc return every large block to the system
    # when it is freed, so RSS measures live memory rather than the allocator's cache.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    # One sample per batch (--max-batch-tokens LONG): the engine's reused working
    # memory then has the same shape in the warm-up and in the measured run,
    # whatever the timing.
    with HsxServer(bin_dir, tiny, "--max-concurrent-requests", LIMITED_STREAMS, "--max-chunk-bytes", LIMITED_CHUNK,
                   "--max-buffered-bytes-per-stream", LIMITED_BUFFER, "--max-batch-tokens", LONG, env=env) as s:
        yield s


# A client that stops reading: without BDP probing the HTTP/2 stream window stays
# at 1 MiB, so the client's transport cannot soak up whole responses on its own.
STALLING_CLIENT = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1 << 20)]


def long_request(pb, i):
    return pb.ExtractRequest(sample_id=f"long{i}", token_ids=random_ids(LONG, seed=100 + i),
                             capture_ids=list(range(N_LAYERS + 1)), final_norm=True, dtype=pb.DTYPE_FP32)


def per_stream_bound():
    """The documented per-stream bound (docs/api.md): the float32 states held until the
    stream ends, plus one encoded chunk and gRPC's serialized copy of it."""
    states = 4 * LONG * (N_LAYERS + 1 + 1) * HIDDEN
    return states + 2 * (LIMITED_CHUNK + 64)


def test_slow_reader_memory_stays_bounded(limited, hsx_pb):
    pb, pb_grpc = hsx_pb
    with grpc.insecure_channel(limited.address, options=STALLING_CLIENT) as ch:
        stub = pb_grpc.HiddenStatesStub(ch)
        # Warm up with the same workload read to the end, so that the engine's
        # scratch memory and the allocator's pools are already in the baseline.
        warm = [stub.Extract(long_request(pb, i), timeout=120) for i in range(LIMITED_STREAMS)]
        for call in warm:
            for _ in call:
                pass
        wait_for(lambda: scrape(limited)["hsx_inflight_requests"] == 0, what="warm-up to finish")
        before = limited.rss_bytes()
        sent_before = scrape(limited)["hsx_bytes_sent_total"]
        calls = [stub.Extract(long_request(pb, i), timeout=120) for i in range(LIMITED_STREAMS)]  # never read
        try:
            states = 4 * LONG * (N_LAYERS + 2) * HIDDEN
            wait_for(lambda: scrape(limited)["hsx_held_state_bytes"] == LIMITED_STREAMS * states, 60,
                     "every stalled stream to hold its states")
            # Stalled: once the client's buffers are full, nothing more is sent.
            history = [scrape(limited)["hsx_bytes_sent_total"]]

            def stalled():
                time.sleep(0.25)
                history.append(scrape(limited)["hsx_bytes_sent_total"])
                return len(history) >= 3 and history[-1] == history[-3]

            wait_for(stalled, 30, "the streams to stall")
            sent = history[-1] - sent_before
            m = scrape(limited)
            assert sent < LIMITED_STREAMS * states, "the client was sent everything: nothing to bound"
            assert m["hsx_inflight_requests"] == LIMITED_STREAMS
            assert 0 < m["hsx_buffered_bytes"] <= LIMITED_STREAMS * (LIMITED_CHUNK + 64)
            after = limited.rss_bytes()
            bound = LIMITED_STREAMS * per_stream_bound() + (8 << 20)  # + 8 MiB for gRPC and allocator slack
            growth = after - before
            print(f"\nslow readers: RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB (+{growth / 2**20:.1f} MiB); "
                  f"bound +{bound / 2**20:.1f} MiB; held states {m['hsx_held_state_bytes'] / 2**20:.1f} MiB, "
                  f"buffered {m['hsx_buffered_bytes'] / 2**20:.2f} MiB, sent {sent / 2**20:.1f} of "
                  f"{LIMITED_STREAMS * states / 2**20:.1f} MiB")
            assert growth <= bound
            time.sleep(0.5)
            assert limited.rss_bytes() - before <= bound, "RSS keeps growing"
        finally:
            for call in calls:
                call.cancel()
        wait_for(lambda: scrape(limited)["hsx_inflight_requests"] == 0, what="cancelled streams to end")
        m = scrape(limited)
        assert m["hsx_held_state_bytes"] == 0 and m["hsx_buffered_bytes"] == 0


def test_too_many_concurrent_requests(limited, hsx_pb):
    pb, pb_grpc = hsx_pb
    with grpc.insecure_channel(limited.address, options=STALLING_CLIENT) as ch:
        stub = pb_grpc.HiddenStatesStub(ch)
        calls = [stub.Extract(long_request(pb, i), timeout=120) for i in range(LIMITED_STREAMS)]  # never read
        try:
            wait_for(lambda: scrape(limited)["hsx_inflight_requests"] == LIMITED_STREAMS, what="streams to start")
            err = error_of(lambda: list(stub.Extract(pb.ExtractRequest(token_ids=[1, 2]), timeout=30)))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "too many concurrent requests" in err.details() and str(LIMITED_STREAMS) in err.details()
        finally:
            for call in calls:
                call.cancel()
        wait_for(lambda: scrape(limited)["hsx_inflight_requests"] == 0, what="cancelled streams to end")
        assert len(list(stub.Extract(pb.ExtractRequest(token_ids=[1, 2]), timeout=60))) == 6
        assert scrape(limited)['hsx_errors_total{code="RESOURCE_EXHAUSTED"}'] >= 1


# --- metrics


def test_metrics_count_up(server, stub, hsx_pb):
    pb = hsx_pb[0]
    before = scrape(server)
    ids = random_ids(40, seed=9)
    messages = list(stub.Extract(pb.ExtractRequest(token_ids=ids), timeout=30))
    error_of(lambda: list(stub.Extract(pb.ExtractRequest(token_ids=[]), timeout=30)))
    # The server counts a stream when its reactor finishes, which can come a
    # moment after the client has read the last message (seen under ASan).
    counted = lambda m: (m["hsx_samples_total"] > before.get("hsx_samples_total", 0) and  # noqa: E731
                         m["hsx_extract_latency_seconds_count"] > before.get("hsx_extract_latency_seconds_count", 0))
    wait_for(lambda: counted(scrape(server)), what="the stream to be counted")
    after = scrape(server)
    assert after["hsx_samples_total"] == before.get("hsx_samples_total", 0) + 1
    assert after["hsx_tokens_total"] == before.get("hsx_tokens_total", 0) + len(ids)
    assert after["hsx_bytes_sent_total"] - before.get("hsx_bytes_sent_total", 0) >= sum(m.ByteSize() for m in messages)
    key = 'hsx_errors_total{code="INVALID_ARGUMENT"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["hsx_extract_latency_seconds_count"] == before.get("hsx_extract_latency_seconds_count", 0) + 1
    for gauge in ("hsx_queue_depth", "hsx_inflight_requests", "hsx_batch_fill", "hsx_buffered_bytes",
                  "hsx_held_state_bytes"):
        assert gauge in after
    assert 0 < after["hsx_batch_fill"] <= 1


# --- TLS


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make test certificates", pytrace=False)
    d = tmp_path_factory.mktemp("certs")

    def ssl(*args):
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, cwd=d)

    ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
        "-subj", "/CN=hsx test CA", "-keyout", "ca.key", "-out", "ca.crt")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        ssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN=hsx {name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-out", f"{name}.crt", *ext)
    return d


def tls_channel(srv, certs, client_cert=True):
    kwargs = dict(root_certificates=(certs / "ca.crt").read_bytes())
    if client_cert:
        kwargs.update(private_key=(certs / "client.key").read_bytes(),
                      certificate_chain=(certs / "client.crt").read_bytes())
    return grpc.secure_channel(srv.address, grpc.ssl_channel_credentials(**kwargs))


def start_tls(bin_dir, tiny, certs, *extra):
    srv = HsxServer(bin_dir, tiny, "--tls-cert", certs / "server.crt", "--tls-key", certs / "server.key",
                    "--health-listen", "127.0.0.1:0", *extra, metrics=False)
    srv.start(wait_serving=False)
    # The main port speaks TLS only; the plaintext health port serves the probes.
    wait_for(lambda: re.search(r"health \(.*\) on (\S+)", srv.text()), 30, "the health port")
    health_address = re.search(r"health \(.*\) on (\S+)", srv.text()).group(1)

    def serving():
        with grpc.insecure_channel(health_address) as ch:
            try:
                return health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="hsx.v1.HiddenStates"), timeout=5).status == 1
            except grpc.RpcError:
                return False

    wait_for(serving, 60, "SERVING on the health port")
    return srv, health_address


def test_tls_and_mtls(bin_dir, tiny, certs, hsx_pb):
    pb, pb_grpc = hsx_pb
    request = pb.ExtractRequest(token_ids=[1, 2, 3])
    srv, health_address = start_tls(bin_dir, tiny, certs)
    try:
        with tls_channel(srv, certs, client_cert=False) as ch:
            stub = pb_grpc.HiddenStatesStub(ch)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).num_layers == N_LAYERS
            assert len(list(stub.Extract(request, timeout=30))) == 6
        with grpc.insecure_channel(srv.address) as ch:  # plaintext to a TLS port
            err = error_of(lambda: pb_grpc.HiddenStatesStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(health_address) as ch:  # the health port serves health only
            err = error_of(lambda: pb_grpc.HiddenStatesStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5))
            assert err.code() == grpc.StatusCode.UNIMPLEMENTED
            from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
                ProtoReflectionDescriptorDatabase
            # Reflection there describes grpc.health.v1 only (so that grpcurl can call it), no hsx service.
            assert set(ProtoReflectionDescriptorDatabase(ch).get_services()) == {
                "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    finally:
        assert srv.stop() == 0

    srv, _ = start_tls(bin_dir, tiny, certs, "--tls-client-ca", certs / "ca.crt")
    try:
        with tls_channel(srv, certs, client_cert=True) as ch:
            assert len(list(pb_grpc.HiddenStatesStub(ch).Extract(request, timeout=30))) == 6
        with tls_channel(srv, certs, client_cert=False) as ch:
            err = error_of(lambda: pb_grpc.HiddenStatesStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert srv.stop() == 0
    assert "mTLS" in srv.text()


# --- drain


def test_sigterm_drains_in_flight_streams(bin_dir, tiny, hsx_pb):
    pb, pb_grpc = hsx_pb
    srv = HsxServer(bin_dir, tiny, "--max-chunk-bytes", "64KiB", "--drain-timeout", "60s").start()
    rows = [random_ids(LONG, seed=200 + i) for i in range(3)]  # ~2 s of compute for the three
    results = [None] * len(rows)

    def slow_reader(i):
        with grpc.insecure_channel(srv.address) as ch:
            call = pb_grpc.HiddenStatesStub(ch).Extract(
                pb.ExtractRequest(sample_id=f"d{i}", token_ids=rows[i], capture_ids=[0, 4, 8], dtype=3), timeout=120)
            messages = []
            try:
                for message in call:
                    messages.append(message)
                    time.sleep(0.01)  # a slow reader: 49 messages of 64 KiB
                results[i] = messages
            except grpc.RpcError as e:
                results[i] = e

    threads = [threading.Thread(target=slow_reader, args=(i,)) for i in range(len(rows))]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: scrape(srv)["hsx_inflight_requests"] == len(rows), 30, "all streams accepted")
        assert scrape(srv).get("hsx_samples_total", 0) == 0  # still computing: in flight
        srv.signal(signal.SIGTERM)
        wait_for(lambda: srv.health("hsx.v1.HiddenStates") == health_pb2.HealthCheckResponse.NOT_SERVING, 10,
                 "NOT_SERVING")
        assert srv.health("") == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(srv.address) as ch:
            err = error_of(lambda: list(pb_grpc.HiddenStatesStub(ch).Extract(pb.ExtractRequest(token_ids=[1]),
                                                                              timeout=10)))
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()
        assert srv.proc.poll() is None, "the server exited before its streams finished"
        for t in threads:
            t.join(120)
        assert srv.proc.wait(60) == 0
    finally:
        srv.kill()
    for i, messages in enumerate(results):
        assert not isinstance(messages, Exception), f"stream {i} failed: {messages}"
        header, chunks = messages[0].header, [m.chunk for m in messages[1:-1]]
        tensors = reassemble(header, chunks, 64 << 10)
        check_trailer(header, messages[-1].trailer, tensors, rows[i])
    log = srv.text()
    assert f"draining (health NOT_SERVING, new Extract calls refused); {len(rows)} in flight" in log, log
    assert "drained in" in log and "stopped" in log


# A client that reads its last bytes only after the server was told to stop: a
# separate process, stopped (SIGSTOP) so that its socket is not read at all.
STOPPED_CLIENT = r"""
import sys, grpc
from hsx.v1 import hsx_pb2 as pb, hsx_pb2_grpc as pb_grpc
address, ids = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
with grpc.insecure_channel(address) as channel:
    call = pb_grpc.HiddenStatesStub(channel).Extract(
        pb.ExtractRequest(sample_id="late", token_ids=ids, capture_ids=list(range(9)), dtype=3), timeout=120)
    count = 0
    try:
        for message in call:
            if count == 0:
                print("header", flush=True)
            count += 1
        print("ok", count, call.code(), flush=True)
    except grpc.RpcError as e:
        print("error", e.code(), e.details(), flush=True)
"""


def test_sigterm_exit_waits_for_a_slow_client_to_take_its_last_bytes(bin_dir, tiny):
    """The call is finished on the server (its bytes are in the socket buffers) when SIGTERM comes, but the client
    has not read them. The server must close the connection gracefully (GOAWAY, then a PING the client answers
    only after reading everything before it) and exit only then: closing at once can reset the connection and lose
    the stream's tail (seen in CI as UNAVAILABLE "Connection reset by peer" after a drain)."""
    import sys

    ids = random_ids(512, seed=77)  # 9 captures x 512 x 128 fp32: 2.4 MB in 64 KiB chunks (38 messages)
    srv = HsxServer(bin_dir, tiny, "--max-chunk-bytes", "64KiB", "--drain-timeout", "60s").start()
    client = subprocess.Popen([sys.executable, "-c", STOPPED_CLIENT, srv.address, ",".join(map(str, ids))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "header"
        client.send_signal(signal.SIGSTOP)
        # Every write done on the server's side: the call is over there.
        wait_for(lambda: scrape(srv).get("hsx_samples_total", 0) == 1 and scrape(srv)["hsx_inflight_requests"] == 0,
                 30, "the call to finish on the server")
        srv.signal(signal.SIGTERM)
        wait_for(lambda: "closing connections" in srv.text(), 10, "the drain to end")
        time.sleep(1.0)
        assert srv.proc.poll() is None, "the server exited while its client had not read the stream's end"
        client.send_signal(signal.SIGCONT)
        out = client.stdout.read()
        assert srv.proc.wait(30) == 0
    finally:
        client.kill()
        srv.kill()
    assert out.split()[:3] == ["ok", "38", "StatusCode.OK"], out
    log = srv.text()
    assert "drained in 0.0" in log and "connections closed in" in log and "stopped" in log, log
