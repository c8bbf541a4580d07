"""A lost device, end to end: a real hsx-server whose rank 1 of 2 loses its
device (the testing flag --inject-device-loss-after-batches, which fails the
rank as a sticky CUDA error would) turns NOT_SERVING for both health names, as
grpc_health.v1's Check and Watch see it; the failing Extract and every later one
get UNAVAILABLE naming the rank, the device and the original error, at once;
hsx_device_lost turns 1 and the log says why. Before the loss, the same server
serves normally and reports hsx_device_lost 0.
"""

import signal
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hsx_server import HsxServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LOST = "device lost: rank 1 of 2 (cpu) failed with INTERNAL: cpu (rank 1) Synchronize: injected device loss after 2 batches"


def extract(pb, pb_grpc, address, sample_id):
    with grpc.insecure_channel(address) as ch:
        return list(pb_grpc.HiddenStatesStub(ch).Extract(
            pb.ExtractRequest(sample_id=sample_id, token_ids=[1, 2, 3, 4, 5, 6, 7]), timeout=60))


def failure(fn):
    try:
        fn()
    except grpc.RpcError as e:
        return e
    raise AssertionError("the call succeeded")


def test_a_lost_device_turns_the_server_not_serving(bin_dir, tiny, hsx_pb):
    pb, pb_grpc = hsx_pb
    srv = HsxServer(bin_dir, tiny, "--tp", "2", "--threads", "2", "--inject-device-loss-after-batches", "2").start()
    try:
        # Watch "" from before the loss: it must see SERVING, then NOT_SERVING.
        watched = []
        with grpc.insecure_channel(srv.address) as watch_channel:
            watch = health_pb2_grpc.HealthStub(watch_channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                                    timeout=60)

            def follow():
                try:
                    for response in watch:
                        watched.append(response.status)
                        if response.status == NOT_SERVING:
                            return
                except grpc.RpcError:
                    pass

            watcher = threading.Thread(target=follow)
            watcher.start()

            # Two batches run normally; the server serves and says no device is lost.
            for i in range(2):
                messages = extract(pb, pb_grpc, srv.address, f"ok{i}")
                assert messages[-1].WhichOneof("part") == "trailer"
            assert srv.health("") == SERVING and srv.health("hsx.v1.HiddenStates") == SERVING
            assert srv.scrape()["hsx_device_lost"] == 0

            # The third batch loses rank 1's device: UNAVAILABLE with rank 1's error.
            err = failure(lambda: extract(pb, pb_grpc, srv.address, "lost"))
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert LOST in err.details(), err.details()
            assert "retry on another replica" in err.details()

            # Health turns NOT_SERVING for both names (the handler runs before the batch's samples fail).
            assert srv.health("") == NOT_SERVING
            assert srv.health("hsx.v1.HiddenStates") == NOT_SERVING
            watcher.join(10)
            assert watched == [SERVING, NOT_SERVING], watched
            watch.cancel()

        # Every later Extract is refused at once with the same status.
        for i in range(3):
            start = time.monotonic()
            later = failure(lambda: extract(pb, pb_grpc, srv.address, f"later{i}"))
            assert later.code() == grpc.StatusCode.UNAVAILABLE
            assert later.details() == err.details()
            assert time.monotonic() - start < 2.0, "a refusal took too long"
        assert srv.health("") == NOT_SERVING  # and it stays so

        # The failed stream is counted when gRPC is done with it, which may come just after its client saw
        # the status.
        deadline = time.monotonic() + 10
        while srv.scrape().get('hsx_errors_total{code="UNAVAILABLE"}', 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        metrics = srv.scrape()
        assert metrics["hsx_device_lost"] == 1
        assert metrics['hsx_errors_total{code="UNAVAILABLE"}'] == 4
        assert metrics["hsx_samples_total"] == 2
        # GetModelInfo still answers (probes and operators can still ask what this server is).
        with grpc.insecure_channel(srv.address) as ch:
            assert pb_grpc.HiddenStatesStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10).tensor_parallel == 2
        log = srv.text()
        errors = [line for line in log.splitlines() if " E hsx-server: " + LOST in line]
        assert len(errors) == 1 and 'health NOT_SERVING ("" and hsx.v1.HiddenStates)' in errors[0], log
        assert "--inject-device-loss-after-batches=2 (testing)" in log, log

        # SIGTERM still drains and exits cleanly: nothing is left in flight.
        srv.signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.text()
    finally:
        srv.kill()


def test_the_injection_flag_is_checked(bin_dir, tiny):
    srv = HsxServer(bin_dir, tiny, "--inject-device-loss-after-batches", "-2", metrics=False)
    try:
        srv.start(timeout=30)
        raise AssertionError("the server started")
    except RuntimeError as e:
        assert "--inject-device-loss-after-batches must be -1 (off) or at least 0" in str(e), e
    finally:
        srv.kill()
