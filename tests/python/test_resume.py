"""The journal (manifest.jsonl) and resume: killed servers and killed dumps
lose nothing and never rewrite a finished file; a torn journal line and files
written but never journaled are handled; resume refuses other settings; and
hsx-verify finds what is wrong with an output directory."""

import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from dump_helpers import VOCAB, free_port, manifest, sample_rows, wait_for_lines, write_jsonl
from hsx_server import HsxServer

N = 240       # samples in the kill tests (at least 200)














def snapshot(out):
    """(inode, mtime_ns) of every journaled file."""
    stats = {}
    for entry in manifest(out):
        st = (Path(out) / entry["file"]).stat()
        stats[entry["file"]] = (st.st_ino, st.st_mtime_ns)
    return stats


def assert_untouched(out, before):
    after = {name: ((Path(out) / name).stat().st_ino, (Path(out) / name).stat().st_mtime_ns) for name in before}
    rewritten = [name for name in before if before[name] != after[name]]
    assert not rewritten, f"journaled files were rewritten: {rewritten[:10]}"


def start_dump(tools, *args):
    return subprocess.Popen([str(tools / "hsx-dump"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)




def verify(run, out, inputs, *args):
    proc = run("hsx-verify", out, "--input", inputs, *args)
    assert " 0 errors" in proc.stdout, proc.stdout
    return proc


@pytest.fixture(scope="module")
def kill_input(tmp_path_factory):
    """N samples long enough that a dump takes a few seconds."""
    return write_jsonl(tmp_path_factory.mktemp("kill") / "in.jsonl", sample_rows(N, lo=32, hi=96, seed=7))


@pytest.fixture(scope="module")
def reference(run, tiny, kill_input, tmp_path_factory):
    """The in-process dump of kill_input: what every resumed dump must equal."""
    out = tmp_path_factory.mktemp("reference") / "out"
    run("hsx-dump", "--model", tiny, "--input", kill_input, "--out", out)
    return out


def assert_same_as(reference, out):
    names = sorted(p.name for p in Path(out).iterdir() if p.name.startswith("hs_"))
    assert names == sorted(p.name for p in Path(reference).iterdir() if p.name.startswith("hs_"))
    for name in names:
        assert (Path(out) / name).read_bytes() == (Path(reference) / name).read_bytes(), name


def test_kill9_server_midway_then_rerun(run, tools, tiny, kill_input, reference, tmp_path):
    out = tmp_path / "out"
    with HsxServer(tools, tiny) as server:
        # --retries 1: give up soon after the server is gone.
        proc = start_dump(tools, "--server", server.address, "--input", kill_input, "--out", out,
                          "--concurrency", 4, "--retries", 1)
        wait_for_lines(out, 40, proc)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr  # the environment (no server), not the samples: nothing quarantined
    assert "UNAVAILABLE" in stderr, stderr
    done = snapshot(out)
    assert 40 <= len(done) < N
    with HsxServer(tools, tiny) as server:  # a new server (another port)
        proc = run("hsx-dump", "--server", server.address, "--input", kill_input, "--out", out,
                   "--concurrency", 4)
    assert f"wrote {N - len(done)} samples, skipped {len(done)} already done, failed 0" in proc.stdout, proc.stdout
    verify(run, out, kill_input, "--strict")
    assert_untouched(out, done)
    assert_same_as(reference, out)


def test_kill9_dump_midway_then_rerun(run, tools, tiny, kill_input, reference, tmp_path):
    out = tmp_path / "out"
    with HsxServer(tools, tiny) as server:
        proc = start_dump(tools, "--server", server.address, "--input", kill_input, "--out", out,
                          "--concurrency", 4)
        wait_for_lines(out, 40, proc)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        done = snapshot(out)
        assert 40 <= len(done) < N, "the dump finished before the kill"
        assert len(list(out.glob(".hsx-run.*"))) == 1, "the killed run's lease is left behind"
        proc = run("hsx-dump", "--server", server.address, "--input", kill_input, "--out", out)
    assert f"skipped {len(done)} already done, failed 0" in proc.stdout, proc.stdout
    assert len(manifest(out)) == N
    # The rerun removed the killed process's temporary files: nothing stray remains.
    verify(run, out, kill_input, "--strict")
    assert_untouched(out, done)
    assert_same_as(reference, out)


def test_sigterm_server_during_dump(run, tools, tiny, kill_input, reference, tmp_path):
    out = tmp_path / "out"
    port = free_port()
    server = HsxServer(tools, tiny, "--drain-timeout", "5s", listen=f"127.0.0.1:{port}").start()
    try:
        proc = start_dump(tools, "--server", server.address, "--input", kill_input, "--out", out,
                          "--concurrency", 4)
        wait_for_lines(out, 40, proc)
        server.signal(signal.SIGTERM)  # drains: in-flight samples finish, new ones are refused
        server.proc.wait(30)
        done = snapshot(out)
        assert len(done) < N, "the dump finished before the SIGTERM"
        with HsxServer(tools, tiny, listen=f"127.0.0.1:{port}"):  # back on the same address
            stdout, stderr = proc.communicate(timeout=90)
            # It retried through the restart (or, were the gap longer, failed and left a resumable journal).
            assert proc.returncode == 0 or "UNAVAILABLE" in stderr, stderr
            rerun = run("hsx-dump", "--server", f"127.0.0.1:{port}", "--input", kill_input, "--out", out)
    finally:
        server.kill()
    assert "failed 0" in rerun.stdout and len(manifest(out)) == N, rerun.stdout
    verify(run, out, kill_input, "--strict")
    assert_untouched(out, done)
    assert_same_as(reference, out)


def test_torn_journal_line_and_unjournaled_files(run, tiny, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(12, seed=8))
    out = tmp_path / "out"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, "--concurrency", 1)
    journal = out / "manifest.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    assert [json.loads(l)["index"] for l in lines] == list(range(12))  # concurrency 1: in order
    original = {i: (out / f"hs_{i}.safetensors").read_bytes() for i in range(12)}
    # A crash in the middle of appending sample 9's line, after samples 10 and
    # 11 were renamed into place but never journaled (one of them damaged).
    journal.write_text("".join(lines[:9]) + lines[9][:25])
    (out / "hs_10.safetensors").write_bytes(b"garbage")
    kept = snapshot(out)
    assert len(kept) == 9

    proc = run("hsx-verify", out, "--input", inputs, expect_ok=False)  # samples 9-11 are missing
    assert "torn last line" in proc.stdout and "3 of 12 input samples are not journaled: 9, 10, 11" in proc.stdout
    assert "hs_10.safetensors: warning: not in the journal" in proc.stdout, proc.stdout
    proc = run("hsx-verify", out)  # without --input: incomplete files are warnings only
    assert "warning" in proc.stdout and " 0 errors" in proc.stdout, proc.stdout
    run("hsx-verify", out, "--strict", expect_ok=False)

    proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    assert "removed a torn last line" in proc.stderr, proc.stderr
    assert "wrote 3 samples, skipped 9 already done" in proc.stdout, proc.stdout
    assert sorted(e["index"] for e in manifest(out)) == list(range(12))
    assert journal.read_text().endswith("\n")
    for i in range(12):
        assert (out / f"hs_{i}.safetensors").read_bytes() == original[i], i
    assert_untouched(out, kept)
    verify(run, out, inputs, "--strict")


def test_rerun_skips_finished_samples_without_touching_them(run, tiny, tmp_path):
    """What test_dump_cli's test_existing_output_is_never_overwritten becomes with the journal."""
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(3, seed=9))
    out = tmp_path / "out"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    before = snapshot(out)
    proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    assert "wrote 0 samples, skipped 3 already done, failed 0" in proc.stdout, proc.stdout
    assert_untouched(out, before)


def test_resume_refuses_other_settings(run, tiny, tmp_path):
    rows = sample_rows(4, seed=10)
    inputs = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, "--shard", "0/2",
        "--concurrency", 1)  # samples 0 and 2, in order
    before = snapshot(out)
    journal = (out / "journal" / "shard-0-of-2.jsonl").read_bytes()  # shard 0 of 2 journals on its own

    def refused(*args, message, model=tiny, input_path=inputs):
        proc = run("hsx-dump", "--model", model, "--input", input_path, "--out", out, *args, expect_ok=False)
        assert "cannot resume: " in proc.stderr and message in proc.stderr, proc.stderr
        assert "shard-0-of-2.jsonl:1 (sample 0)" in proc.stderr, proc.stderr

    refused("--capture", "1,2", message="the journal records capture ids [2,4,5,8], this run has [1,2]")
    refused("--dtype", "fp32", message="the journal records dtype bf16, this run has fp32")
    refused("--final-norm", message="the journal records final_norm false, this run has true")
    refused("--precision", "fp32", message="the journal records compute precision bf16, this run has fp32")
    renamed = tmp_path / "other-model"
    shutil.copytree(tiny, renamed)
    refused(model=renamed, message="the journal records model 'model', this run has 'other-model'")
    changed = [dict(r) for r in rows]
    changed[0]["input_ids"] = changed[0]["input_ids"][:-1] + [(changed[0]["input_ids"][-1] + 1) % VOCAB]
    refused(input_path=write_jsonl(tmp_path / "changed.jsonl", changed),
            message="token ids differ from line 1 of the input")
    changed = [dict(r) for r in rows]
    changed[0]["loss_mask"] = [1] * len(changed[0]["input_ids"])
    refused(input_path=write_jsonl(tmp_path / "masked.jsonl", changed),
            message="loss_mask differs from line 1 of the input")
    assert (out / "journal" / "shard-0-of-2.jsonl").read_bytes() == journal
    assert_untouched(out, before)
    # The same settings resume: the other shard completes the directory.
    proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    assert "wrote 2 samples, skipped 2 already done" in proc.stdout, proc.stdout
    assert_untouched(out, before)


def test_verify_finds_damage(run, tiny, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows(5, seed=11))
    good = tmp_path / "good"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", good, "--final-norm")
    proc = verify(run, good, inputs, "--strict")
    assert "5 journaled samples" in proc.stdout

    def damaged(name, change, expect_ok=False):
        d = tmp_path / name
        shutil.copytree(good, d)
        change(d)
        return run("hsx-verify", d, "--input", inputs, expect_ok=expect_ok).stdout

    def flip_last_byte(d):
        path = d / "hs_1.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))

    text = damaged("flipped", flip_last_byte)
    assert "hs_1.safetensors: error: xxh64" in text and "the journal says" in text, text
    assert "data hashes to" in text, text  # the metadata checksum of the damaged tensor too
    text = damaged("deleted", lambda d: (d / "hs_2.safetensors").unlink())
    assert "hs_2.safetensors: error: cannot open" in text, text
    text = damaged("corrupt-journal", lambda d: (d / "manifest.jsonl").write_text(
        "{not json}\n" + (good / "manifest.jsonl").read_text()))
    assert "manifest.jsonl:1: corrupt journal line" in text, text
    other = write_jsonl(tmp_path / "other.jsonl", sample_rows(5, seed=12))
    text = run("hsx-verify", good, "--input", other, expect_ok=False).stdout
    assert "token_ids differ from line 1 of the input" in text, text
    second = (good / "manifest.jsonl").read_text().splitlines()[1]  # line 2 (lines come in completion order)
    index = json.loads(second)["index"]

    def journaled_again(line):
        def change(d):
            (d / "journal").mkdir()
            (d / "journal" / "shard-0-of-2.jsonl").write_text(line + "\n")
        return change

    text = damaged("again-same", journaled_again(second), expect_ok=True)  # a warning
    assert (f"shard-0-of-2.jsonl:1: warning: sample {index} is journaled again (first at {tmp_path}/again-same/"
            "manifest.jsonl:2, identical)") in text, text
    changed = json.dumps({**json.loads(second), "bytes": json.loads(second)["bytes"] + 1})
    text = damaged("again-changed", journaled_again(changed))
    assert (f"shard-0-of-2.jsonl:1: error: sample {index} is journaled again (first at {tmp_path}/again-changed/"
            "manifest.jsonl:2, with different contents)") in text, text
    stray = tmp_path / "stray"
    shutil.copytree(good, stray)
    (stray / "hs_7.safetensors").write_bytes(b"left over")
    assert "warning" in run("hsx-verify", stray, "--input", inputs).stdout
    run("hsx-verify", stray, "--input", inputs, "--strict", expect_ok=False)
