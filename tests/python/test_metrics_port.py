"""The metrics port cannot be held: idle or slow TCP connections on it must not
delay a Prometheus scrape (an alert such as hsx_device_lost must stay visible),
and connections that never finish a request are dropped after the request
timeout (docs/deploy.md, "Metrics")."""

import socket
import time
import urllib.request

from hsx_server import HsxServer

IDLE = 60            # the issue asked for 20; metrics.cc has 64 workers, so up to 63 are harmless
REQUEST_TIMEOUT = 5  # s: metrics.cc kMetricsRequestTimeoutMs


def hold(address, count):
    """`count` connections to the metrics port: half silent, half stopped in the middle of a
    request line (a slow client)."""
    host, port = address.rsplit(":", 1)
    held = []
    for i in range(count):
        s = socket.create_connection((host, int(port)), timeout=5)
        if i % 2:
            s.sendall(b"GET /metr")
        held.append(s)
    return held


def timed_scrape(address):
    start = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            body = r.read().decode()
    except TimeoutError:
        raise AssertionError(f"no answer to a scrape within 5 s behind {IDLE} idle connections") from None
    return time.monotonic() - start, body


def test_idle_connections_do_not_delay_a_scrape(bin_dir, tiny):
    with HsxServer(bin_dir, tiny) as srv:
        held = hold(srv.metrics_address, IDLE)
        try:
            time.sleep(0.5)  # the server has accepted them and handed them to its workers
            for _ in range(3):
                elapsed, body = timed_scrape(srv.metrics_address)
                assert elapsed < 1.0, f"a scrape took {elapsed:.2f} s behind {IDLE} idle connections"
                assert "hsx_device_lost 0" in body
            start = time.monotonic()
            assert srv.stop() == 0  # idle connections do not hold up the shutdown either
            assert time.monotonic() - start < 10
        finally:
            for s in held:
                s.close()


def test_connections_that_send_no_request_are_dropped_after_the_timeout(bin_dir, tiny):
    with HsxServer(bin_dir, tiny) as srv:
        held = hold(srv.metrics_address, 4)
        try:
            start = time.monotonic()
            for s in held:
                s.settimeout(REQUEST_TIMEOUT + 10)
                try:
                    s.recv(4096)  # the server closes (a 4xx page or nothing at all, then EOF)
                except ConnectionResetError:
                    pass
            elapsed = time.monotonic() - start
            assert REQUEST_TIMEOUT - 1 < elapsed < REQUEST_TIMEOUT + 5, elapsed
        finally:
            for s in held:
                s.close()
