"""A full disk (and any other failed write, fsync or rename) in python -m hsx.convert and
python -m hsx.vocab: one error line naming the path, the strerror ("no space left on
device"), what was kept and that a rerun of the same command resumes (convert) or
rewrites the mapping (vocab); exit status 1, no traceback, no temporary left behind.
One test per tool fills a real 3 MiB tmpfs (skipped, with the reason, where mounting is
not permitted); the others make os.fsync or os.replace fail in-process."""

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from dump_helpers import sample_rows, write_jsonl
from hsx.convert import IDS_FILE, JOURNAL_DIR, convert
from hsx.convert import main as convert_main
from hsx.vocab import FORMAT_TAG
from hsx.vocab import main as vocab_main


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs mounted for the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot make a small file system to fill")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (not permitted here?): {proc.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def _fill(disk, leave):
    """Fills `disk` until about `leave` bytes are free; returns the filler file."""
    stat = os.statvfs(disk)
    filler = disk / "filler"
    filler.write_bytes(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave))
    return filler


def _temporaries(root):
    return [str(p) for p in root.rglob("*") if ".partial" in p.name or ".tmp." in p.name]


def _tree(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "filler"}


def _one_error_line(stderr, prefix):
    assert "Traceback" not in stderr, stderr
    assert stderr.startswith(prefix) and stderr.count("\n") == 1, stderr
    return stderr


def _failing(monkeypatch, name, error, when):
    """Makes os.<name> raise OSError(error) when when(path of its first argument) is true."""
    real = getattr(os, name)

    def fake(first, *args, **kwargs):
        path = os.readlink(f"/proc/self/fd/{first}") if isinstance(first, int) else os.fspath(first)
        if when(path):
            raise OSError(error, os.strerror(error))
        return real(first, *args, **kwargs)
    monkeypatch.setattr(os, name, fake)


# --- hsx.vocab

def _freq(path, vocab_size):
    counts = [[t, 1000 - t] for t in range(0, 1000, 7)]
    path.write_text(json.dumps({"format": FORMAT_TAG, "vocab_size": vocab_size, "scope": "assistant", "samples": 1,
                                "tokens": sum(c for _, c in counts), "counts": counts}))
    return path


def _vocab_cli(*args):
    return subprocess.run([sys.executable, "-m", "hsx.vocab", *map(str, args)], capture_output=True, text=True)


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_vocab_on_a_full_tmpfs(small_disk, tmp_path, fmt):
    """2M-token vocabulary: t2d alone is 2 MB; d2t (100,000 ids) 800 kB fits, t2d does not."""
    freq = _freq(tmp_path / "f.json", 2_000_000)
    _fill(small_disk, 1_100_000)
    out = small_disk / ("mapping" if fmt == "speculators" else "vocab_mapping.pt")
    proc = _vocab_cli("--frequencies", freq, "--draft-vocab-size", 100_000, "--format", fmt, "--out", out)
    assert proc.returncode == 1
    failed = out / "t2d-100000.npy" if fmt == "speculators" else out
    err = _one_error_line(proc.stderr, f"hsx.vocab: {failed}: no space left on device")
    assert "no mapping was written" in err and "rerun the same command" in err
    assert _temporaries(small_disk) == []
    left = sorted(p.name for p in small_disk.rglob("*") if p.is_file())
    assert left == ["filler"]


def test_vocab_fsync_failing_leaves_the_previous_mapping(tmp_path, monkeypatch, capsys):
    freq = _freq(tmp_path / "f.json", 4096)
    out = tmp_path / "d2t.pt"
    out.write_bytes(b"the previous mapping")
    _failing(monkeypatch, "fsync", errno.ENOSPC, lambda path: ".d2t.pt." in path)
    assert vocab_main(["--frequencies", str(freq), "--draft-vocab-size", "64", "--format", "modelopt", "--out",
                       str(out)]) == 1
    err = _one_error_line(capsys.readouterr().err, f"hsx.vocab: {out}: no space left on device")
    assert f"the previous mapping ({out}) is unchanged" in err and "rerun the same command" in err
    assert out.read_bytes() == b"the previous mapping" and _temporaries(tmp_path) == []


def test_vocab_rename_failing_says_which_file_was_replaced(tmp_path, monkeypatch, capsys):
    freq = _freq(tmp_path / "f.json", 4096)
    out = tmp_path / "mapping"
    _failing(monkeypatch, "replace", errno.EIO, lambda path: ".t2d-64.npy." in path)
    assert vocab_main(["--frequencies", str(freq), "--draft-vocab-size", "64", "--format", "speculators", "--out",
                       str(out)]) == 1
    err = _one_error_line(capsys.readouterr().err, f"hsx.vocab: {out / 't2d-64.npy'}: input/output error")
    assert f"{out / 'd2t-64.npy'} was replaced but {out / 't2d-64.npy'} was not" in err
    assert "rerun the same command" in err and _temporaries(tmp_path) == []


# --- hsx.convert

@pytest.fixture(scope="module")
def dump24(run, tiny, tmp_path_factory):
    """24 samples of 30..40 tokens and the modelopt and specforge conversions of them (references)."""
    base = tmp_path_factory.mktemp("full")
    write_jsonl(base / "in.jsonl", sample_rows(24, lo=30, hi=40, seed=5))
    run("hsx-dump", "--model", tiny, "--input", base / "in.jsonl", "--out", base / "dump", "--capture", "eagle3",
        "--final-norm")
    for target in ("modelopt", "specforge"):
        convert(base / "dump", target, base / target)
    return base


def _convert_cli(dump, target, out):
    return subprocess.run([sys.executable, "-m", "hsx.convert", str(dump), "--to", target, str(out),
                           "--no-progress"], capture_output=True, text=True)


def test_convert_on_a_full_tmpfs_then_resume(dump24, small_disk):
    filler = _fill(small_disk, 300_000)
    out = small_disk / "out"
    proc = _convert_cli(dump24 / "dump", "modelopt", out)
    assert proc.returncode == 1
    err = _one_error_line(proc.stderr, f"hsx.convert: error: {out}/")
    assert ": no space left on device" in err and "converted and journaled are kept" in err, err
    assert "rerun the same command: it resumes" in err
    assert _temporaries(out) == [] and not (out / IDS_FILE).exists()
    assert 0 < len(list(out.glob("data_*.pt"))) < 24
    filler.unlink()
    proc = _convert_cli(dump24 / "dump", "modelopt", out)
    assert proc.returncode == 0 and "wrote 24 samples" in proc.stdout, proc.stderr
    assert _tree(out) == _tree(dump24 / "modelopt")


@pytest.mark.parametrize("call, error, where, message, kept", [
    ("fsync", errno.ENOSPC, ".data_5.ckpt.partial", "rows_0-2000/data_5.ckpt: no space left on device",
     "samples 0..4 converted and journaled are kept"),
    ("replace", errno.EIO, ".data_3.ckpt.partial", "rows_0-2000/data_3.ckpt: input/output error",
     "samples 0..2 converted and journaled are kept"),
    ("fsync", errno.EDQUOT, f"{IDS_FILE}.partial", f"{IDS_FILE}: disk quota exceeded",
     f"all 24 samples converted and journaled are kept; {IDS_FILE}, which marks"),
])
def test_convert_write_failures_then_resume(dump24, tmp_path, monkeypatch, capsys, call, error, where, message,
                                            kept):
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        _failing(patch, call, error, lambda path: path.endswith(where))
        assert convert_main([str(dump24 / "dump"), "--to", "specforge", str(out), "--no-progress"]) == 1
    err = _one_error_line(capsys.readouterr().err, f"hsx.convert: error: {out}/{message}")
    assert kept in err and "rerun the same command: it resumes" in err, err
    assert _temporaries(out) == [] and not (out / IDS_FILE).exists()
    assert convert_main([str(dump24 / "dump"), "--to", "specforge", str(out), "--no-progress"]) == 0
    assert _tree(out) == _tree(dump24 / "specforge")


def test_convert_journal_append_failing_then_resume(dump24, tmp_path, monkeypatch, capsys):
    """The journal's fsync fails at its 4th line (the header, samples 0 and 1 before it)."""
    out = tmp_path / "out"
    journal = f"{JOURNAL_DIR}/journal.0-of-1.jsonl"
    calls = []

    def fourth_journal_fsync(path):
        if path.endswith(journal):
            calls.append(path)
        return path.endswith(journal) and len(calls) == 4
    with monkeypatch.context() as patch:
        _failing(patch, "fsync", errno.ENOSPC, fourth_journal_fsync)
        assert convert_main([str(dump24 / "dump"), "--to", "modelopt", str(out), "--no-progress"]) == 1
    err = _one_error_line(capsys.readouterr().err, f"hsx.convert: error: {out / journal}: no space left on device")
    assert "samples 0..1 converted and journaled are kept" in err and "rerun the same command: it resumes" in err
    assert convert_main([str(dump24 / "dump"), "--to", "modelopt", str(out), "--no-progress"]) == 0
    assert _tree(out) == _tree(dump24 / "modelopt")
