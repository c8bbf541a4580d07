"""Helpers shared by the tests that run hsx-dump and hsx-server: input files,
sample generation, free ports, the journal, and the Python client's receive paths."""

import importlib.util
import json
import random
import socket
import time
from pathlib import Path

import pytest

VOCAB = 2048  # the tiny preset

# hsx.Client's two receive paths (its `native` argument): the native module
# (hsx._native, skipped where it is not built) and grpcio with StreamDecoder.
NATIVE_BUILT = importlib.util.find_spec("hsx._native") is not None
RECEIVE_PATHS = [pytest.param(True, id="native", marks=pytest.mark.skipif(not NATIVE_BUILT,
                                                                          reason="hsx._native is not built")),
                 pytest.param(False, id="grpcio")]


def write_jsonl(path, rows):
    """Writes rows (dicts, or raw strings for malformed lines) one per line."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def sample_rows(n, lo=1, hi=40, seed=0, with_mask=lambda i: i % 2 == 1):
    """n samples of lo..hi random tokens, ids "s{i}", a loss_mask where with_mask(i)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randrange(lo, hi + 1)
        row = {"input_ids": [rng.randrange(VOCAB) for _ in range(length)], "id": f"s{i}"}
        if with_mask(i):
            row["loss_mask"] = [rng.randrange(2) for _ in range(length)]
        rows.append(row)
    return rows


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def manifest(out):
    """The complete lines of every journal of OUT (manifest.jsonl, then journal/*.jsonl), parsed."""
    out = Path(out)
    paths = [out / "manifest.jsonl"] + sorted((out / "journal").glob("*.jsonl"))
    lines = []
    for path in paths:
        if path.exists():
            text = path.read_text()
            lines += [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
    return lines


def wait_for_lines(out, count, proc, timeout=60):
    """Waits until OUT's journals have `count` complete lines while hsx-dump `proc` runs."""
    deadline = time.time() + timeout
    while len(manifest(out)) < count:
        if proc.poll() is not None:
            raise AssertionError(f"hsx-dump exited ({proc.returncode}) before {count} samples:\n"
                                 f"{proc.stderr.read()}")
        assert time.time() < deadline, f"fewer than {count} samples after {timeout}s"
        time.sleep(0.005)
