"""python -m hsx.convert with hostile sample ids and hostile journals: files are
named by sample index, ids only ever land in OUT/sample_ids.jsonl, nothing is
written outside OUT, no sample overwrites another, and a bad journal or a
non-empty OUT is a clear error with nothing written. Resuming after kill -9,
--shard and flat memory: test_convert_resume.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

import hsx
from hsx.convert import IDS_FILE, ConvertError, convert

FORMATS = ("specforge", "modelopt", "speculators-legacy")
LONG_ID = "x" * 1000  # longer than any file name may be (NAME_MAX 255)
# (input "id" field or None for no id) -> the id the dump records (hsx-dump names a sample
# without an id by its index: sample 2 gets "2", the same as the next sample's explicit id)
HOSTILE = [("dup", "dup"), ("dup", "dup"), (None, "2"), ("2", "2"), (7, "7"), ("a/b", "a/b"),
           ("../escaped", "../escaped"), ("/tmp/hsx-absolute", "/tmp/hsx-absolute"), ("a\0b", "a\0b"),
           ("..", ".."), ("", "10"), (LONG_ID, LONG_ID)]  # "" is "no id" too


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def hostile_dump(run, tiny, tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    rows = []
    for i, (sample_id, _) in enumerate(HOSTILE):
        row = {"input_ids": [(i * 37 + j) % 2048 for j in range(3 + i)], "loss_mask": [j % 2 for j in range(3 + i)]}
        if sample_id is not None:
            row["id"] = sample_id
        rows.append(row)
    (base / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run("hsx-dump", "--model", tiny, "--input", base / "in.jsonl", "--out", base / "dump", "--capture", "eagle3",
        "--final-norm")
    return base, rows


def _expected_name(target, i):
    return {"specforge": f"rows_0-2000/data_{i}.ckpt", "modelopt": f"data_{i}.pt",
            "speculators-legacy": f"data_{i}.pt"}[target]


@pytest.mark.parametrize("target", FORMATS)
def test_hostile_ids_one_file_per_sample_named_by_index(hostile_dump, target):
    base, rows = hostile_dump
    out = base / "work" / target / "out"
    before = _files(base) 
    assert convert(base / "dump", target, out) == len(HOSTILE)
    # Nothing appeared outside OUT (not ../escaped, not a/b beside it, no leftover staging directory).
    after = [f for f in _files(base) if not f.startswith(f"work/{target}/out/")]
    assert after == before
    assert not os.path.exists("/tmp/hsx-absolute.pt") and not os.path.exists("/tmp/hsx-absolute")
    names = [_expected_name(target, i) for i in range(len(HOSTILE))]
    extra = {"speculators-legacy": ["data_config.json", "sample_lengths.json"]}.get(target, [])
    journal = [".hsx-convert/journal.0-of-1.jsonl", ".hsx-convert/lock", ".hsx-convert/run.json"]
    assert _files(out) == sorted(names + extra + journal + [IDS_FILE])
    ids = [json.loads(line) for line in (out / IDS_FILE).read_text().splitlines()]
    assert [e["index"] for e in ids] == list(range(len(HOSTILE)))
    assert [e["file"] for e in ids] == names
    assert [e["id"] for e in ids] == [want for _, want in HOSTILE]  # verbatim, NUL and all
    if target == "speculators-legacy":  # the side files count and measure every sample
        assert json.loads((out / "data_config.json").read_text())["num_samples"] == len(HOSTILE)
        lengths = json.loads((out / "sample_lengths.json").read_text())
        assert lengths == {str(i): len(row["input_ids"]) for i, row in enumerate(rows)}
    # every file holds its own sample: the two "dup" samples and index 2 vs id "2" did not collide
    for i, row in enumerate(rows):
        record = torch.load(out / names[i], weights_only=True)
        assert record["input_ids"].tolist() == row["input_ids"]
        if target == "modelopt":
            assert record["conversation_id"] == HOSTILE[i][1]


def test_cli_reports_count_and_side_file(hostile_dump):
    base, _ = hostile_dump
    proc = subprocess.run([sys.executable, "-m", "hsx.convert", str(base / "dump"), "--to", "modelopt",
                           str(base / "cli-out")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {len(HOSTILE)} samples" in proc.stdout


@pytest.mark.parametrize("target", FORMATS)
def test_non_empty_out_is_refused_and_untouched(hostile_dump, target):
    base, _ = hostile_dump
    out = base / f"busy-{target}"
    out.mkdir()
    (out / "data_0.pt").write_text("someone else's")
    with pytest.raises(ConvertError, match="not empty"):
        convert(base / "dump", target, out)
    assert _files(out) == ["data_0.pt"] and (out / "data_0.pt").read_text() == "someone else's"
    proc = subprocess.run([sys.executable, "-m", "hsx.convert", str(base / "dump"), "--to", target, str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "not empty" in proc.stderr and "wrote" not in proc.stdout


def _copy_dump(src, dst, manifest_lines):
    dst.mkdir()
    for p in src.iterdir():
        if p.name != "manifest.jsonl" and p.is_file():  # not status/ (dump_dir.h)
            os.link(p, dst / p.name)
    (dst / "manifest.jsonl").write_text("".join(json.dumps(e) + "\n" for e in manifest_lines))


@pytest.mark.parametrize("change, message", [
    (lambda e, first: e.update(file="../hs_0.safetensors"), "plain file name"),
    (lambda e, first: e.update(file="/etc/passwd"), "plain file name"),
    (lambda e, first: e.update(file="sub/hs_0.safetensors"), "plain file name"),
    (lambda e, first: e.update(file="hs_0.safetensors\0x"), "plain file name"),
    (lambda e, first: e.update(index=-1), "non-negative integer"),
    (lambda e, first: e.update(index="1"), "non-negative integer"),
    # the first line's index, whichever sample finished first (the journal is in completion order)
    (lambda e, first: e.update(index=first["index"]), "journaled twice"),
])
def test_hostile_journal_is_an_error_and_nothing_is_written(hostile_dump, tmp_path, change, message):
    base, _ = hostile_dump
    lines = [json.loads(line) for line in (base / "dump" / "manifest.jsonl").read_text().splitlines()]
    change(lines[1], lines[0])
    _copy_dump(base / "dump", tmp_path / "dump", lines)
    with pytest.raises(ConvertError, match=message) as error:
        convert(tmp_path / "dump", "modelopt", tmp_path / "out")
    assert "manifest.jsonl:2" in str(error.value)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["dump"]  # no staging directory left behind


def test_failure_midway_leaves_nothing(run, tiny, tmp_path):
    """SpecForge needs --final-norm: the error comes at the first sample; OUT never appears."""
    (tmp_path / "in.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    run("hsx-dump", "--model", tiny, "--input", tmp_path / "in.jsonl", "--out", tmp_path / "dump")
    with pytest.raises(ConvertError, match="--final-norm"):
        convert(tmp_path / "dump", "specforge", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump", "in.jsonl"]


# --- The journal's rules (docs/formats.md), as hsx-dump and hsx-verify apply them.

def _dump_with_journal(hostile_dump, tmp_path, text):
    base, _ = hostile_dump
    dst = tmp_path / "dump"
    _copy_dump(base / "dump", dst, [])
    (dst / "manifest.jsonl").write_text(text)
    return dst


def _journal_lines(hostile_dump):
    base, _ = hostile_dump
    return (base / "dump" / "manifest.jsonl").read_text().splitlines(keepends=True)


def test_only_a_torn_last_line_is_skipped(hostile_dump, tmp_path):
    lines = _journal_lines(hostile_dump)
    torn = "".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2]  # an append cut short: no newline
    dump = _dump_with_journal(hostile_dump, tmp_path, torn)
    assert convert(dump, "modelopt", tmp_path / "out") == len(lines) - 1
    skipped = json.loads(lines[-1])["index"]
    assert not (tmp_path / "out" / f"data_{skipped}.pt").exists()


@pytest.mark.parametrize("where", ["middle", "last"])
def test_a_corrupt_complete_line_is_an_error(hostile_dump, tmp_path, where):
    lines = _journal_lines(hostile_dump)
    at = 2 if where == "middle" else len(lines) - 1
    lines[at] = lines[at][: len(lines[at]) // 2] + "\n"  # cut, but terminated: not a torn append
    dump = _dump_with_journal(hostile_dump, tmp_path, "".join(lines))
    with pytest.raises(ConvertError, match=f"manifest.jsonl:{at + 1}: corrupt journal line"):
        convert(dump, "modelopt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_line_missing_a_field_is_an_error(hostile_dump, tmp_path):
    lines = [json.loads(line) for line in _journal_lines(hostile_dump)]
    del lines[3]["xxh64"]
    dump = _dump_with_journal(hostile_dump, tmp_path, "".join(json.dumps(e) + "\n" for e in lines))
    with pytest.raises(ConvertError, match="manifest.jsonl:4: corrupt journal line \\('xxh64' missing"):
        convert(dump, "modelopt", tmp_path / "out")


def test_no_journal_means_nothing_is_complete(hostile_dump, tmp_path):
    dump = _dump_with_journal(hostile_dump, tmp_path, "")
    (dump / "manifest.jsonl").unlink()  # the hs_*.safetensors files are all there
    with pytest.raises(ConvertError, match="manifest.jsonl: missing, so nothing in .* is complete"):
        convert(dump, "modelopt", tmp_path / "out")
    proc = subprocess.run([sys.executable, "-m", "hsx.convert", str(dump), "--to", "modelopt", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "hsx.convert: error: " in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_an_identical_second_line_is_journaled_twice(hostile_dump, tmp_path):
    lines = _journal_lines(hostile_dump)
    dump = _dump_with_journal(hostile_dump, tmp_path, "".join(lines) + lines[0])
    with pytest.raises(ConvertError, match=f"manifest.jsonl:{len(lines) + 1}: index .* is journaled twice"):
        convert(dump, "modelopt", tmp_path / "out")


def test_a_redo_supersedes_its_line(hostile_dump, tmp_path):
    lines = _journal_lines(hostile_dump)
    redo = dict(json.loads(lines[4]), supersedes=5)
    dump = _dump_with_journal(hostile_dump, tmp_path, "".join(lines) + json.dumps(redo) + "\n")
    assert convert(dump, "modelopt", tmp_path / "out") == len(lines)
    wrong = dict(redo, supersedes=4)  # line 4 is another sample's
    dump2 = tmp_path / "again"
    dump.rename(dump2)
    (dump2 / "manifest.jsonl").write_text("".join(lines) + json.dumps(wrong) + "\n")
    with pytest.raises(ConvertError, match=f"supersedes line 4, which is not sample {redo['index']}'s current entry"):
        convert(dump2, "modelopt", tmp_path / "out2")


def test_a_damaged_file_is_an_error(hostile_dump, tmp_path):
    lines = _journal_lines(hostile_dump)
    dump = _dump_with_journal(hostile_dump, tmp_path, "".join(lines))
    victim = dump / json.loads(lines[1])["file"]
    data = victim.read_bytes()
    victim.unlink()  # a hard link: replace it, do not write through it
    victim.write_bytes(data[:100])
    with pytest.raises(ConvertError, match="100 bytes, .*manifest.jsonl:2 says"):
        convert(dump, "modelopt", tmp_path / "out")
