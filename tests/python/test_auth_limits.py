"""Failed bearer-token attempts are rate-limited per client address, logged
sampled and counted in metrics (docs/api.md, "Authentication"): a client
guessing tokens cannot flood the log, and the right token still works from
another address at once, and from the same address a second later."""

import collections
import re
import time

import grpc

from hsx_server import HsxServer

BURST = 20           # auth.h kAuthLimits: failures an address may have at once ...
REFILL_SECONDS = 1   # ... then one more per second
LOG_INTERVAL = 10    # s: at most 3 lines per address, 20 in all, then one summary line
GOOD = [("authorization", "Bearer s3cret-token")]

# What the server logs about a refused token (a call's failure line, or the summary).
AUTH_LINE = re.compile(r"UNAUTHENTICATED|PERMISSION_DENIED|RESOURCE_EXHAUSTED|authentication")


def auth_lines(srv):
    return [line for line in srv.text().splitlines() if AUTH_LINE.search(line)]


def guess(stub, pb, count):
    """`count` calls with wrong tokens (GetModelInfo and Extract in turn); their status codes."""
    codes = collections.Counter()
    for i in range(count):
        metadata = [("authorization", f"Bearer guess-{i}")]
        try:
            if i % 2:
                list(stub.Extract(pb.ExtractRequest(token_ids=[1, 2]), metadata=metadata, timeout=10))
            else:
                stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10)
        except grpc.RpcError as e:
            codes[e.code()] += 1
    return codes


def test_token_guesses_are_limited_logged_sampled_and_counted(bin_dir, tiny, hsx_pb, tmp_path):
    pb, pb_grpc = hsx_pb
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    # [::] (dual stack): reached at 127.0.0.1 and at ::1, two client addresses on one machine.
    with HsxServer(bin_dir, tiny, "--auth-token-file", token_file, listen="[::]:0") as srv:
        port = srv.address.rsplit(":", 1)[1]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, grpc.insecure_channel(f"[::1]:{port}") as other:
            stub, other_stub = pb_grpc.HiddenStatesStub(ch), pb_grpc.HiddenStatesStub(other)
            start = time.monotonic()
            codes = guess(stub, pb, 2000)
            elapsed = time.monotonic() - start
            assert sum(codes.values()) == 2000, codes
            checked = codes[grpc.StatusCode.PERMISSION_DENIED]
            assert BURST <= checked <= BURST + elapsed / REFILL_SECONDS + 2, (codes, elapsed)
            assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] == 2000 - checked, codes
            # While limited, even the right token is refused unchecked, with when to come back. (The
            # address may just have earned a try: a few ms after its last refusal, rarely.)
            refused = 0
            try:
                stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=GOOD, timeout=10)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry in" in err.details(), err
                refused = 1
            # Another address is not held back by this one's failures.
            assert other_stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=GOOD, timeout=10).num_layers > 0
            # The limited address gets its try back after a refill; the right token works then.
            time.sleep(REFILL_SECONDS + 0.2)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=GOOD, timeout=10).num_layers > 0

        metrics = srv.scrape()
        failures = 2000 + refused
        assert metrics["hsx_auth_failures_total"] == failures
        assert metrics["hsx_auth_rate_limited_total"] == failures - checked
        lines = auth_lines(srv)
        assert 3 <= len(lines) <= 20, "\n".join(lines[:40])
        # The failures not logged are summed up once the interval ends, with or without new calls.
        deadline = time.monotonic() + LOG_INTERVAL + 5
        while not any("not logged" in line for line in auth_lines(srv)) and time.monotonic() < deadline:
            time.sleep(0.2)
        summary = [line for line in auth_lines(srv) if "not logged" in line]
        assert len(summary) == 1, "\n".join(auth_lines(srv))
        logged = len(auth_lines(srv)) - 1
        assert re.search(rf"\b{failures - logged} more failed attempts", summary[0]), (logged, summary[0])
        assert srv.stop() == 0

