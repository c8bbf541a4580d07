"""hsx-dump --server: real hsx-server processes on loopback and real hsx-dump
processes. Remote files are byte-identical to in-process files; shards cover
every sample once; samples go round-robin over servers; UNAVAILABLE is
retried (a server that starts late, one killed and restarted mid-dump); other
statuses fail at once with the server's message; TLS, mTLS and tokens work."""

import random
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import xxhash
import torch
from safetensors.torch import load_file

from dump_helpers import RECEIVE_PATHS, VOCAB, free_port, manifest, sample_rows, wait_for_lines, write_jsonl
from hsx_server import HsxServer


def start_dump(tools, *args):
    cmd = [str(tools / "hsx-dump"), *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=90):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def metric(server, name):
    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{}"):
                return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


def files(out):
    return sorted(p.name for p in Path(out).iterdir() if p.name.startswith("hs_"))


def assert_same_files(a, b):
    assert files(a) == files(b)
    for name in files(a):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name


def verify(run, out, inputs, *args):
    proc = run("hsx-verify", out, "--input", inputs, *args)
    assert " 0 errors" in proc.stdout, proc.stdout
    return proc


SETTINGS = [
    pytest.param([], [], id="bf16-eagle3"),
    pytest.param(["--precision", "fp32"],
                 ["--precision", "fp32", "--dtype", "fp16", "--capture", "all", "--final-norm"],
                 id="fp32-fp16-all-final-norm"),
]


@pytest.mark.parametrize("server_args,dump_args", SETTINGS)
def test_remote_files_are_byte_identical_to_in_process(run, tools, tiny, tmp_path, server_args, dump_args):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(24))
    local, remote = tmp_path / "local", tmp_path / "remote"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", local, *dump_args)
    # Small chunks: every tensor arrives in several pieces that must be reassembled.
    with HsxServer(tools, tiny, "--max-chunk-bytes", "1000", *server_args) as server:
        run("hsx-dump", "--server", server.address, "--input", inputs, "--out", remote, "--concurrency", 5,
            *dump_args)
    assert set(files(remote)) == {f"hs_{i}.safetensors" for i in range(24)}
    assert_same_files(local, remote)
    for i in (0, 1, 23):  # the tensors themselves, as a trainer reads them
        a = load_file(str(local / f"hs_{i}.safetensors"))
        b = load_file(str(remote / f"hs_{i}.safetensors"))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (i, key)
    # The journals agree line for line (in completion order, which differs).
    key = lambda e: e["index"]  # noqa: E731
    assert sorted(manifest(local), key=key) == sorted(manifest(remote), key=key)
    verify(run, remote, inputs)


@pytest.fixture(scope="module")
def server(tools, tiny):
    with HsxServer(tools, tiny) as s:
        yield s


def test_shards_cover_every_sample_exactly_once(run, tools, tiny, server, tmp_path):
    n, shards = 30, 3
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(n, seed=1))
    out = tmp_path / "out"
    # All shards at once, into one directory and one journal.
    procs = [start_dump(tools, "--server", server.address, "--input", inputs, "--out", out,
                        "--shard", f"{i}/{shards}", "--concurrency", 2) for i in range(shards)]
    for i, proc in enumerate(procs):
        rc, stdout, stderr = finish(proc)
        assert rc == 0, stderr
        share = len(range(i, n, shards))
        assert f"wrote {share} samples, skipped 0 already done, failed 0" in stdout, stdout
    indices = [e["index"] for e in manifest(out)]
    assert sorted(indices) == list(range(n))  # each exactly once
    verify(run, out, inputs, "--strict")
    # Shards also work in-process, and a finished shard has nothing left to do.
    proc = run("hsx-dump", "--server", server.address, "--input", inputs, "--out", out, "--shard", "1/3")
    assert f"wrote 0 samples, skipped {len(range(1, n, 3))} already done" in proc.stdout
    local = tmp_path / "local"
    for i in range(2):
        run("hsx-dump", "--model", tiny, "--input", inputs, "--out", local, "--shard", f"{i}/2")
    assert sorted(e["index"] for e in manifest(local)) == list(range(n))
    assert_same_files(local, out)


def test_round_robin_over_two_servers(run, tools, tiny, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(40, seed=2))
    out = tmp_path / "out"
    with HsxServer(tools, tiny) as a, HsxServer(tools, tiny) as b:
        run("hsx-dump", "--server", f"{a.address},{b.address}", "--input", inputs, "--out", out,
            "--concurrency", 4)
        served = metric(a, "hsx_samples_total"), metric(b, "hsx_samples_total")
    assert sum(served) == 40 and min(served) >= 15, served
    verify(run, out, inputs)


def test_waits_for_a_server_that_starts_late(run, tools, tiny, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(10, seed=3))
    port = free_port()
    out = tmp_path / "out"
    proc = start_dump(tools, "--server", f"127.0.0.1:{port}", "--input", inputs, "--out", out)
    time.sleep(1.0)
    assert proc.poll() is None, "hsx-dump gave up while the server was still starting"
    with HsxServer(tools, tiny, listen=f"127.0.0.1:{port}"):
        rc, stdout, stderr = finish(proc)
    assert rc == 0, stderr
    assert "UNAVAILABLE" in stderr and "retry 1/8" in stderr, stderr
    assert "wrote 10 samples" in stdout
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", tmp_path / "local")
    assert_same_files(tmp_path / "local", out)


def test_a_dead_server_is_left_out_at_start_and_joins_when_it_comes_up(run, tools, tiny, tmp_path):
    """--server good,dead starts with the live address, logs the dead one, keeps asking it, and
    sends it samples once it answers."""
    n = 400
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(n, lo=32, hi=96, seed=8))
    port = free_port()
    late_address = f"127.0.0.1:{port}"
    out = tmp_path / "out"
    with HsxServer(tools, tiny) as good:
        proc = start_dump(tools, "--server", f"{good.address},{late_address}", "--input", inputs, "--out", out,
                          "--concurrency", 2)
        wait_for_lines(out, 20, proc)  # running on the good server alone
        with HsxServer(tools, tiny, listen=late_address) as late:
            rc, stdout, stderr = finish(proc)
            served = metric(good, "hsx_samples_total"), metric(late, "hsx_samples_total")
    assert rc == 0, stderr
    assert f"server {late_address}: GetModelInfo: UNAVAILABLE" in stderr and "starting without it" in stderr, stderr
    assert f"server {late_address} answers now: it joins the round-robin" in stderr, stderr
    assert f"wrote {n} samples" in stdout, stdout
    assert sum(served) == n and served[1] > 0, served
    verify(run, out, inputs, "--strict")


def test_no_usable_server_is_an_error_naming_each(run, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(2))
    dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    proc = run("hsx-dump", "--server", ",".join(dead), "--input", inputs, "--out", tmp_path / "out",
               "--retries", 1, expect_ok=False)
    assert "no server is usable" in proc.stderr and all(f"server {d}: GetModelInfo: UNAVAILABLE" in proc.stderr
                                                        for d in dead), proc.stderr
    assert manifest(tmp_path / "out") == []


def test_server_killed_and_restarted_mid_dump(run, tools, tiny, tmp_path):
    n = 200
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(n, lo=32, hi=96, seed=4))
    port = free_port()
    out = tmp_path / "out"
    first = HsxServer(tools, tiny, listen=f"127.0.0.1:{port}").start()
    try:
        proc = start_dump(tools, "--server", first.address, "--input", inputs, "--out", out, "--concurrency", 4)
        wait_for_lines(out, 20, proc)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        done_at_kill = len(manifest(out))
        assert done_at_kill < n, "the dump finished before the kill; make the samples longer"
        time.sleep(0.3)
        with HsxServer(tools, tiny, listen=f"127.0.0.1:{port}"):
            rc, stdout, stderr = finish(proc)
    finally:
        first.kill()
    assert rc == 0, stderr
    assert "retry" in stderr, stderr
    assert f"wrote {n} samples" in stdout, stdout
    verify(run, out, inputs, "--strict")
    # Retried samples are the same bytes as any other run.
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", tmp_path / "local")
    assert_same_files(tmp_path / "local", out)


def test_other_statuses_fail_at_once_with_the_server_message(run, tools, tiny, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(6, seed=5))
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-it\n")
    with HsxServer(tools, tiny, "--auth-token-file", token) as server:
        start = time.time()
        proc = run("hsx-dump", "--server", server.address, "--input", inputs, "--out", tmp_path / "a",
                   expect_ok=False)
        assert time.time() - start < 10, "a non-retryable status was retried"
        assert "UNAUTHENTICATED" in proc.stderr, proc.stderr
        proc = run("hsx-dump", "--server", server.address, "--input", inputs, "--out", tmp_path / "b",
                   "--auth-token-file", wrong, expect_ok=False)
        assert "PERMISSION_DENIED" in proc.stderr, proc.stderr
        run("hsx-dump", "--server", server.address, "--input", inputs, "--out", tmp_path / "c",
            "--auth-token-file", token)
    verify(run, tmp_path / "c", inputs)


def openssl(*args, cwd):
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def make_certs(d):
    """A CA, a server certificate for 127.0.0.1 and a client certificate."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", 2, "-subj", "/CN=hsx-test-ca",
            cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text(ext)
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", 2, "-extfile", f"{name}.ext", cwd=d)
    return d


def test_mtls_and_token(run, tools, tiny, tmp_path):
    certs = make_certs(tmp_path)
    token = tmp_path / "token"
    token.write_text("t0ken")
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(6, seed=6))
    server = HsxServer(tools, tiny, "--tls-cert", certs / "server.pem", "--tls-key", certs / "server.key",
                       "--tls-client-ca", certs / "ca.pem", "--auth-token-file", token)
    server.start(wait_serving=False)  # the helper's health check speaks plaintext
    try:
        tls = ["--tls-ca", certs / "ca.pem", "--auth-token-file", token]
        mtls = [*tls, "--tls-cert", certs / "client.pem", "--tls-key", certs / "client.key"]
        run("hsx-dump", "--server", server.address, "--input", inputs, "--out", tmp_path / "ok", *mtls)
        # Without a client certificate the handshake fails (UNAVAILABLE: retried, then given up).
        proc = run("hsx-dump", "--server", server.address, "--input", inputs, "--out", tmp_path / "nocert",
                   *tls, "--retries", 0, expect_ok=False)
        assert "UNAVAILABLE" in proc.stderr, proc.stderr
        # Plaintext against a TLS port fails too.
        proc = run("hsx-dump", "--server", server.address, "--input", inputs, "--out", tmp_path / "plain",
                   "--retries", 0, expect_ok=False)
        assert "UNAVAILABLE" in proc.stderr, proc.stderr
    finally:
        server.stop()
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", tmp_path / "local")
    assert_same_files(tmp_path / "local", tmp_path / "ok")


@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_the_python_client_over_mtls_with_a_token(tools, tiny, tmp_path, native):
    """hsx.Client with tls={ca, cert, key} and a token, on both receive paths (the native one
    builds its own TLS channel): the states a plaintext server sends; a wrong token is PERMISSION_DENIED."""
    import hsx

    certs = make_certs(tmp_path)
    (tmp_path / "token").write_text("t0ken")
    server = HsxServer(tools, tiny, "--tls-cert", certs / "server.pem", "--tls-key", certs / "server.key",
                       "--tls-client-ca", certs / "ca.pem", "--auth-token-file", tmp_path / "token")
    server.start(wait_serving=False)  # the helper's health check speaks plaintext
    tls = {"ca": str(certs / "ca.pem"), "cert": str(certs / "client.pem"), "key": str(certs / "client.key")}
    try:
        with hsx.Client(server.address, token="t0ken", tls=tls, native=native) as client:
            assert client.native == native
            sample = client.extract([5, 6, 7, 8], dtype="fp32")
        with hsx.Client(server.address, token="wrong", tls=tls, native=native, retries=0) as client:
            client._info = hsx.v1.hsx_pb2.ModelInfo(hidden_size=128)  # skip GetModelInfo: Extract's own refusal
            with pytest.raises(hsx.ServerError) as error:
                client.extract([5, 6, 7, 8])
            assert error.value.code.name == "PERMISSION_DENIED"  # a wrong token (no token: UNAUTHENTICATED)
    finally:
        server.stop()
    with HsxServer(tools, tiny) as plain:
        reference = hsx.Client(plain.address, native=False).extract([5, 6, 7, 8], dtype="fp32")
    assert sample["hidden_states"].tobytes() == reference["hidden_states"].tobytes()


# --- A misbehaving server: every way a response stream can be wrong is caught
# before anything is written (design principle 1).

def xxh64(data, seed=0):
    return xxhash.xxh64(data, seed=seed).intdigest()


FAKE_HIDDEN = 16


@pytest.mark.parametrize("capture", ["3", "eagle3"])
def test_every_wire_checksum_writes_the_same_files(run, tools, tiny, server, tmp_path, capture):
    """--wire-checksum xxh64 and xxh3 (the default): the same files, whose checksums_xxh64 hsx-verify
    recomputes (with one captured layer and xxh64 the file takes the wire's values; with xxh3 it hashes)."""
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(6))
    outs = {}
    for choice in ("xxh64", "xxh3", None):
        outs[choice] = tmp_path / str(choice)
        run("hsx-dump", "--server", server.address, "--input", inputs, "--out", outs[choice], "--capture", capture,
            "--final-norm", *(["--wire-checksum", choice] if choice else []))
        verify(run, outs[choice], inputs)
    assert_same_files(outs["xxh64"], outs["xxh3"])
    assert_same_files(outs["xxh64"], outs[None])


def test_every_stream_window_writes_the_same_files(run, tools, tiny, tmp_path):
    """--stream-window: the smallest fixed window (64 KiB, tensors of many 1000-byte chunks: each
    stream, 82-205 KB with fp32, capture all and the final norm, outgrows one window, so the server
    waits for the client's window updates), gRPC's automatic one (0) and the default write the
    same, verified files."""
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(12, lo=16, hi=40))
    outs = {}
    with HsxServer(tools, tiny, "--max-chunk-bytes", "1000") as server:
        for window in ("64KiB", "0", None):
            outs[window] = tmp_path / str(window)
            run("hsx-dump", "--server", server.address, "--input", inputs, "--out", outs[window], "--capture", "all",
                "--final-norm", "--dtype", "fp32", *(["--stream-window", window] if window else []))
            verify(run, outs[window], inputs)
    assert_same_files(outs["64KiB"], outs[None])
    assert_same_files(outs["0"], outs[None])


@pytest.mark.parametrize("window,message", [
    ("1KiB", "--stream-window 1KiB: a stream window of 1024 bytes: 0 (gRPC's automatic window) or 64KiB to 1GiB"),
    ("2GiB", "--stream-window 2GiB: a stream window of 2147483648 bytes"),
    ("lots", "--stream-window: 'lots' is not a positive size"),
])
def test_a_bad_stream_window_is_refused_before_anything_starts(run, tmp_path, window, message):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(1))
    proc = run("hsx-dump", "--server", "127.0.0.1:1", "--input", inputs, "--out", tmp_path / "out",
               "--stream-window", window, expect_ok=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_an_unknown_wire_checksum_is_refused_before_anything_starts(run, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(1))
    proc = run("hsx-dump", "--server", "127.0.0.1:1", "--input", inputs, "--out", tmp_path / "out",
               "--wire-checksum", "crc32", expect_ok=False)
    assert proc.returncode != 0
    assert "--wire-checksum 'crc32': expected xxh3 or xxh64" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def fake_header(pb, req, mode):
    """(the Header a correct server sends for req, with the header fault of `mode`; the true token hash)."""
    ids = list(req.token_ids)
    token_hash = xxh64(b"".join(i.to_bytes(8, "little", signed=True) for i in ids))
    header = pb.Header(sample_id=req.sample_id, num_tokens=len(ids), token_ids_xxh64=token_hash,
                       capture_ids=list(req.capture_ids), final_norm=req.final_norm, hidden_size=FAKE_HIDDEN,
                       dtype=req.dtype, model_name="fake", num_layers=8)
    if mode == "sample_id":
        header.sample_id = "someone-else"
    elif mode == "token_hash":
        header.token_ids_xxh64 ^= 1
    elif mode == "capture_ids":
        header.capture_ids[0] += 1
    elif mode == "hidden":
        header.hidden_size = FAKE_HIDDEN * 2
    elif mode == "dtype":
        header.dtype = pb.DTYPE_FP16
    return header, token_hash


def fake_tensors(req, mode):
    """[(capture id, bf16 bytes [T, FAKE_HIDDEN])] of finite, non-zero values, with the value fault of `mode`."""
    rng, t, row = random.Random(len(req.token_ids)), len(req.token_ids), 2 * FAKE_HIDDEN

    def value():  # a finite, non-zero bf16
        return (rng.randrange(0x3c00, 0x4100) | rng.choice((0, 0x8000))).to_bytes(2, "little")

    tensors = [(c, bytearray(b"".join(value() for _ in range(t * FAKE_HIDDEN)))) for c in req.capture_ids]
    if mode == "nan":
        tensors[1][1][row + 2:row + 4] = (0x7fc0).to_bytes(2, "little")
    if mode == "zero":
        tensors[2] = (tensors[2][0], bytearray(t * row))
    return tensors


def fake_chunks(pb, tensors, t, mode, context, first_call):
    """The chunks of tensors, two rows each, with the order, row and status faults of `mode` (a status
    fault ends the first call, first_call() true, after the first tensor)."""
    import grpc

    row = 2 * FAKE_HIDDEN  # bf16
    order = [tensors[1], tensors[0], *tensors[2:]] if mode == "order" else tensors
    for k, (capture, data) in enumerate(order):
        rows = list(range(0, t, 2))
        if k == 0 and mode == "gap":
            rows.remove(2)
        if k == 0 and mode == "overlap":
            rows.insert(2, 1)
        for r in rows:
            n = min(2, t - r)
            chunk = bytes(data[r * row:(r + n) * row])
            if k == 0 and mode == "partial" and r == 0:
                chunk = chunk[:-1]
            yield pb.ExtractResponse(chunk=pb.Chunk(capture_id=capture, first_row=r, num_rows=n, data=chunk))
        if k == 0 and mode in ("unavailable_once", "exhausted_once", "invalid") and first_call():
            code = {"unavailable_once": grpc.StatusCode.UNAVAILABLE,
                    "exhausted_once": grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "invalid": grpc.StatusCode.INVALID_ARGUMENT}[mode]
            context.abort(code, f"fake {mode}")


def fake_trailer(pb, tensors, token_hash, mode):
    """The Trailer of tensors, with the trailer fault of `mode`."""
    sums = [pb.TensorChecksum(capture_id=c, xxh64=xxh64(bytes(d))) for c, d in tensors]
    if mode == "checksum":
        sums[3].xxh64 ^= 1 << 40
    return pb.Trailer(checksums=sums, token_ids_xxh64=token_hash ^ (mode == "trailer_token_hash"))


@pytest.fixture(scope="module")
def fake_server(hsx_pb):
    """An in-process grpcio server speaking the hsx API with a chosen fault."""
    from concurrent import futures

    import grpc

    pb, pb_grpc = hsx_pb

    class Fake(pb_grpc.HiddenStatesServicer):
        mode = "ok"
        calls = 0

        def GetModelInfo(self, request, context):
            return pb.ModelInfo(model_name="fake", model_revision="0" * 16, num_layers=8,
                                hidden_size=FAKE_HIDDEN, vocab_size=VOCAB, compute_precision="bf16",
                                max_tokens_per_sample=4096)

        def Extract(self, req, context):
            Fake.calls += 1
            mode = Fake.mode
            header, token_hash = fake_header(pb, req, mode)
            yield pb.ExtractResponse(header=header)
            if mode == "hang":  # a stream that stalls after its header, until the client goes
                deadline = time.monotonic() + 60
                while context.is_active() and time.monotonic() < deadline:
                    time.sleep(0.02)
                return
            tensors = fake_tensors(req, mode)
            yield from fake_chunks(pb, tensors, len(req.token_ids), mode, context, lambda: Fake.calls == 1)
            if mode == "no_trailer":
                return
            yield pb.ExtractResponse(trailer=fake_trailer(pb, tensors, token_hash, mode))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_HiddenStatesServicer_to_server(Fake(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Fake.address = f"127.0.0.1:{port}"
    yield Fake
    server.stop(0)


FAULTS = [
    ("sample_id", "the header is for sample_id 'someone-else', requested '0'"),
    ("token_hash", "the header's token-id hash"),
    ("capture_ids", "the header has capture ids [3,4,5,8], requested [2,4,5,8]"),
    ("hidden", f"the header has hidden size {2 * FAKE_HIDDEN}, the model {FAKE_HIDDEN}"),
    ("gap", "chunk rows [4, 6) of capture id 2: expected first row 2 (a gap)"),
    ("overlap", "chunk rows [1, 3) of capture id 2: expected first row 4 (an overlap)"),
    ("partial", f"holds {4 * FAKE_HIDDEN - 1} bytes, expected {4 * FAKE_HIDDEN} (whole rows"),
    ("order", "a chunk of capture id 4 while capture id 2 has 0 of 7 rows (expected layer after layer"),
    ("checksum", "capture id 8: the received bytes hash to"),
    ("trailer_token_hash", "the trailer's token-id hash"),
    ("no_trailer", "the stream ended without a trailer (4 of 4 tensors complete)"),
    ("nan", "non-finite value (nan) in capture id 4 row 1 column 1"),
    ("zero", "capture id 5 is all zeros"),
    ("invalid", "INVALID_ARGUMENT: fake invalid"),
    ("dtype", "the header has dtype DTYPE_FP16, requested DTYPE_BF16"),
]


def test_fake_server_control_is_accepted(run, fake_server, tmp_path):
    fake_server.mode, fake_server.calls = "ok", 0
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": list(range(7)), "loss_mask": [1] * 7}])
    run("hsx-dump", "--server", fake_server.address, "--input", inputs, "--out", tmp_path / "out")
    verify(run, tmp_path / "out", inputs, "--strict")


@pytest.mark.parametrize("mode,message", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_bad_stream_is_never_written(run, fake_server, tmp_path, mode, message):
    fake_server.mode, fake_server.calls = mode, 0
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": list(range(7))}])
    out = tmp_path / "out"
    proc = run("hsx-dump", "--server", fake_server.address, "--input", inputs, "--out", out, expect_ok=False)
    assert "hsx-dump: error: sample 0 (id 0): " in proc.stderr and message in proc.stderr, proc.stderr
    assert fake_server.calls == 1, "retried a non-retryable failure"
    assert "failed 1" in proc.stdout
    assert not (out / "hs_0.safetensors").exists() and manifest(out) == []


@pytest.mark.parametrize("mode,message", FAULTS, ids=[f[0] for f in FAULTS])
def test_discard_refuses_what_the_disk_path_refuses(run, fake_server, tmp_path, mode, message):
    """--discard verifies in place (no sample assembled), with every check and message of the disk path."""
    fake_server.mode, fake_server.calls = mode, 0
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": list(range(7))}])
    proc = run("hsx-dump", "--server", fake_server.address, "--input", inputs, "--out", tmp_path / "out",
               "--discard", expect_ok=False)
    assert "hsx-dump: error: sample 0 (id 0): " in proc.stderr and message in proc.stderr, proc.stderr
    assert fake_server.calls == 1, "retried a non-retryable failure"
    assert "verified and discarded 0 samples" in proc.stdout and "failed 1" in proc.stdout, proc.stdout


def test_discard_counts_the_bytes_the_files_hold(run, tools, tiny, tmp_path):
    """--discard against a real server, chunks of 1000 bytes (rows and values split between them):
    every sample verified, and the state bytes it counts are those the disk run writes."""
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(12))
    out = tmp_path / "out"
    with HsxServer(tools, tiny, "--max-chunk-bytes", "1000") as server:
        run("hsx-dump", "--server", server.address, "--input", inputs, "--out", out, "--final-norm")
        proc = run("hsx-dump", "--server", server.address, "--input", inputs, "--out", tmp_path / "discarded",
                   "--final-norm", "--discard")
    state_bytes = 0
    for name in files(out):
        tensors = load_file(str(out / name))
        state_bytes += sum(tensors[k].numel() * tensors[k].element_size()
                           for k in ("hidden_states", "final_norm_hidden_states"))
    assert "verified and discarded 12 samples" in proc.stdout and "failed 0" in proc.stdout, proc.stdout
    assert f" {state_bytes} bytes" in proc.stdout, (state_bytes, proc.stdout)
    assert files(tmp_path / "discarded") == []


@pytest.mark.parametrize("native", RECEIVE_PATHS)
@pytest.mark.parametrize("mode,message", FAULTS, ids=[f[0] for f in FAULTS])
def test_the_python_client_refuses_what_hsx_dump_refuses(fake_server, mode, message, native):
    """hsx.Client against the same server, on both receive paths: the model it announced
    (hidden size) is checked too."""
    import hsx

    fake_server.mode, fake_server.calls = mode, 0
    with hsx.Client(fake_server.address, retries=0, native=native) as client:
        with pytest.raises((hsx.IntegrityError, hsx.ServerError)) as error:
            client.extract(list(range(7)), capture=[2, 4, 5, 8], dtype="bf16", sample_id="0")
    assert message in str(error.value)
    assert isinstance(error.value, hsx.ServerError) == (mode == "invalid")
    assert fake_server.calls == 1


@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_a_model_info_that_does_not_parse_is_a_server_error(native):
    """A server whose GetModelInfo answers bytes that are not a ModelInfo: INTERNAL on both
    receive paths (grpcio's deserializer refuses them; the native path parses them itself)."""
    from concurrent import futures

    import grpc
    import hsx

    garbled = grpc.unary_unary_rpc_method_handler(lambda request, context: b"\xff\xff\xff")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("hsx.v1.HiddenStates",
                                                                          {"GetModelInfo": garbled})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with hsx.Client(f"127.0.0.1:{port}", retries=0, native=native) as client:
            with pytest.raises(hsx.ServerError) as error:
                client.model_info()
        assert error.value.code == grpc.StatusCode.INTERNAL, error.value
    finally:
        server.stop(None)


@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_the_python_client_accepts_the_fake_servers_control(fake_server, native):
    import hsx

    fake_server.mode = "ok"
    with hsx.Client(fake_server.address, retries=0, native=native) as client:
        sample = client.extract(list(range(7)), capture=[2, 4, 5, 8], dtype="bf16", loss_mask=[1] * 7)
    assert sample.capture_ids == [2, 4, 5, 8] and sample["hidden_states"].shape == (7, 4, FAKE_HIDDEN)
    assert sample["loss_mask"].tolist() == [1] * 7


@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_closing_the_python_client_ends_its_calls_in_flight(fake_server, native):
    """Client.close() while a stream stalls: the call ends CANCELLED at once, on both paths."""
    import threading

    import hsx

    fake_server.mode, fake_server.calls = "hang", 0
    client = hsx.Client(fake_server.address, retries=0, native=native)
    client._model_info()
    outcome = []

    def extract():
        try:
            client.extract(list(range(7)), capture=[2, 4, 5, 8], dtype="bf16")
        except Exception as error:  # noqa: BLE001 - the test inspects what was raised
            outcome.append(error)

    worker = threading.Thread(target=extract)
    worker.start()
    deadline = time.monotonic() + 30
    while fake_server.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # the header is on its way: the call is in flight
    started = time.monotonic()
    client.close()
    worker.join(30)
    assert not worker.is_alive(), "close() left the call running"
    assert time.monotonic() - started < 5
    assert len(outcome) == 1 and isinstance(outcome[0], hsx.ServerError), outcome
    assert outcome[0].code.name == "CANCELLED", outcome[0]


@pytest.mark.parametrize("mode,code", [("unavailable_once", "UNAVAILABLE"), ("exhausted_once", "RESOURCE_EXHAUSTED")])
def test_a_stream_broken_midway_is_retried_from_scratch(run, fake_server, tmp_path, mode, code):
    fake_server.mode, fake_server.calls = mode, 0
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": list(range(7))}])
    proc = run("hsx-dump", "--server", fake_server.address, "--input", inputs, "--out", tmp_path / "out")
    assert f"{code}: fake {mode}; retry 1/8" in proc.stderr, proc.stderr
    assert fake_server.calls == 2
    verify(run, tmp_path / "out", inputs, "--strict")
