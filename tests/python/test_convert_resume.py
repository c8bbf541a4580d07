"""python -m hsx.convert at scale: killed with SIGKILL mid-run and rerun, it
finishes with OUT byte-identical to an uninterrupted run; --shard I/N processes
sharing OUT give the same files as one process; OUT's own journal is the only
non-empty OUT it accepts; memory stays flat as the dump grows (docs/formats.md)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dump_helpers import sample_rows, write_jsonl
from hsx.convert import IDS_FILE, JOURNAL_DIR, ConvertError, convert, main

# The child converts with torch.save slowed down after writing each file (before the
# rename), so that a SIGKILL lands mid-run; the converter itself has no test hook.
SLOW_CHILD = """
import sys, time, torch, hsx.convert
save = torch.save
def slow(obj, f, *a, **k):
    save(obj, f, *a, **k)
    f.flush()
    time.sleep(0.15)
torch.save = slow
sys.exit(hsx.convert.main(sys.argv[1:]))
"""


def _tree(root):
    """{relative path: sha256} of every file below root."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def dump24(run, tiny, tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    write_jsonl(base / "in.jsonl", sample_rows(24, lo=8, hi=40, seed=3))
    run("hsx-dump", "--model", tiny, "--input", base / "in.jsonl", "--out", base / "dump", "--capture", "eagle3",
        "--final-norm")
    return base


def _journaled(out):
    path = out / JOURNAL_DIR / "journal.0-of-1.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.parametrize("target", ["specforge"])  # rows_* subdirectories; speculators-legacy: the shard tests
def test_kill_9_then_rerun_is_byte_identical(dump24, tmp_path, target):
    reference = tmp_path / "reference"
    assert convert(dump24 / "dump", target, reference) == 24
    out = tmp_path / "out"
    for at in (4, 12):  # two kills, the second further on
        child = subprocess.Popen([sys.executable, "-c", SLOW_CHILD, str(dump24 / "dump"), "--to", target, str(out),
                                  "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while _journaled(out) < at and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.07)  # inside the sleep after a write: a .partial file not yet renamed
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL, child.stderr.read().decode()
        assert not (out / IDS_FILE).exists()  # incomplete: no sample_ids.jsonl
    assert any(".partial" in p.name for p in out.rglob("*"))  # the kill did interrupt a write
    proc = subprocess.run([sys.executable, "-m", "hsx.convert", str(dump24 / "dump"), "--to", target, str(out),
                           "--no-progress"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 24 samples" in proc.stdout
    assert _tree(out) == _tree(reference)  # every file, the journal included; no .partial left
    # A rerun of a complete conversion changes nothing.
    assert convert(dump24 / "dump", target, out) == 24 and _tree(out) == _tree(reference)


def test_shards_share_out_and_the_last_writes_sample_ids(dump24, tmp_path):
    whole = tmp_path / "whole"
    convert(dump24 / "dump", "modelopt", whole)
    out = tmp_path / "sharded"
    counts = []
    for i in (2, 0, 1):
        result = convert(dump24 / "dump", "modelopt", out, shard=(i, 3))
        counts.append(int(result))
        assert result.complete == (i == 1) and (out / IDS_FILE).exists() == (i == 1)
    assert counts == [8, 8, 8]
    data = lambda root: {k: v for k, v in _tree(root).items() if not k.startswith(JOURNAL_DIR)}  # noqa: E731
    assert data(out) == data(whole)  # the same files, bytes and sample_ids.jsonl
    ids = [json.loads(line)["index"] for line in (out / IDS_FILE).read_text().splitlines()]
    assert ids == list(range(24))
    # each shard holds exactly its samples (index % 3 == I)
    for i in range(3):
        lines = (out / JOURNAL_DIR / f"journal.{i}-of-3.jsonl").read_text().splitlines()
        assert [json.loads(x)["index"] for x in lines[1:-1]] == list(range(i, 24, 3))  # header, samples, done


def test_shards_from_their_own_dump_directories(run, tiny, dump24, tmp_path):
    """hsx-dump --shard I/3 --out DIR-I, then hsx.convert DIR-I --shard I/3 OUT: the same files."""
    whole = tmp_path / "whole"
    convert(dump24 / "dump", "speculators-legacy", whole)
    out = tmp_path / "out"
    for i in range(3):
        run("hsx-dump", "--model", tiny, "--input", dump24 / "in.jsonl", "--out", tmp_path / f"d{i}", "--capture",
            "eagle3", "--final-norm", "--shard", f"{i}/3")
        convert(tmp_path / f"d{i}", "speculators-legacy", out, shard=(i, 3))
    data = lambda root: {k: v for k, v in _tree(root).items() if not k.startswith(JOURNAL_DIR)}  # noqa: E731
    assert data(out) == data(whole)
    # a shard resumed from another dump is refused
    with pytest.raises(ConvertError, match="shard 0/3 of .* was begun on another dump"):
        convert(tmp_path / "d1", "speculators-legacy", out, shard=(0, 3))


def test_shard_cli_and_bad_shard(dump24, tmp_path, capsys):
    proc = subprocess.run([sys.executable, "-m", "hsx.convert", str(dump24 / "dump"), "--to", "modelopt",
                           str(tmp_path / "o"), "--shard", "0/2", "--no-progress"], capture_output=True, text=True)
    assert proc.returncode == 0 and "shards 1 are not done yet" in proc.stdout, proc.stdout + proc.stderr
    for bad in ("2/2", "1", "a/b", "0/0"):
        with pytest.raises(SystemExit) as exit_status:
            main([str(dump24 / "dump"), "--to", "modelopt", str(tmp_path / "p"), "--shard", bad])
        assert exit_status.value.code == 2 and f"--shard {bad!r}" in capsys.readouterr().err
        assert not (tmp_path / "p").exists()


def test_out_of_another_conversion_is_refused(dump24, tmp_path):
    out = tmp_path / "out"
    convert(dump24 / "dump", "modelopt", out, shard=(0, 2))
    before = _tree(out)
    with pytest.raises(ConvertError, match="holds another conversion .*differs in to"):
        convert(dump24 / "dump", "speculators-legacy", out, shard=(1, 2))
    with pytest.raises(ConvertError, match="differs in shards"):
        convert(dump24 / "dump", "modelopt", out, shard=(1, 3))
    assert _tree(out) == before


def test_one_shard_at_a_time(dump24, tmp_path):
    import fcntl
    out = tmp_path / "out"
    convert(dump24 / "dump", "modelopt", out, shard=(0, 2))
    with open(out / JOURNAL_DIR / "journal.1-of-2.jsonl", "ab") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running converter of shard 1/2 holds it
        with pytest.raises(ConvertError, match="shard 1/2 is being converted by another process"):
            convert(dump24 / "dump", "modelopt", out, shard=(1, 2))


def test_progress_bar_without_tqdm(dump24, tmp_path):
    """tqdm is optional: without it the conversion runs, without a bar."""
    code = ("import sys; sys.modules['tqdm'] = None\n"
            "from hsx.convert import convert\n"
            f"assert convert({str(dump24 / 'dump')!r}, 'modelopt', {str(tmp_path / 'o')!r}, progress=True) == 24\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _peak_rss_kib(args):
    """Peak RSS of `python -m hsx.convert ARGS` (a fresh child each time)."""
    code = ("import resource, sys, hsx.convert\n"
            "assert hsx.convert.main(sys.argv[1:]) == 0\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


def test_memory_is_flat(run, tiny, tmp_path):
    """Converting 6x the samples (about 33 MB more dump) costs less than 1.5 MB more peak RSS:
    one sample in memory at a time, not the dump."""
    write_jsonl(tmp_path / "in.jsonl", sample_rows(60, lo=256, hi=256, seed=4))
    run("hsx-dump", "--model", tiny, "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d60", "--capture", "all",
        "--final-norm")
    (tmp_path / "d10").mkdir()  # the first 10 samples: the same files, linked, and their journal lines
    lines = [line for line in (tmp_path / "d60" / "manifest.jsonl").read_text().splitlines(keepends=True)
             if json.loads(line)["index"] < 10]
    (tmp_path / "d10" / "manifest.jsonl").write_text("".join(lines))
    for line in lines:
        name = json.loads(line)["file"]
        os.link(tmp_path / "d60" / name, tmp_path / "d10" / name)
    rss = {n: _peak_rss_kib([tmp_path / f"d{n}", "--to", "speculators-legacy", tmp_path / f"o{n}", "--no-progress"])
           for n in (10, 60)}
    grown = sum(p.stat().st_size for p in (tmp_path / "d60").glob("hs_*")) - sum(
        p.stat().st_size for p in (tmp_path / "d10").glob("hs_*"))
    assert grown > 5_000_000
    assert rss[60] - rss[10] < 1536, (rss, grown)
