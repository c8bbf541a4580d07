#!/usr/bin/env python3
"""Peak memory of python -m hsx.prepare against the size of its input: it must stay flat.

Generates chat JSONL files of the given sizes under a temporary directory (multi-turn OpenAI
conversations of about 4 KiB each, seeded words, ASCII and non-ASCII, every fifth with a thinking
block), runs hsx.prepare on each with the Kimi K2-Thinking fixture template and a byte-level BPE
tokenizer trained at start (tests/python/prepare_helpers.py), and prints for each size the child's
peak RSS (os.wait4's ru_maxrss: that process alone), its wall time and throughput. Everything it
generated is deleted at the end.

    python bench/prepare_memory.py [--sizes 100M,1G] [--model DIR] [--tmp /tmp]

Needs transformers and tokenizers (the test environment) and the hsx package importable (as in
the tests: installed, or PYTHONPATH). The ratio that matters: peak RSS at the largest size over
the smallest, which is about 1 when memory is flat.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when what if more no out so said up its "
         "café naïve Straße 日本語 数据 модель κόσμος 🙂").split()


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def generate(path: Path, size: int, seed: int = 0) -> int:
    """Writes about `size` bytes of conversations; returns the number of lines."""
    rng = random.Random(seed)
    lines = written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            messages = [{"role": "system", "content": _words(rng, 20)}]
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": _words(rng, rng.randint(30, 120))})
                answer = {"role": "assistant", "content": _words(rng, rng.randint(150, 400))}
                if lines % 5 == 0:
                    answer["reasoning_content"] = _words(rng, 60)
                messages.append(answer)
            line = json.dumps({"id": lines, "messages": messages}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            lines += 1
    return lines


def fixture_model(root: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests" / "python"))
    from prepare_helpers import model_dir
    return model_dir(root, "kimi-k2-thinking")


def measure(model: Path, source: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "hsx.prepare", "--model", str(model), "--input", str(source), "--output",
           str(out), "--no-progress", "--checkpoint-every", "5000"]
    start = time.monotonic()
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.monotonic() - start
    stderr = child.stderr.read()
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"hsx.prepare failed ({child.returncode}): {stderr}")
    return {"peak_rss_mib": usage.ru_maxrss / 1024, "seconds": seconds, "summary": stderr.strip().splitlines()[-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100M,1G", help="input sizes, comma-separated (K, M, G suffixes)")
    p.add_argument("--model", type=Path, help="model directory (default: the fixture tokenizer, built here)")
    p.add_argument("--tmp", default=tempfile.gettempdir(), help="where the inputs are generated")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-prepare-memory-", dir=args.tmp))
    try:
        model = args.model or fixture_model(work)
        print("| input | lines | peak RSS (MiB) | wall (s) | MB/s |")
        print("|---|---:|---:|---:|---:|")
        for text in args.sizes.split(","):
            source = work / f"chats-{text}.jsonl"
            lines = generate(source, _size(text))
            actual = source.stat().st_size
            result = measure(model, source, work / f"out-{text}.jsonl")
            print(f"| {actual / 1e6:.0f} MB | {lines} | {result['peak_rss_mib']:.1f} | {result['seconds']:.0f} | "
                  f"{actual / 1e6 / result['seconds']:.2f} |", flush=True)
            print(f"<!-- {result['summary']} -->", flush=True)
            for path in work.glob(f"*{text}*"):
                path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
