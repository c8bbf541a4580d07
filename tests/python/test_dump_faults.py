"""hsx-dump quarantines only the samples at fault (issue 45, item 1).

A sample is quarantined when it is its own fault (the server refuses it as invalid, its states
fail a check); a failure of the environment (a full disk on the partial file, the rename or the
journal; the servers busy, unreachable or too slow after the retries) stops the run instead,
with exit status 75, a message that says so and that a rerun resumes, and marks no sample: with
the fleet's --max-failures=100 a full volume used to quarantine the good samples it could not
write, and reruns skipped them until --retry-quarantined.

Likewise behind a stalled client: a client that holds every slot of the server (it never reads
its streams) makes every sample RESOURCE_EXHAUSTED after the retries: exit 75, nothing
quarantined, and once the slots are free a rerun completes.

The disk test fills a real 3 MiB tmpfs (skipped, with the reason, where mounting is not
permitted), then remounts it larger and reruns the same commands: they complete and hsx-verify
--strict passes."""

import shutil
import subprocess

import grpc
import pytest

from dump_helpers import manifest, sample_rows, write_jsonl
from hsx_server import HsxServer
from server_helpers import LONG, N_LAYERS, STALLING_CLIENT, random_ids, scrape, wait_for

EXIT_ENVIRONMENT = 75  # hsx-dump's status when the environment, not a sample, stopped the run
N = 40
SHARDS = 2


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs, unmounted at the end."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot make a small file system to fill")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        reason = f"cannot mount a tmpfs to fill (not permitted here?): {proc.stderr.strip()}"
        print(reason)
        pytest.skip(reason)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _dump_shards(tools, server, inputs, out, *extra):
    """Runs every shard of the dump at once; returns [(returncode, stdout, stderr)] by shard."""
    procs = [subprocess.Popen([str(tools / "hsx-dump"), "--server", server.address, "--input", str(inputs),
                               "--out", str(out), "--shard", f"{i}/{SHARDS}", "--concurrency", "4",
                               "--max-failures", "100", "--progress", "none", *map(str, extra)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(SHARDS)]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
        return [(p.returncode, *output) for p, output in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _quarantined_lines(out):
    return [line for path in sorted((out / "quarantine").glob("*.jsonl")) for line in
            path.read_text().splitlines() if line.strip()]


def test_full_disk_stops_the_run_and_quarantines_nothing(tools, tiny, tmp_path, small_disk):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(N, lo=40, hi=120, seed=45))
    with HsxServer(tools, tiny) as server:
        # How much the whole dump takes, to leave a third of it free on the small disk.
        reference = tmp_path / "reference"
        _dump_shards(tools, server, inputs, reference)
        total = sum(p.stat().st_size for p in reference.glob("hs_*.safetensors"))
        out = small_disk / "out"
        filler = small_disk / "filler"
        free = shutil.disk_usage(small_disk).free
        assert free > total // 3, (free, total)
        filler.write_bytes(b"\0" * (free - total // 3))

        results = _dump_shards(tools, server, inputs, out)
        assert not _quarantined_lines(out), _quarantined_lines(out)
        written = len(manifest(out))
        assert written < N, "the disk did not fill"
        for i, (rc, _, stderr) in enumerate(results):
            assert rc == EXIT_ENVIRONMENT, f"shard {i}: exit {rc}\n{stderr}"
            assert "No space left on device" in stderr and "quarantined in" not in stderr, stderr
            assert "stopped by the environment, not by a sample" in stderr, stderr
            assert "nothing quarantined" in stderr and "rerun the same command to resume" in stderr, stderr
            assert str(out) in stderr, stderr
            assert f"exit status {EXIT_ENVIRONMENT}" in stderr, stderr

        # Space again: the same commands resume and complete.
        filler.unlink()
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
        results = _dump_shards(tools, server, inputs, out)
    for i, (rc, stdout, stderr) in enumerate(results):
        assert rc == 0 and "failed 0" in stdout, f"shard {i}: exit {rc}\n{stdout}\n{stderr}"
    assert sorted(e["index"] for e in manifest(out)) == list(range(N))
    assert not _quarantined_lines(out)
    verify = subprocess.run([str(tools / "hsx-verify"), str(out), "--strict", "--input", str(inputs)],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_busy_server_behind_a_stalled_client_stops_the_run_and_quarantines_nothing(tools, tiny, tmp_path, hsx_pb):
    pb, pb_grpc = hsx_pb
    slots = 2
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(10, seed=46))
    out = tmp_path / "out"
    with HsxServer(tools, tiny, "--max-concurrent-requests", slots, "--max-chunk-bytes", 256 << 10,
                   "--max-buffered-bytes-per-stream", 1 << 20) as server:
        with grpc.insecure_channel(server.address, options=STALLING_CLIENT) as channel:
            stub = pb_grpc.HiddenStatesStub(channel)
            held = [stub.Extract(pb.ExtractRequest(sample_id=f"held{i}", token_ids=random_ids(LONG, seed=i),
                                                   capture_ids=list(range(N_LAYERS + 1)), final_norm=True,
                                                   dtype=pb.DTYPE_FP32), timeout=120)
                    for i in range(slots)]  # never read
            try:
                wait_for(lambda: scrape(server)["hsx_inflight_requests"] == slots, what="the slots to be held")
                proc = subprocess.run([str(tools / "hsx-dump"), "--server", server.address, "--input", str(inputs),
                                       "--out", str(out), "--max-failures", "100", "--retries", "2",
                                       "--progress", "none"], capture_output=True, text=True, timeout=120)
            finally:
                for call in held:
                    call.cancel()
        assert proc.returncode == EXIT_ENVIRONMENT, proc.stderr
        assert "RESOURCE_EXHAUSTED" in proc.stderr and "too many concurrent requests" in proc.stderr, proc.stderr
        assert "stopped by the environment, not by a sample (nothing quarantined for it)" in proc.stderr, proc.stderr
        assert "rerun the same command to resume once the servers answer" in proc.stderr, proc.stderr
        assert "quarantined in" not in proc.stderr and not _quarantined_lines(out), proc.stderr
        assert "failed 0" in proc.stdout, proc.stdout

        wait_for(lambda: scrape(server)["hsx_inflight_requests"] == 0, what="the held streams to end")
        rerun = subprocess.run([str(tools / "hsx-dump"), "--server", server.address, "--input", str(inputs),
                                "--out", str(out), "--max-failures", "100", "--progress", "none"],
                               capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0 and "wrote 10 samples" in rerun.stdout, rerun.stdout + rerun.stderr
    verify = subprocess.run([str(tools / "hsx-verify"), str(out), "--strict", "--input", str(inputs)],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
