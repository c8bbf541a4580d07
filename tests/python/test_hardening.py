"""Defects an adversarial run found, each pinned by a test:
log forging before authentication, listen addresses out of range, absurd limits,
configs that lie, and hsx-dump inputs that are not plain files (FIFO, pipe,
/dev/zero) or that repeat a key."""

import json
import os
import re
import subprocess
import threading

import grpc
import pytest
import xxhash

from dump_helpers import write_jsonl
from hsx_server import HsxServer


def test_client_text_cannot_forge_log_lines(bin_dir, tiny, hsx_pb, tmp_path):
    pb, pb_grpc = hsx_pb
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    forged = "2026-01-01T00:00:00.000Z E hsx-server: FORGED"
    hostile = f"x\n{forged}\r\x1b[31mred\x00nul\\ é" + "é" * 200  # UTF-8 past the 128-byte cut
    with HsxServer(bin_dir, tiny, "--auth-token-file", token, metrics=False) as srv:
        channel = grpc.insecure_channel(srv.address)
        stub = pb_grpc.HiddenStatesStub(channel)
        with pytest.raises(grpc.RpcError) as err:  # rejected before authentication: logged all the same
            list(stub.Extract(pb.ExtractRequest(sample_id=hostile, token_ids=[1, 2, 3]), timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
    log = srv.text()
    assert not any(line.startswith(forged) for line in log.splitlines()), log
    assert "\x1b" not in log and "\x00" not in log and "\r" not in log
    line = next(l for l in log.splitlines() if "UNAUTHENTICATED" in l)
    assert "\\x0a2026-01-01T00:00:00.000Z E hsx-server: FORGED\\x0d\\x1b[31mred\\x00nul\\\\" in line, line
    assert "é..." in line, "the id is cut at a character boundary"  # text=True: invalid UTF-8 would raise


@pytest.mark.parametrize("flags, message", [
    (["--listen", "127.0.0.1:99999"], "--listen '127.0.0.1:99999': port '99999' is not in 0..65535"),
    (["--listen", "::1:50051"], "write an IPv6 host in brackets"),
    (["--metrics-listen", "127.0.0.1:70000"], "--metrics-listen '127.0.0.1:70000'"),
    (["--health-listen", "localhost"], "--health-listen 'localhost': expected HOST:PORT"),
    (["--max-request-bytes", "1"], "--max-request-bytes 1: at least 256"),
    (["--max-batch-tokens", "99999999999"], "--max-batch-tokens 99999999999: expected 1 to"),
    (["--threads", "1000000"], "--threads 1000000: expected 0 (all cores) to 1024"),
])
def test_bad_flags_are_refused_before_anything_listens(run, tiny, flags, message):
    proc = run("hsx-server", "--model", tiny, *flags, expect_ok=False, timeout=60)
    assert message in proc.stderr, proc.stderr
    assert "listening on" not in proc.stderr


def test_plaintext_without_token_off_loopback_warns(bin_dir, tiny):
    with HsxServer(bin_dir, tiny, listen="0.0.0.0:0", metrics=False) as srv:
        pass
    assert "serving plaintext without a token on 0.0.0.0:0" in srv.text()
    with HsxServer(bin_dir, tiny, metrics=False) as srv:  # loopback: no warning
        pass
    assert "serving plaintext without a token" not in srv.text()


@pytest.mark.parametrize("field, value", [
    ("max_position_embeddings", 0), ("rms_norm_eps", 0), ("rope_theta", -1), ("routed_scaling_factor", 1e9),
    ("model_type", "llama"),
])
def test_a_lying_config_is_refused_at_start(run, make_model, tmp_path, field, value):
    model = make_model("k2", seed=3, fresh=True)
    config = json.loads((model / "config.json").read_text())
    config[field] = value
    (model / "config.json").write_text(json.dumps(config))
    proc = run("hsx-server", "--model", model, "--listen", "127.0.0.1:0", expect_ok=False, timeout=60)
    assert f"'{field}'" in proc.stderr, proc.stderr
    assert "SERVING" not in proc.stderr.replace("NOT_SERVING", "")


def test_a_config_that_under_reports_layers_is_refused(run, make_model):
    model = make_model("k2", seed=4, fresh=True)  # the tiny preset has 8 layers
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = 4
    (model / "config.json").write_text(json.dumps(config))
    proc = run("hsx-server", "--model", model, "--listen", "127.0.0.1:0", expect_ok=False, timeout=60)
    assert re.search(r"tensor 'model\.layers\.[4-7]\.\S+' belongs to layer [4-7], but config.json says "
                     r"num_hidden_layers 4", proc.stderr), proc.stderr


def rows(n=3):
    return [{"input_ids": [(7 * i + j) % 2000 for j in range(5 + i)], "id": f"r{i}"} for i in range(n)]


def journal_input_hash(out):
    lines = (out / "manifest.jsonl").read_text().splitlines()
    return {json.loads(l)["input_xxh64"] for l in lines}


def test_a_fifo_input_is_read_once_and_hashed(run, tiny, tmp_path):
    text = "".join(json.dumps(r) + "\n" for r in rows())
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text(text), daemon=True)
    writer.start()
    out = tmp_path / "out"
    run("hsx-dump", "--model", tiny, "--input", fifo, "--out", out, timeout=120)
    writer.join(5)
    assert journal_input_hash(out) == {xxhash.xxh64(text.encode()).hexdigest()}


def test_a_piped_input_journals_the_hash_of_what_was_read(bin_dir, tiny, tmp_path):
    text = "".join(json.dumps(r) + "\n" for r in rows())
    out = tmp_path / "out"
    proc = subprocess.run([str(bin_dir / "hsx-dump"), "--model", str(tiny), "--input", "/dev/stdin",
                           "--out", str(out)], input=text, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert journal_input_hash(out) == {xxhash.xxh64(text.encode()).hexdigest()}
    assert xxhash.xxh64(b"").hexdigest() not in journal_input_hash(out)


def test_an_endless_line_is_refused_with_bounded_memory(run, tiny, tmp_path):
    out = tmp_path / "out"
    proc = run("hsx-dump", "--model", tiny, "--input", "/dev/zero", "--out", out, expect_ok=False, timeout=120)
    assert re.search(r"/dev/zero:1: line longer than \d+ bytes", proc.stderr), proc.stderr
    assert not out.exists() or not any(out.iterdir())


def test_a_duplicate_key_is_refused(run, tiny, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n{"input_ids": [1, 2], "input_ids": [3]}\n')
    proc = run("hsx-dump", "--model", tiny, "--input", path, "--out", tmp_path / "out", expect_ok=False)
    assert f"{path}:2: key 'input_ids' appears twice" in proc.stderr, proc.stderr


def test_temporaries_of_other_writers_are_left_alone_and_done_ones_cleaned(run, tiny, tmp_path):
    """Staging names are random per run, never a PID that another host may reuse; a run removes
    temporaries of samples the journal records as done (provably nobody's work) and nothing else."""
    inputs = write_jsonl(tmp_path / "in.jsonl", rows(4))
    out = tmp_path / "out"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, "--shard", "0/2")  # samples 0 and 2
    foreign = out / "hs_1.safetensors.partial.999999"  # a writer on another host, PID 999999
    foreign.write_bytes(b"someone else's half-written file")
    stale = out / "hs_0.safetensors.partial.1"  # left by a killed writer of a sample now done
    stale.write_bytes(b"stale")
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    assert foreign.read_bytes() == b"someone else's half-written file"
    assert not stale.exists()
    names = sorted(p.name for p in out.iterdir())
    assert [n for n in names if ".partial." in n or ".tmp." in n] == [foreign.name], names


def test_two_writers_that_are_both_pid_1_share_a_directory_safely(bin_dir, tiny, tmp_path):
    """Two pods on one volume: both hsx-dump processes are PID 1 in their own PID namespaces."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create PID namespaces here: {probe.stderr.decode().strip()}")
    inputs = write_jsonl(tmp_path / "in.jsonl", rows(24))
    out = tmp_path / "out"
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", str(bin_dir / "hsx-dump"), "--model", str(tiny),
           "--input", str(inputs), "--out", str(out), "--concurrency", "4", "--threads", "1"]
    writers = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for w in writers:
        stdout, stderr = w.communicate(timeout=300)
        assert w.returncode == 0, stderr
    verify = subprocess.run([str(bin_dir / "hsx-verify"), str(out), "--input", str(inputs), "--strict"],
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    indices = [json.loads(l)["index"] for l in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(indices) == list(range(24))


def test_sighup_drains_and_says_so(bin_dir, tiny):
    import signal as signals
    srv = HsxServer(bin_dir, tiny, metrics=False).start()
    srv.signal(signals.SIGHUP)
    assert srv.proc.wait(60) == 0, srv.text()
    assert "received Hangup: draining" in srv.text(), srv.text()


def test_a_duplicate_journal_line_is_refused_on_resume(run, tiny, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", rows(3))
    out = tmp_path / "out"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    journal = out / "manifest.jsonl"
    first = journal.read_text().splitlines()[0]
    with journal.open("a") as f:
        f.write(first + "\n")
    proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, expect_ok=False)
    index = json.loads(first)["index"]
    assert f"manifest.jsonl:4: sample {index} is journaled twice (also at line 1)" in proc.stderr, proc.stderr


def test_verify_names_what_a_stray_file_is(run, tiny, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", rows(2))
    out = tmp_path / "out"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    (out / "README.txt").write_text("notes")
    (out / "hs_7.safetensors.partial.0123456789abcdef").write_bytes(b"x")
    proc = run("hsx-verify", out, "--strict", expect_ok=False)
    assert "README.txt: error: not written by hsx-dump" in proc.stdout, proc.stdout
    assert "partial.0123456789abcdef: error: a temporary of an interrupted (or still running) write" in proc.stdout
    assert "hsx-dump writes it again" not in proc.stdout
    assert run("hsx-verify", out).returncode == 0  # without --strict these are warnings


def test_a_client_that_never_reads_is_cut_off(bin_dir, tiny, hsx_pb):
    """It keeps its connection open but never opens its flow-control window: after
    --stream-stall-timeout the stream is cancelled and its slot freed (one slot here), and the
    log says why."""
    import time
    pb, pb_grpc = hsx_pb
    stalling = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1 << 20)]
    request = pb.ExtractRequest(sample_id="stalled", token_ids=[i % 2000 for i in range(2048)],
                                capture_ids=list(range(9)), final_norm=True, dtype=pb.DTYPE_FP32)  # 10 MiB
    with HsxServer(bin_dir, tiny, "--stream-stall-timeout", "2s", "--max-concurrent-requests", 1,
                   "--max-chunk-bytes", "256KiB", "--max-buffered-bytes-per-stream", "1MiB", metrics=False) as srv:
        with grpc.insecure_channel(srv.address, options=stalling) as channel:
            stub = pb_grpc.HiddenStatesStub(channel)
            stalled = stub.Extract(request, timeout=120)  # never read
            deadline = time.time() + 30
            while "took no data for" not in srv.text() and time.time() < deadline:
                time.sleep(0.2)
            assert "sample_id='stalled'" in srv.text() and "(--stream-stall-timeout)" in srv.text(), srv.text()
            # The slot is free again: the next request (read to the end) is served.
            small = pb.ExtractRequest(sample_id="next", token_ids=[1, 2, 3])
            assert len(list(stub.Extract(small, timeout=60))) >= 2
            stalled.cancel()


def test_revisions_see_a_truncated_shard_and_the_full_digest_a_flipped_byte(run, make_model):
    model = make_model("k2", seed=5, fresh=True)
    revision = lambda: json.loads(run("hsx-inspect", "--model", model, "--json").stdout)["revision"]
    digest = lambda: run("hsx-inspect", "--model", model, "--full-digest").stdout.split()[0]
    shard = sorted(model.glob("*.safetensors"))[0]
    before = (revision(), digest())
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0x01  # one bit in the middle of the data: invisible to the sampled revision
    shard.write_bytes(bytes(data))
    assert revision() == before[0]
    assert digest() != before[1]
    data[middle] ^= 0x01
    shard.write_bytes(bytes(data) + b"\0" * 64)  # grown: the sampled revision sees the size
    assert revision() != before[0]


@pytest.mark.parametrize("damage", ["deleted", "emptied", "truncated"])
def test_resume_redoes_a_journaled_file_that_is_gone_or_changed_size(run, tiny, tmp_path, damage):
    inputs = write_jsonl(tmp_path / "in.jsonl", rows(3))
    out = tmp_path / "out"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    victim = out / "hs_1.safetensors"
    good = victim.read_bytes()
    if damage == "deleted":
        victim.unlink()
    else:
        victim.write_bytes(b"" if damage == "emptied" else good[: len(good) // 2])
    journal = out / "manifest.jsonl"
    before = journal.read_text().splitlines()
    line = 1 + next(n for n, l in enumerate(before) if json.loads(l)["index"] == 1)  # completion order
    proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    assert f"manifest.jsonl:{line} records sample 1 as done: redoing it" in proc.stderr, proc.stderr
    assert "wrote 1 samples (1 redone: journaled, but the file was damaged), skipped 2 already done" in proc.stdout
    assert victim.read_bytes() == good  # the same bytes as the first time (deterministic)
    after = journal.read_text().splitlines()
    assert after[:3] == before  # appended, never rewritten: other shards may hold the file open
    redo = json.loads(after[3])
    assert redo["index"] == 1 and redo["supersedes"] == line
    assert not [p.name for p in out.iterdir() if ".partial." in p.name or ".tmp." in p.name]
    assert run("hsx-verify", out, "--input", inputs, "--strict").returncode == 0
    # A third run finds everything in place, the redo included.
    proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    assert "wrote 0 samples, skipped 3 already done" in proc.stdout, proc.stdout


def test_listen_failures_name_their_cause(run, tiny):
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = f"127.0.0.1:{taken.getsockname()[1]}"
    for address, cause in [("nonexistent.invalid:5000", "cannot resolve host 'nonexistent.invalid'"),
                           ("192.0.2.1:5000", "the host is not an address of this machine"),
                           (busy, "the port is in use")]:
        proc = run("hsx-server", "--model", tiny, "--listen", address, expect_ok=False, timeout=60)
        assert f"--listen {address}: {cause}" in proc.stderr or cause in proc.stderr, proc.stderr
        assert "address in use?" not in proc.stderr
    taken.close()
