#!/usr/bin/env python3
"""What checking each file's whole-file XXH64 (the journal's "xxh64") costs python -m hsx.convert,
against the conversion itself (docs/formats.md, "Converted formats").

Writes a dump of --samples Kimi-K2-sized files (default: 4096 tokens, 4 captured layers
2, 30, 58, 61 of N = 61, H = 7168, bf16, a loss mask: about 235 MB each, the layout hsx-dump
writes, journal included), then times, per sample: file_xxh64 alone, and hsx.convert --to
modelopt with and without the digest (convert(digest=...)) and the part of the former spent
in file_xxh64 (which the run-to-run noise of fsync does not blur), each with the dump's files in
the page cache (warm) and evicted first (cold: posix_fadvise DONTNEED on each file, which
leaves the rest of the machine's cache alone). OUT is written under the same directory
and fsynced, as always.

    PYTHONPATH=client/python ~/.cache/hsx/venv/bin/python bench/convert_digest.py [--dir D]
        [--samples 3] [--tokens 4096] [--hidden 7168] [--repeat 2]
"""

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import xxhash

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "client" / "python"))
from hsx.convert import convert  # noqa: E402
from hsx import journal  # noqa: E402
from hsx.journal import file_xxh64  # noqa: E402

CAPTURE_IDS = [2, 30, 58, 61]
NUM_LAYERS = 61


def _safetensors(tensors: dict, metadata: dict) -> tuple[bytes, list]:
    """(header bytes, data pieces) of a safetensors file holding `tensors` (name -> array)."""
    header, offset, pieces = {}, 0, []
    names = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int64): "I64"}
    for name, array in tensors.items():
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        pieces.append(array)
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, pieces


def write_dump(directory: Path, samples: int, tokens: int, hidden: int) -> None:
    """hs_{i}.safetensors and manifest.jsonl, as hsx-dump writes them (the fields hsx.convert reads)."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    states = rng.standard_normal((tokens, len(CAPTURE_IDS), hidden), dtype=np.float32).astype(ml_dtypes.bfloat16)
    lines = []
    for i in range(samples):
        ids = rng.integers(0, 163840, tokens, dtype=np.int64)
        mask = (np.arange(tokens) % 3 != 0).astype(np.int64)
        tensors = {"hidden_states": states, "token_ids": ids, "loss_mask": mask}
        checksums = {name: xxhash.xxh64(a.tobytes()).hexdigest() for name, a in tensors.items()}
        metadata = {"sample_id": f"s{i}", "sample_index": str(i), "capture_ids": json.dumps(CAPTURE_IDS),
                    "num_layers": str(NUM_LAYERS), "dtype": "bf16", "model": "bench", "hsx_format": "1",
                    "checksums_xxh64": json.dumps(checksums), "final_norm": "absent"}
        head, pieces = _safetensors(tensors, metadata)
        path = directory / f"hs_{i}.safetensors"
        with open(path, "wb") as f:
            f.write(head)
            for piece in pieces:
                f.write(np.ascontiguousarray(piece).view(np.uint8).reshape(-1).data)
            os.fsync(f.fileno())
        lines.append({"index": i, "id": f"s{i}", "file": path.name, "tokens": tokens, "bytes": path.stat().st_size,
                      "xxh64": file_xxh64(path), "capture_ids": CAPTURE_IDS, "final_norm": False, "dtype": "bf16",
                      "model": "bench", "model_revision": "", "compute_precision": "bf16",
                      "token_ids_xxh64": checksums["token_ids"], "loss_mask_xxh64": checksums["loss_mask"],
                      "input_xxh64": "0" * 16})
    (directory / "manifest.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))


def evict(directory: Path) -> None:
    for path in directory.glob("hs_*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(directory: Path) -> None:
    for path in directory.glob("hs_*.safetensors"):
        file_xxh64(path)


def time_digest(dump: Path, cold: bool) -> float:
    (evict if cold else warm)(dump)
    start = time.perf_counter()
    for path in sorted(dump.glob("hs_*.safetensors")):
        file_xxh64(path)
    return time.perf_counter() - start


def time_convert(dump: Path, out: Path, digest: bool, cold: bool) -> tuple[float, float]:
    """(seconds of the conversion, seconds of it spent in file_xxh64)."""
    shutil.rmtree(out, ignore_errors=True)
    (evict if cold else warm)(dump)
    spent = [0.0]

    def timed(path):
        start = time.perf_counter()
        try:
            return file_xxh64(path)
        finally:
            spent[0] += time.perf_counter() - start
    journal.file_xxh64 = timed  # what hsx.journal.file_problems calls
    try:
        start = time.perf_counter()
        convert(dump, "modelopt", out, digest=digest)
        elapsed = time.perf_counter() - start
    finally:
        journal.file_xxh64 = file_xxh64
    shutil.rmtree(out)
    return elapsed, spent[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the dump and OUT (default: a "
                        "temporary directory under /tmp, removed afterwards)")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each measurement; the best is reported")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="hsx-digest-", dir=args.dir))
    try:
        dump = base / "dump"
        write_dump(dump, args.samples, args.tokens, args.hidden)
        size = sum(p.stat().st_size for p in dump.glob("hs_*.safetensors")) / args.samples
        print(f"{args.samples} samples of {size / 1e6:.1f} MB ({args.tokens} tokens, {len(CAPTURE_IDS)} layers, "
              f"H = {args.hidden}, bf16); seconds per sample, best of {args.repeat}")
        for cold in (False, True):
            hashing = min(time_digest(dump, cold) for _ in range(args.repeat)) / args.samples
            runs = {False: [], True: []}
            for k in range(args.repeat):  # alternating, so neither always runs first
                for digest in ((False, True) if k % 2 == 0 else (True, False)):
                    runs[digest].append(time_convert(dump, base / "out", digest, cold))
            without = min(t for t, _ in runs[False]) / args.samples
            with_digest, inside = (x / args.samples for x in min(runs[True]))
            print(f"{'cold' if cold else 'warm'}: file_xxh64 alone {hashing:.3f} s ({size / hashing / 1e9:.2f} GB/s); "
                  f"convert --no-digest {without:.3f} s; with the digest {with_digest:.3f} s, of which "
                  f"file_xxh64 {inside:.3f} s ({100 * inside / with_digest:.1f}%)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
