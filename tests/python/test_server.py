"""hsx-server end to end: real server processes on loopback, real gRPC clients.

Covers the API (GetModelInfo, Extract round trip against hsx-dump byte for
byte, checksums, chunking), the standard services (reflection through a
generic client, health before/after load, Prometheus metrics), every class of
bad request and auth. TLS/mTLS (test_server_tls.py), drain on SIGTERM
(test_server_drain.py) and the memory bound under a client that stops reading
(test_server_limits.py) have their own files.
"""

import json
import re
import time
from datetime import datetime

import grpc
import pytest
import xxhash
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file

from hsx_server import HsxServer
from server_helpers import (DTYPE_NAME, EAGLE3, HIDDEN, MAX_CHUNK, MAX_TOKENS, N_LAYERS, VOCAB, check_trailer,
                            error_of, random_ids, read_stream, reassemble, scrape, wait_for, xxh64)


def test_xxh64_reference_vectors():
    # The published XXH64 test vectors: the checksums below are the library's.
    assert xxh64(b"") == 0xEF46DB3751D8E999
    assert xxh64(b"a") == 0xD24EC4F1A98C6E5B
    assert xxh64(b"abc") == 0x44BC2CF5AD770999
    assert xxhash.xxh3_64(b"").intdigest() == 0x2D06800538D394C2  # XXH3-64 of nothing, seed 0


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


def tensor_bytes(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


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
