"""The streaming path and the server's request handling, against a real hsx-server:
raw (undecodable, oversized) request bytes sent with a generic gRPC call, what the client sees,
the log line and the metrics; and the memory a stalled stream holds on the 7168-wide model."""

import json
import os
import random

import grpc
import pytest

from hsx_server import HsxServer
from server_helpers import STALLING_CLIENT, error_of, scrape, wait_for

EXTRACT = "/hsx.v1.HiddenStates/Extract"


def raw_extract(channel, payload, metadata=None, timeout=30):
    """Extract with `payload` as the request's bytes, as they are (no serializer)."""
    call = channel.unary_stream(EXTRACT, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    return list(call(payload, metadata=metadata, timeout=timeout))


# Not an ExtractRequest: field 1 (sample_id) says 100 bytes follow, 3 do.
GARBAGE = b"\x0a\x64abc"


@pytest.fixture(scope="module")
def token(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text("s3cret\n")
    return path


def test_undecodable_request_is_invalid_argument_logged_and_counted(bin_dir, tiny, hsx_pb):
    pb, _ = hsx_pb
    with HsxServer(bin_dir, tiny) as srv, grpc.insecure_channel(srv.address) as channel:
        before = scrape(srv).get("hsx_undecodable_requests_total", 0)
        err = error_of(lambda: raw_extract(channel, GARBAGE))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "could not be parsed as an hsx.v1.ExtractRequest" in err.details()
        assert f"({len(GARBAGE)} bytes)" in err.details()
        m = scrape(srv)
        assert m["hsx_undecodable_requests_total"] == before + 1
        assert m['hsx_errors_total{code="INVALID_ARGUMENT"}'] >= 1
        wait_for(lambda: "could not be parsed" in srv.text(), what="the log line")
        line = next(l for l in srv.text().splitlines() if "could not be parsed" in l)
        assert "INVALID_ARGUMENT" in line and f"({len(GARBAGE)} bytes)" in line
        # A well-formed request through the same raw path still works, byte for byte the generated one.
        ok = raw_extract(channel, pb.ExtractRequest(sample_id="fine", token_ids=[1, 2, 3]).SerializeToString())
        messages = [pb.ExtractResponse.FromString(b) for b in ok]
        assert messages[0].header.sample_id == "fine" and messages[-1].HasField("trailer")
        assert scrape(srv)["hsx_undecodable_requests_total"] == before + 1


def test_undecodable_request_with_auth(bin_dir, tiny, token):
    with HsxServer(bin_dir, tiny, "--auth-token-file", token) as srv, grpc.insecure_channel(srv.address) as channel:
        # Without the token: UNAUTHENTICATED whatever the bytes, but counted and logged.
        err = error_of(lambda: raw_extract(channel, GARBAGE))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "parsed" not in err.details()
        assert scrape(srv)["hsx_undecodable_requests_total"] == 1
        wait_for(lambda: "could not be parsed" in srv.text(), what="the log line")
        # With the token: INVALID_ARGUMENT, as without auth.
        err = error_of(lambda: raw_extract(channel, GARBAGE, metadata=[("authorization", "Bearer s3cret")]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "could not be parsed" in err.details()
        assert scrape(srv)["hsx_undecodable_requests_total"] == 2


def test_oversized_request_is_resource_exhausted_and_counted(bin_dir, tiny, hsx_pb):
    pb, _ = hsx_pb
    with HsxServer(bin_dir, tiny, "--max-request-bytes", "8KiB") as srv, grpc.insecure_channel(srv.address) as channel:
        request = pb.ExtractRequest(sample_id="big", token_ids=[1000] * 5000).SerializeToString()
        assert len(request) > 8192
        err = error_of(lambda: raw_extract(channel, request))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        m = scrape(srv)
        assert m['hsx_errors_total{code="RESOURCE_EXHAUSTED"}'] == 1
        assert m["hsx_oversized_requests_total"] == 1
        wait_for(lambda: "RESOURCE_EXHAUSTED" in srv.text(), what="the log line")


# --- 16 stalled streams on the 7168-wide model --------------------------------------------------

HIDDEN = 7168
VOCAB = 32000
TOKENS = 2048
STREAMS = 16
CHUNK = 1 << 20


@pytest.fixture(scope="module")
def wide(bin_dir, tmp_path_factory, make_model):
    """hidden 7168, vocab 32000, one small decoder layer (served with --capture 0: none runs)."""
    work = tmp_path_factory.mktemp("wide")
    config = json.loads((make_model("k2", seed=0) / "config.json").read_text())
    config.update({"hidden_size": HIDDEN, "vocab_size": VOCAB, "num_hidden_layers": 1, "intermediate_size": 32,
                   "num_attention_heads": 1, "num_key_value_heads": 1, "q_lora_rank": 64, "kv_lora_rank": 32,
                   "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 0,
                   "first_k_dense_replace": 1})
    (work / "wide.json").write_text(json.dumps(config))
    import subprocess
    subprocess.run([str(bin_dir / "hsx-make-model"), "--config", str(work / "wide.json"), "--out", str(work / "m")],
                   check=True, capture_output=True)
    return work / "m"


def rss_anon(server):
    """Anonymous resident memory: the heap, not the checkpoint's mmapped pages (which reading
    the embedding rows of random ids brings in, and which the kernel may drop at will)."""
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def stalled_stream_bound():
    """docs/api.md, "Memory per stream": the encoded sample; the message in flight aliases it."""
    return 2 * TOKENS * 1 * HIDDEN


def test_sixteen_stalled_streams_hold_their_samples_encoded(bin_dir, wide, hsx_pb):
    pb, pb_grpc = hsx_pb
    # glibc then returns freed large blocks at once: RSS shows live memory.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    with HsxServer(bin_dir, wide, "--capture", "0", "--max-concurrent-requests", STREAMS, "--max-batch-tokens", TOKENS,
                   "--max-chunk-bytes", CHUNK, env=env) as srv:
        before = rss_anon(srv)
        rng = random.Random(5)
        with grpc.insecure_channel(srv.address, options=STALLING_CLIENT) as channel:
            stub = pb_grpc.HiddenStatesStub(channel)
            calls = [stub.Extract(pb.ExtractRequest(sample_id=f"s{i}", token_ids=[rng.randrange(VOCAB)
                                                                                    for _ in range(TOKENS)],
                                                    capture_ids=[0], dtype=pb.DTYPE_BF16), timeout=300)
                     for i in range(STREAMS)]  # never read
            try:
                held = STREAMS * stalled_stream_bound()
                wait_for(lambda: scrape(srv)["hsx_held_state_bytes"] == held, 120, "every stream to hold its sample")
                history = [scrape(srv)["hsx_bytes_sent_total"]]

                def stalled():
                    history.append(scrape(srv)["hsx_bytes_sent_total"])
                    return len(history) >= 4 and history[-1] == history[-4]

                wait_for(stalled, 60, "the streams to stall")
                assert history[-1] < held / 2, "the client took most of it: nothing is stalled"
                after = rss_anon(srv)
                # Server-wide terms on top of the streams (docs/api.md): one batch in flight (its capture
                # buffer, kept by the pool, and the engine's residual stream) and 32 MiB for gRPC and the
                # allocator. The same states held as float32 would be twice `held`.
                batch = 2 * (2 * TOKENS * HIDDEN)
                bound = held + batch + (32 << 20)
                growth = after - before
                print(f"\n16 stalled streams: RssAnon {before / 2**20:.0f} -> {after / 2**20:.0f} MiB "
                      f"(+{growth / 2**20:.0f} MiB), bound +{bound / 2**20:.0f} MiB, held {held / 2**20:.0f} MiB, "
                      f"sent {history[-1] / 2**20:.1f} MiB")
                assert growth <= bound
            finally:
                for call in calls:
                    call.cancel()
        wait_for(lambda: scrape(srv)["hsx_inflight_requests"] == 0, what="the cancelled streams to end")
        assert scrape(srv)["hsx_held_state_bytes"] == 0
