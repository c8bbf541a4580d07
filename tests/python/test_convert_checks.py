"""python -m hsx.convert checks every file against its journal entry before converting
it, as hsx-verify does: a journal whose entries name each other's files, a file swapped
on disk, a tampered token id, a file whose metadata names another index, a byte changed
anywhere (the file's XXH64) are errors naming the journal line, the sample's index and
id, and the file with what it holds; nothing is written for that sample, what earlier
samples wrote stays and the same command resumes once the dump is repaired."""

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import xxhash

from dump_helpers import write_jsonl
from hsx.convert import IDS_FILE, ConvertError, convert

# Equal lengths and ids of equal length: every file has the same size, so swapping two
# passes the journal's size check.
ROWS = [{"input_ids": [(i * 31 + j) % 2048 for j in range(6)], "loss_mask": [j % 2 for j in range(6)],
         "id": f"u{i + 1}"} for i in range(4)]


@pytest.fixture(scope="module")
def dump4(run, tiny, tmp_path_factory):
    base = tmp_path_factory.mktemp("checks")
    write_jsonl(base / "in.jsonl", ROWS)
    run("hsx-dump", "--model", tiny, "--input", base / "in.jsonl", "--out", base / "dump", "--capture", "eagle3",
        "--final-norm")
    sizes = {p.stat().st_size for p in (base / "dump").glob("hs_*.safetensors")}
    assert len(sizes) == 1, sizes  # the premise of the swaps below
    return base / "dump"


def _copy(dump, dst):
    """A private copy of the dump (files copied, not linked: the tests change them)."""
    shutil.copytree(dump, dst, ignore=shutil.ignore_patterns("status", ".hsx-run.*"))
    return dst


def _lines(dump):
    return [json.loads(line) for line in (dump / "manifest.jsonl").read_text().splitlines()]


def _line_of(dump, index):
    """The journal line number (1-based) of sample `index`."""
    return next(n for n, e in enumerate(_lines(dump), start=1) if e["index"] == index)


def _write_lines(dump, lines):
    (dump / "manifest.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))


def _cli(dump, out):
    return subprocess.run([sys.executable, "-m", "hsx.convert", str(dump), "--to", "modelopt", str(out),
                           "--no-progress"], capture_output=True, text=True)


def _tensor_offset(path, name):
    """(absolute offset, byte count) of tensor `name`'s data in a safetensors file."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8:8 + length])[name]["data_offsets"]
    return 8 + length + begin, end - begin


def _patch(path, offset, new):
    data = bytearray(path.read_bytes())
    data[offset:offset + len(new)] = new
    path.write_bytes(bytes(data))


def _assert_nothing_for(out, index):
    assert not (out / f"data_{index}.pt").exists() and not (out / IDS_FILE).exists()
    if out.exists():
        assert not [p for p in out.rglob("*") if ".partial" in p.name or ".tmp." in p.name]


def test_entries_naming_each_others_files_are_refused(dump4, tmp_path):
    """The adversarial run of issue 45: entries 0 and 1 swap file (and digest); sizes are equal."""
    dump = _copy(dump4, tmp_path / "dump")
    lines = _lines(dump)
    a, b = (next(e for e in lines if e["index"] == i) for i in (0, 1))
    for key in ("file", "xxh64"):
        a[key], b[key] = b[key], a[key]
    _write_lines(dump, lines)
    with pytest.raises(ConvertError) as error:
        convert(dump, "modelopt", tmp_path / "out")
    text = str(error.value)
    assert f"manifest.jsonl:{_line_of(dump, 0)}: sample 0 (id 'u1')" in text
    assert f"{dump / 'hs_1.safetensors'}" in text and "holds sample 1 (id 'u2')" in text
    _assert_nothing_for(tmp_path / "out", 0)
    proc = _cli(dump, tmp_path / "cli")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("hsx.convert: error: ") and proc.stderr.count("\n") == 1
    assert "'u1'" in proc.stderr and "'u2'" in proc.stderr
    _assert_nothing_for(tmp_path / "cli", 0)


def test_files_swapped_on_disk_are_refused(dump4, tmp_path):
    dump = _copy(dump4, tmp_path / "dump")
    os.rename(dump / "hs_2.safetensors", dump / "swap")
    os.rename(dump / "hs_3.safetensors", dump / "hs_2.safetensors")
    os.rename(dump / "swap", dump / "hs_3.safetensors")
    with pytest.raises(ConvertError) as error:
        convert(dump, "modelopt", tmp_path / "out")
    text = str(error.value)
    assert f"manifest.jsonl:{_line_of(dump, 2)}: sample 2 (id 'u3')" in text
    assert "holds sample 3 (id 'u4')" in text
    # samples 0 and 1 were converted and journaled; nothing for 2
    assert (tmp_path / "out" / "data_1.pt").exists()
    _assert_nothing_for(tmp_path / "out", 2)
    assert "samples 0..1 converted and journaled are kept" in text


def test_a_tampered_token_id_is_refused_and_the_repaired_dump_resumes(dump4, tmp_path):
    reference = tmp_path / "reference"
    convert(dump4, "modelopt", reference)
    dump = _copy(dump4, tmp_path / "dump")
    victim = dump / "hs_2.safetensors"
    original = victim.read_bytes()
    offset, _ = _tensor_offset(victim, "token_ids")
    _patch(victim, offset + 8, struct.pack("<q", 5))  # token 1 of sample 2 becomes 5; the size stays
    out = tmp_path / "out"
    with pytest.raises(ConvertError) as error:
        convert(dump, "modelopt", out)
    text = str(error.value)
    want = xxhash.xxh64(struct.pack("<6q", *ROWS[2]["input_ids"])).hexdigest()  # int64 little-endian, seed 0
    assert want == next(e for e in _lines(dump) if e["index"] == 2)["token_ids_xxh64"]
    assert f"manifest.jsonl:{_line_of(dump, 2)}: sample 2 (id 'u3')" in text
    assert f"{victim}" in text and "token_ids hash to " in text and f"the journal says {want}" in text
    _assert_nothing_for(out, 2)
    victim.write_bytes(original)  # repaired: the same command resumes and finishes
    assert convert(dump, "modelopt", out) == 4
    for i in range(4):
        assert (out / f"data_{i}.pt").read_bytes() == (reference / f"data_{i}.pt").read_bytes()


def test_metadata_naming_another_index_is_refused(dump4, tmp_path):
    dump = _copy(dump4, tmp_path / "dump")
    victim = dump / "hs_3.safetensors"
    data = victim.read_bytes()
    at = data.index(b'"sample_index":"3"')
    _patch(victim, at, b'"sample_index":"0"')
    with pytest.raises(ConvertError) as error:
        convert(dump, "modelopt", tmp_path / "out")
    text = str(error.value)
    assert f"manifest.jsonl:{_line_of(dump, 3)}: sample 3 (id 'u4')" in text
    assert f"{victim}" in text and "holds sample 0 (id 'u4')" in text
    _assert_nothing_for(tmp_path / "out", 3)


def test_a_changed_value_byte_is_refused_by_the_digest(dump4, tmp_path):
    """A byte of hidden_states: only the whole file's XXH64 (the journal's xxh64) sees it."""
    dump = _copy(dump4, tmp_path / "dump")
    victim = dump / "hs_1.safetensors"
    offset, _ = _tensor_offset(victim, "hidden_states")
    data = victim.read_bytes()
    _patch(victim, offset + 3, bytes([data[offset + 3] ^ 0x01]))
    with pytest.raises(ConvertError) as error:
        convert(dump, "modelopt", tmp_path / "out")
    text = str(error.value)
    assert f"manifest.jsonl:{_line_of(dump, 1)}: sample 1 (id 'u2')" in text
    assert f"{victim}" in text and "xxh64 " in text and "changed since hsx-dump wrote it" in text
    _assert_nothing_for(tmp_path / "out", 1)
