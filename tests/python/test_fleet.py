"""A fleet on loopback: 3 hsx-server processes and 4 hsx-dump shard jobs sharing one output
directory, one server started late and another killed mid-run, and one sample that cannot be
extracted (a token id outside the vocabulary).

It proves: every sample but the bad one is written exactly once, over the shards' own journals
(journal/shard-I-of-4.jsonl), and hsx-verify --strict passes; the late server joins and gets work
(its own hsx_requests_total); the bad sample lands in quarantine with its reason, the rest finish,
and its shard exits with status 3; hsx-dump status reports the input's total, what is done,
failures and retries, during the run and after it; hsx.journal reads the same set of samples."""

import json
import subprocess
import time

from dump_helpers import free_port, manifest, sample_rows, write_jsonl
from hsx.journal import complete_samples, quarantined
from hsx_server import HsxServer

N = 200
SHARDS = 4
BAD = 13  # the sample with a token id outside the vocabulary (shard 1)


def status(tools, out):
    proc = subprocess.run([str(tools / "hsx-dump"), "status", str(out), "--json"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def requests(server):
    return server.scrape().get("hsx_requests_total", 0.0)


def test_fleet_of_servers_and_shards_loses_nothing(tools, tiny, tmp_path):
    rows = sample_rows(N, lo=64, hi=160, seed=21)
    rows[BAD]["input_ids"][3] = 10**6
    inputs = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    # Short connection ages: every client connection gets GOAWAY during the run.
    age = ["--max-connection-age", "2s", "--max-connection-age-grace", "30s"]
    a = HsxServer(tools, tiny, *age).start()
    b = HsxServer(tools, tiny, *age).start()
    late = HsxServer(tools, tiny, *age, listen=f"127.0.0.1:{free_port()}")
    servers = ",".join([a.address, b.address, late.cmd[late.cmd.index("--listen") + 1]])
    dumps = [subprocess.Popen([str(tools / "hsx-dump"), "--server", servers, "--input", str(inputs), "--out", str(out),
                               "--shard", f"{i}/{SHARDS}", "--concurrency", "2", "--max-failures", "1",
                               "--progress", "plain", "--progress-interval", "0.5", "--retries", "20"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(SHARDS)]
    try:
        seen_running = False
        started_late = killed = False
        deadline = time.time() + 50
        while any(d.poll() is None for d in dumps):
            assert time.time() < deadline, "the fleet did not finish in 50 s"
            done = len(manifest(out))
            if not started_late and done >= 4:
                late.start()
                started_late = True
            if not killed and done >= N // 3:
                b.kill()  # SIGKILL mid-run: its streams in flight are retried elsewhere
                killed = True
            if (out / "status").is_dir() and len(list((out / "status").glob("*.json"))) == SHARDS:
                s = status(tools, out)
                assert s["total_samples"] == N, s
                assert 0 <= s["done_samples"] <= N - 1, s
                seen_running |= s["running_shards"] > 0 and s["done_samples"] < N - 1
            time.sleep(0.1)
        results = [(d.returncode, *d.communicate()) for d in dumps]
        late_requests = requests(late)  # before the servers go
        a_requests = requests(a)
    finally:
        for d in dumps:
            if d.poll() is None:
                d.kill()
        for server in (a, b, late):
            server.kill()
    assert started_late and killed, "the run ended before the late start or the kill"
    assert seen_running, "hsx-dump status never saw the run in progress"
    for i, (rc, stdout, stderr) in enumerate(results):
        assert rc == (3 if i == BAD % SHARDS else 0), f"shard {i}: exit {rc}\n{stderr}"
    assert "quarantined in" in results[BAD % SHARDS][2] and "exit status 3" in results[BAD % SHARDS][2]

    # Every sample but the bad one, exactly once, each in its shard's journal.
    entries = manifest(out)
    indices = sorted(e["index"] for e in entries)
    assert indices == [i for i in range(N) if i != BAD], "samples missing or written twice"
    for i in range(SHARDS):
        lines = (out / "journal" / f"shard-{i}-of-{SHARDS}.jsonl").read_text().splitlines()
        assert all(json.loads(line)["index"] % SHARDS == i for line in lines)
    assert not (out / "manifest.jsonl").exists()
    assert [index for index, _, _ in complete_samples(out)] == indices
    bad = quarantined(out)
    assert list(bad) == [BAD] and bad[BAD]["code"] == "INVALID_ARGUMENT", bad
    assert "input_ids[3] = 1000000 is outside the vocabulary" in bad[BAD]["reason"], bad

    verify = subprocess.run([str(tools / "hsx-verify"), str(out), "--strict"], capture_output=True, text=True,
                            timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    verify = subprocess.run([str(tools / "hsx-verify"), str(out), "--input", str(inputs)], capture_output=True,
                            text=True, timeout=120)
    assert verify.returncode == 1 and f"not journaled: {BAD} (1 of them quarantined" in verify.stdout, verify.stdout

    # The late server got work: hsx_requests_total counts per replica.
    assert late_requests > 0 and a_requests > 0, (late_requests, a_requests)
    # The status after the run: the same totals, no shard running; retries as the shards reported them.
    s = status(tools, out)
    assert (s["total_samples"], s["done_samples"], s["quarantined"], s["running_shards"]) == (N, N - 1, 1, 0), s
    reported = sum(int(stdout.split(" retries;")[0].rsplit(" ", 1)[1]) for _, stdout, _ in results)
    assert s["retries"] == reported, (s, reported)


def test_status_totals_after_the_run_and_a_retry_of_the_quarantine(tools, tiny, tmp_path):
    """hsx-dump status after the run: the input's total, what is done, one quarantined sample,
    the retries the shards reported; --retry-quarantined takes it up again (still failing: 3)."""
    rows = sample_rows(12, seed=22)
    rows[5]["input_ids"][0] = -1
    inputs = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    with HsxServer(tools, tiny) as server:
        for i in range(2):
            proc = subprocess.run([str(tools / "hsx-dump"), "--server", server.address, "--input", str(inputs),
                                   "--out", str(out), "--shard", f"{i}/2", "--max-failures", "3"],
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == (3 if i == 1 else 0), proc.stderr
        s = status(tools, out)
        assert (s["total_samples"], s["done_samples"], s["quarantined"], s["running_shards"]) == (12, 11, 1, 0), s
        assert s["done_tokens"] == sum(len(r["input_ids"]) for i, r in enumerate(rows) if i != 5), s
        assert s["eta_s"] == 0, s
        text = subprocess.run([str(tools / "hsx-dump"), "status", str(out)], capture_output=True, text=True,
                              timeout=30).stdout
        assert "11/12 samples done" in text and "1 quarantined" in text, text
        again = subprocess.run([str(tools / "hsx-dump"), "--server", server.address, "--input", str(inputs),
                                "--out", str(out), "--shard", "1/2", "--max-failures", "3", "--retry-quarantined"],
                               capture_output=True, text=True, timeout=60)
        assert again.returncode == 3 and "failed 1" in again.stdout, again.stdout + again.stderr
        assert len((out / "quarantine" / "shard-1-of-2.jsonl").read_text().splitlines()) == 2
        over = subprocess.run([str(tools / "hsx-dump"), "--server", server.address, "--input", str(inputs),
                               "--out", str(out), "--shard", "1/2", "--retry-quarantined"],
                              capture_output=True, text=True, timeout=60)
        assert over.returncode == 1 and "outside the vocabulary" in over.stderr, over.stderr


def test_single_shared_journal_of_older_dumps_stays_readable(run, tools, tiny, tmp_path):
    """A dump from before per-shard journals (every shard appended to one manifest.jsonl) is read
    by hsx-verify, hsx.journal and hsx-dump status, and a sharded rerun skips all of it."""
    rows = sample_rows(10, seed=23)
    inputs = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    for i in range(2):
        run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, "--shard", f"{i}/2")
    shared = "".join((out / "journal" / f"shard-{i}-of-2.jsonl").read_text() for i in (1, 0))
    for path in (out / "journal").iterdir():
        path.unlink()
    (out / "journal").rmdir()
    (out / "manifest.jsonl").write_text(shared)  # the old layout: one journal, shards interleaved
    run("hsx-verify", out, "--input", inputs, "--strict")
    assert [index for index, _, _ in complete_samples(out)] == list(range(10))
    proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, "--shard", "1/2")
    assert "wrote 0 samples, skipped 5 already done" in proc.stdout, proc.stdout
    assert (out / "journal" / "shard-1-of-2.jsonl").read_text() == ""  # its own journal, empty: nothing new
    s = status(tools, out)
    assert (s["total_samples"], s["done_samples"]) == (10, 10), s


def test_a_sample_in_two_shards_journals_stops_a_rerun_naming_both_lines(run, tiny, tmp_path):
    """A sample current in two journals (a line copied by hand) is refused by hsx-dump's resume
    with the message hsx-verify and hsx-dump status give: both journals' lines named; nothing
    is written."""
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(6, seed=5))
    out = tmp_path / "out"
    for i in range(2):
        run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, "--shard", f"{i}/2")
    first = (out / "journal" / "shard-0-of-2.jsonl").read_text().splitlines()[0]
    other = out / "journal" / "shard-1-of-2.jsonl"
    other.write_text(other.read_text() + first + "\n")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir() if p.is_file())
    proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, "--shard", "0/2", expect_ok=False)
    index = json.loads(first)["index"]
    assert f"shard-1-of-2.jsonl:4: sample {index} is journaled twice (also at " in proc.stderr, proc.stderr
    assert "shard-0-of-2.jsonl:1)" in proc.stderr, proc.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir() if p.is_file()) == before


def test_nested_layout_bounds_directories_and_is_read_through_the_journal(run, tiny, tmp_path):
    """--layout nested: sample i in OUT/{i // 1000:05d}/, at most 1000 files a directory; hsx-verify
    --strict and hsx.journal follow the journal; --for speculators refuses it (one directory)."""
    n = 1003
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [i % 2048]} for i in range(n)])
    out = tmp_path / "out"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, "--layout", "nested", "--progress", "none")
    assert sorted(p.name for p in out.iterdir()) == ["00000", "00001", "manifest.jsonl", "status"]
    assert len(list((out / "00000").iterdir())) == 1000
    assert sorted(p.name for p in (out / "00001").iterdir()) == [f"hs_{i}.safetensors" for i in (1000, 1001, 1002)]
    run("hsx-verify", out, "--input", inputs, "--strict")
    samples = complete_samples(out)
    assert [index for index, _, _ in samples] == list(range(n))
    assert samples[1002][1] == out / "00001" / "hs_1002.safetensors"
    proc = run("hsx-verify", out, "--for", "speculators", expect_ok=False)
    assert "sample files are in subdirectories (hsx-dump --layout nested)" in proc.stdout, proc.stdout


def test_bad_fleet_flags_are_refused_by_name(run, tiny, tmp_path):
    """Each new flag's bad values give an error that names the flag, before any work."""
    for value, message in [("500ms", "--max-connection-age must be 0 (never) or at least 1s"),
                           ("-1s", "--max-connection-age -1s: must be 0 to 596h")]:
        proc = run("hsx-server", "--model", tiny, "--listen", "127.0.0.1:0", "--max-connection-age", value,
                   expect_ok=False)
        assert message in proc.stderr, proc.stderr
    proc = run("hsx-server", "--model", tiny, "--listen", "127.0.0.1:0", "--max-connection-age-grace", "-5s",
               expect_ok=False)
    assert "--max-connection-age-grace -5s: must be 0 to 596h" in proc.stderr, proc.stderr
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(2))
    out = tmp_path / "out"
    for flags, message in [(["--layout", "deep"], "--layout 'deep': expected flat or nested"),
                           (["--max-failures", "-1"], "--max-failures must be at least 0")]:
        proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, *flags, expect_ok=False)
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr
        assert not out.exists()
    proc = run("hsx-dump", "status", expect_ok=False)
    assert "usage: hsx-dump status DIR [--json]" in proc.stderr, proc.stderr
    proc = run("hsx-dump", "status", tmp_path / "nothing-here", expect_ok=False)
    assert f"{tmp_path / 'nothing-here'}: not a directory" in proc.stderr, proc.stderr
    (tmp_path / "empty").mkdir()
    proc = run("hsx-dump", "status", tmp_path / "empty")  # nothing yet: no total, nothing done
    assert "0/? samples done" in proc.stdout and "total unknown" in proc.stdout, proc.stdout
