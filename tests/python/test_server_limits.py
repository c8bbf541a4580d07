"""hsx-server under load it must refuse or bound: the memory held for clients that stop reading
stays within the documented bound, and a request over --max-concurrent-requests is refused."""

import os
import time

import grpc
import pytest

from hsx_server import HsxServer
from server_helpers import HIDDEN, LONG, N_LAYERS, STALLING_CLIENT, error_of, random_ids, scrape, wait_for

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
