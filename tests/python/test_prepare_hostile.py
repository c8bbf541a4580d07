"""hsx.prepare against hostile input: each case runs `python -m hsx.prepare` as a process of its own
under an address-space ceiling (RLIMIT_AS) and a time limit, and checks the exact message (a
FILE:LINE error or a reported skip, never a traceback) and that no temporary file is left behind.

  a line far over --max-line-bytes   refused without being read whole (peak RSS measured)
  a conversation of many turns       skipped over --max-turns (an error under --strict)
  a template that never ends         skipped after --max-seconds-per-conversation
  100,000-deep JSON, a lone surrogate, an integer id hsx-dump cannot read: FILE:LINE errors
  a full disk (a 3 MiB tmpfs)        an error naming the file; a rerun after freeing space resumes
  a long line of another --shard     read in pieces and hashed: a rerun resumes exactly

Mutations these caught (2026-12-03): no surrogate check (a traceback), readline() unbounded (the
Rust tokenizer aborts under the ceiling), no temporary-file cleanup, another shard's long line not
hashed (the rerun refuses the input).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prepare_helpers import model_dir, read_jsonl, write_jsonl

AS_LIMIT = 9 << 29  # 4.5 GiB: transformers imports torch, which maps 3.3 GiB at rest (VmPeak, measured)
TIMEOUT_S = 120
GOOD = {"id": "good", "messages": [{"role": "user", "content": "Hello there, how are you?"},
                                   {"role": "assistant", "content": "Fine, thanks. And you?"}]}

# Runs argv[1:] under RLIMIT_AS and prints its peak RSS in KiB (a small process of its own: a child
# forked from pytest would start from pytest's RSS).
LIMITED = """
import os, resource, sys
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
print(f"peak_rss_kib={usage.ru_maxrss}", file=sys.stderr)
sys.exit(os.waitstatus_to_exitcode(status))
"""


class Ran:
    def __init__(self, code, stderr, peak_mib, seconds):
        self.code, self.stderr, self.peak_mib, self.seconds = code, stderr, peak_mib, seconds


def run(*args, timeout=TIMEOUT_S) -> Ran:
    cmd = [sys.executable, "-S", "-c", LIMITED, str(AS_LIMIT), sys.executable, "-m", "hsx.prepare",
           *map(str, args), "--no-progress"]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    lines = proc.stderr.splitlines()
    peak = [int(line.split("=")[1]) / 1024 for line in lines if line.startswith("peak_rss_kib=")]
    rest = "\n".join(line for line in lines if not line.startswith("peak_rss_kib="))
    assert "Traceback" not in rest, rest
    return Ran(proc.returncode, rest, peak[-1] if peak else float("nan"), time.monotonic() - start)


def error_of(ran: Ran) -> str:
    assert ran.code == 1, f"exit {ran.code}: {ran.stderr}"
    assert ran.stderr.startswith("hsx.prepare: error: "), ran.stderr
    return ran.stderr[len("hsx.prepare: error: "):].strip()


def no_temporaries(directory: Path):
    left = [p.name for p in Path(directory).iterdir() if ".tmp." in p.name]
    assert not left, f"temporary files left behind: {left}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("hostile-model"), "kimi-k2-instruct")


def test_a_line_over_the_limit_is_refused_without_being_read_whole(model, tmp_path):
    source = tmp_path / "in.jsonl"
    size = 96 << 20  # 96 MiB: read whole, decoded and tokenized it would take gigabytes
    with open(source, "w", encoding="ascii") as f:
        f.write(json.dumps(GOOD) + "\n")
        head = '{"id": "huge", "messages": [{"role": "user", "content": "'
        tail = '"}, {"role": "assistant", "content": "ok"}]}'
        f.write(head)
        block = "abcdefgh" * (1 << 17)
        left = size - len(head) - len(tail)
        while left > 0:
            f.write(block[:left])
            left -= len(block)
        f.write(tail + "\n")
    out = tmp_path / "out.jsonl"
    ran = run("--model", model, "--input", source, "--output", out)
    assert error_of(ran) == f"{source}:2: {size} bytes, over --max-line-bytes {8 << 20}"
    no_temporaries(tmp_path)
    small = write_jsonl(tmp_path / "small.jsonl", [GOOD])
    base = run("--model", model, "--input", small, "--output", tmp_path / "small-out.jsonl")
    print(f"peak RSS refusing a {size >> 20} MiB line: {ran.peak_mib:.0f} MiB; one small line: {base.peak_mib:.0f} MiB")
    # at most the 8 MiB the limit lets through and a piece of the rest; the line read whole adds 96+
    assert ran.peak_mib - base.peak_mib < 40, (ran.peak_mib, base.peak_mib)
    # the line before it is kept: a rerun after removing the bad line resumes from line 2
    write_jsonl(source, [GOOD])
    assert run("--model", model, "--input", source, "--output", out).code == 0
    assert [r["id"] for r in read_jsonl(out)] == ["good"]


def test_the_line_limit_is_a_flag_and_counts_bytes_before_the_newline(model, tmp_path):
    line = json.dumps(GOOD)
    source = write_jsonl(tmp_path / "in.jsonl", [line])
    out = tmp_path / "out.jsonl"
    ran = run("--model", model, "--input", source, "--output", out, "--max-line-bytes", len(line) - 1)
    assert error_of(ran) == f"{source}:1: {len(line)} bytes, over --max-line-bytes {len(line) - 1}"
    for path in tmp_path.glob("out.jsonl*"):
        path.unlink()
    assert run("--model", model, "--input", source, "--output", out, "--max-line-bytes", len(line)).code == 0
    no_temporaries(tmp_path)


def _many_turns(n):
    messages = []
    for i in range(n // 2):
        messages += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    return {"id": "long", "messages": messages}


def test_a_conversation_over_max_turns_is_skipped_and_reported(model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [_many_turns(3000), GOOD])
    out = tmp_path / "out.jsonl"
    ran = run("--model", model, "--input", source, "--output", out)
    assert ran.code == 0, ran.stderr
    assert ran.seconds < 60, ran.seconds  # not rendered: 3000 turns would take minutes
    assert [r["id"] for r in read_jsonl(out)] == ["good"]
    assert read_jsonl(f"{out}.report.jsonl") == [
        {"line": 1, "id": "long", "action": "skipped", "reason": "over --max-turns",
         "detail": "3000 messages, over --max-turns 1024"}]
    assert "1 skipped (over --max-turns)" in ran.stderr
    strict = run("--model", model, "--input", source, "--output", tmp_path / "strict.jsonl", "--strict",
                 "--max-turns", 10)
    assert error_of(strict) == f"{source}:1: 3000 messages, over --max-turns 10 (--strict)"
    no_temporaries(tmp_path)


SLOW_TEMPLATE = ("{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}"
                 "{% endfor %}{% endfor %}{{ m['content'] }}{% endfor %}")


def test_a_template_that_never_ends_is_stopped_per_conversation(model, tmp_path):
    template = tmp_path / "slow.jinja"
    template.write_text(SLOW_TEMPLATE)
    source = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    out = tmp_path / "out.jsonl"
    ran = run("--model", model, "--input", source, "--output", out, "--chat-template", template,
              "--max-seconds-per-conversation", 2)
    assert ran.code == 0, ran.stderr
    assert ran.seconds < 60, ran.seconds
    assert read_jsonl(f"{out}.report.jsonl") == [
        {"line": 1, "id": "good", "action": "skipped", "reason": "over --max-seconds-per-conversation",
         "detail": "not rendered and tokenized within --max-seconds-per-conversation 2"}]
    strict = run("--model", model, "--input", source, "--output", tmp_path / "strict.jsonl", "--chat-template",
                 template, "--max-seconds-per-conversation", 1, "--strict")
    assert error_of(strict) == (f"{source}:1: not rendered and tokenized within --max-seconds-per-conversation 1 "
                                "(--strict)")
    no_temporaries(tmp_path)


@pytest.mark.parametrize("line, message", [
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply to read"),
    ('{"id": 1, "messages": [{"role": "user", "content": "a\\ud800b"}, {"role": "assistant", "content": "x"}]}',
     "messages[0].content: a lone surrogate (\\ud800), not a character: not Unicode text"),
    ('{"id": "\\udfff", "prompt": "p", "response": "r"}',
     "id: a lone surrogate (\\udfff), not a character: not Unicode text"),
    ('{"id": 9223372036854775808, "prompt": "p", "response": "r"}',
     '"id" 9223372036854775808 is outside the 64-bit signed integers hsx-dump reads; write it as a string'),
    ('{"id": -9223372036854775809, "prompt": "p", "response": "r"}',
     '"id" -9223372036854775809 is outside the 64-bit signed integers hsx-dump reads; write it as a string'),
    ('{"id": ' + "9" * 5000 + ', "prompt": "p", "response": "r"}',
     "not valid JSON (Exceeds the limit (4300 digits) for integer string conversion)"),
], ids=["deep-json", "lone-surrogate", "surrogate-id", "id-over-int64", "id-under-int64", "5000-digit-id"])
def test_malformed_lines_are_file_line_errors(model, tmp_path, line, message):
    source = write_jsonl(tmp_path / "in.jsonl", [GOOD, line])
    out = tmp_path / "out.jsonl"
    assert error_of(run("--model", model, "--input", source, "--output", out)) == f"{source}:2: {message}"
    no_temporaries(tmp_path)


def test_int64_ids_at_the_bounds_are_kept(model, tmp_path):
    lines = [{"id": 2**63 - 1, "prompt": "p", "response": "r"}, {"id": -2**63, "prompt": "q", "response": "s"}]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert run("--model", model, "--input", source, "--output", out).code == 0
    assert [r["id"] for r in read_jsonl(out)] == [2**63 - 1, -2**63]


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        print(f"mount refused: {mounted.stderr.strip()}")
        pytest.skip(f"cannot mount a 3 MiB tmpfs ({mounted.stderr.strip() or mounted.returncode})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def _conversations(n):
    words = "the of and to in is that for it as was with be by on not café naïve".split()
    rows = []
    for i in range(n):
        text = " ".join(words[(i + j) % len(words)] for j in range(200))
        rows.append({"id": i, "messages": [{"role": "user", "content": f"q{i}"},
                                           {"role": "assistant", "content": text}]})
    return rows


def test_a_full_disk_is_an_error_naming_the_file_and_a_rerun_resumes(model, tmp_path, small_disk):
    source = write_jsonl(tmp_path / "in.jsonl", _conversations(1200))  # ~4 MiB of output
    reference = tmp_path / "reference.jsonl"
    assert run("--model", model, "--input", source, "--output", reference, "--checkpoint-every", 100).code == 0
    assert reference.stat().st_size > (3 << 20) + (512 << 10)  # over the 3 MiB disk
    out = small_disk / "out.jsonl"
    ran = run("--model", model, "--input", source, "--output", out, "--checkpoint-every", 100)
    message = error_of(ran)
    assert message.startswith(f"{small_disk}/out.jsonl"), message
    assert f": no space left on device (after {source}:" in message, message
    assert message.endswith("; the work up to the last checkpoint is kept: free space and rerun the same "
                            "command to continue"), message
    no_temporaries(small_disk)
    # free space (the files moved to a larger disk) and rerun: the output is the uninterrupted run's
    moved = tmp_path / "moved"
    moved.mkdir()
    for path in small_disk.iterdir():  # the journal names the input, not the output's directory
        (moved / path.name).write_bytes(path.read_bytes())
    assert run("--model", model, "--input", source, "--output", moved / "out.jsonl",
               "--checkpoint-every", 100).code == 0
    assert (moved / "out.jsonl").read_bytes() == reference.read_bytes()
    assert (moved / "out.jsonl.report.jsonl").read_bytes() == Path(f"{reference}.report.jsonl").read_bytes()
    no_temporaries(moved)


def test_a_failed_journal_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    import errno

    from hsx.prepare import run as run_module

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_module.os, "fsync", full)
    target = tmp_path / "out.jsonl.prepare-state.json"
    with pytest.raises(run_module.DiskError) as raised:
        run_module._write_atomic(target, "{}")
    assert str(raised.value) == f"{target}: no space left on device"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_long_line_of_another_shard_is_passed_over_and_a_rerun_resumes_exactly(model, tmp_path):
    long_line = json.dumps({"id": "long", "prompt": "x" * 5000, "response": "y"})
    lines = [GOOD, long_line, {**GOOD, "id": "third"}, long_line, "not json"]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    flags = ("--shard", "0/2", "--max-line-bytes", 1000, "--checkpoint-every", 1)
    assert error_of(run("--model", model, "--input", source, "--output", out, *flags)).startswith(
        f"{source}:5: not valid JSON")
    state = json.loads(Path(f"{out}.prepare-state.json").read_text())
    assert state["input_line"] == 4  # the long lines of shard 1 were read (in pieces) and hashed
    lines[-1] = {**GOOD, "id": "fifth"}
    write_jsonl(source, lines)
    assert run("--model", model, "--input", source, "--output", out, *flags).code == 0
    reference = tmp_path / "reference.jsonl"
    assert run("--model", model, "--input", source, "--output", reference, *flags).code == 0
    assert out.read_bytes() == reference.read_bytes()
    assert [r["id"] for r in read_jsonl(out)] == ["good", "third", "fifth"]
    mine = run("--model", model, "--input", source, "--output", tmp_path / "odd.jsonl", "--shard", "1/2",
               "--max-line-bytes", 1000)
    assert error_of(mine) == f"{source}:2: {len(long_line)} bytes, over --max-line-bytes 1000"
    no_temporaries(tmp_path)
