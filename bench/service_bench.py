#!/usr/bin/env python3
"""Service benchmarks (not tests): the service's and the Python client's throughput in one run.

1. Payload throughput hsx-server -> hsx-dump, into a null sink (--discard: verified, not
   written) and onto disk, against a plain TCP socket moving the same number of bytes over
   loopback in the same run. The model is shaped so that transport, not compute, is the
   bottleneck: hidden 4096, one decoder layer, fp32, capture all + final norm (48 KiB per token).
2. End-to-end tokens/s of a remote dump against the in-process dump of the same samples
   (the tiny preset, bf16, eagle3): what a data-prep job sees.
3. The Python client (hsx.Client.extract_many) against hsx-dump --discard on the same server:
   samples/s and MB/s.

Each side gets the same warm-up (one pass over the first 8 samples), then the sides run
interleaved, --repeats times (default 3), the order rotating each repeat; the table gives the
median and the range (min-max) of each side and the ratio of the medians with its range over
the repeats.

    ~/.cache/hsx/venv/bin/python bench/service_bench.py [--bin-dir build/bin] [--repeats 3]
"""

import argparse
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))
from hsx_server import HsxServer  # noqa: E402
from bench_util import run, wide_model  # noqa: E402

SUMMARY = re.compile(r"(\d+) tokens, (\d+) bytes .* in ([\d.]+) s")


def dump_numbers(stdout):
    m = SUMMARY.search(stdout)
    if not m:
        raise SystemExit(f"no summary in hsx-dump output:\n{stdout}")
    return int(m.group(1)), int(m.group(2)), float(m.group(3))


def transport_model(bin_dir, work):
    return wide_model(bin_dir, work, hidden_size=4096, vocab_size=1024, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32)


def write_samples(path, count, vocab, lengths, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(count):
            n = rng.choice(lengths)
            f.write(json.dumps({"id": str(i), "input_ids": [rng.randrange(vocab) for _ in range(n)]}) + "\n")
    return path


def first_lines(path, count, out):
    out.write_text("".join(open(path).readlines()[:count]))
    return out


def interleaved(sides, repeats):
    """Runs each side (name -> fn returning (amount, seconds)) once per repeat,
    rotating the order each repeat; returns name -> list of (amount, seconds)."""
    names = list(sides)
    results = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(sides[name]())
    return results


def summarize(name, runs, baseline_runs, unit):
    """A row: median rate, its range, and the ratio of medians to the baseline
    with the range of the per-repeat ratios."""
    rates = [amount / secs for amount, secs in runs]
    base = [amount / secs for amount, secs in baseline_runs]
    ratios = [a / b for a, b in zip(rates, base)]
    scale = 1.0 if unit == "tok/s" else 1e6
    return (name, runs[0][0], statistics.median(s for _, s in runs), statistics.median(rates) / scale,
            min(rates) / scale, max(rates) / scale, unit, statistics.median(rates) / statistics.median(base),
            min(ratios), max(ratios))


def tcp_baseline(total_bytes, chunk=1 << 20):
    """Seconds to move total_bytes over a loopback TCP socket (send -> recv into a buffer)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    payload = os.urandom(chunk)

    def send():
        conn, _ = server.accept()
        sent = 0
        while sent < total_bytes:
            n = min(chunk, total_bytes - sent)
            conn.sendall(payload[:n])
            sent += n
        conn.close()

    thread = threading.Thread(target=send)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    received = 0
    start = time.perf_counter()
    while received < total_bytes:
        n = client.recv_into(view)
        if n == 0:
            break
        received += n
    seconds = time.perf_counter() - start
    thread.join()
    client.close()
    server.close()
    return seconds


def dump_side(bin_dir, server, samples, out, flags):
    def fn():
        shutil.rmtree(out, ignore_errors=True)
        _, nbytes, seconds = dump_numbers(run([bin_dir / "hsx-dump", "--server", server.address, "--input",
                                               samples, "--out", out, *flags]))
        shutil.rmtree(out, ignore_errors=True)
        return nbytes, seconds
    return fn


def bench_payload(bin_dir, work, repeats):
    model = transport_model(bin_dir, work)
    samples = write_samples(work / "wide.jsonl", 64, 1024, [512, 1024, 2048])
    warm = first_lines(samples, 8, work / "warm.jsonl")
    flags = ["--capture", "all", "--final-norm", "--dtype", "fp32", "--concurrency", "8"]
    with HsxServer(bin_dir, model, "--precision", "fp32", "--max-batch-tokens", "8192") as server:
        null = dump_side(bin_dir, server, samples, work / "null", ["--discard", *flags])
        disk = dump_side(bin_dir, server, samples, work / "disk", flags)
        python = python_side(server, samples)
        # The same warm-up for every side: one pass over the first 8 samples.
        warm_bytes, _ = dump_side(bin_dir, server, warm, work / "warm", ["--discard", *flags])()
        dump_side(bin_dir, server, warm, work / "warm", flags)()
        python_side(server, warm)()
        total_bytes = None

        def tcp():
            nonlocal total_bytes
            return total_bytes, tcp_baseline(total_bytes)
        tcp_baseline(warm_bytes)
        total_bytes = null()[0]  # the byte count the TCP baseline moves (also a warm run of hsx-dump)
        runs = interleaved({"tcp": tcp, "null": null, "disk": disk, "python": python}, repeats)
    return [summarize("plain TCP socket (loopback)", runs["tcp"], runs["tcp"], "MB/s"),
            summarize("hsx-server -> hsx-dump, null sink", runs["null"], runs["tcp"], "MB/s"),
            summarize("hsx-server -> hsx-dump, to disk", runs["disk"], runs["tcp"], "MB/s"),
            summarize("Python extract_many vs hsx-dump null sink", runs["python"], runs["null"], "MB/s")]


def python_side(server, samples_path):
    import hsx

    samples = [json.loads(line) for line in open(samples_path)]

    def fn():
        client = hsx.Client(server.address)
        start = time.perf_counter()
        total = 0
        for _, sample in client.extract_many(samples, concurrency=8, capture=[0, 1], final_norm=True, dtype="fp32"):
            total += sample["hidden_states"].nbytes + sample["final_norm_hidden_states"].nbytes
        seconds = time.perf_counter() - start
        client.close()
        return total, seconds
    return fn


def bench_end_to_end(bin_dir, work, repeats):
    model = work / "tiny"
    run([bin_dir / "hsx-make-model", "--preset", "tiny", "--out", model])
    samples = write_samples(work / "tiny.jsonl", 96, 2048, [64, 128, 256, 512, 1024])
    warm = first_lines(samples, 8, work / "tiny_warm.jsonl")
    flags = ["--capture", "eagle3", "--dtype", "bf16"]

    def local(input_path=samples):
        shutil.rmtree(work / "local", ignore_errors=True)
        tokens, _, seconds = dump_numbers(run([bin_dir / "hsx-dump", "--model", model, "--input", input_path,
                                               "--out", work / "local", *flags]))
        return tokens, seconds

    with HsxServer(bin_dir, model) as server:
        def remote(input_path=samples):
            shutil.rmtree(work / "remote", ignore_errors=True)
            tokens, _, seconds = dump_numbers(run([bin_dir / "hsx-dump", "--server", server.address, "--input",
                                                   input_path, "--out", work / "remote", *flags]))
            return tokens, seconds
        local(warm)
        remote(warm)
        runs = interleaved({"local": local, "remote": remote}, repeats)
    return [summarize("in-process hsx-dump (tiny, tokens/s)", runs["local"], runs["local"], "tok/s"),
            summarize("remote hsx-dump (tiny, tokens/s)", runs["remote"], runs["local"], "tok/s")]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", default=str(REPO / "build" / "bin"))
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per side (at least 3)")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (a median and a range need them)")
    bin_dir = Path(args.bin_dir)
    work = Path(tempfile.mkdtemp(prefix="hsx-service-bench-", dir=os.environ.get("HSX_BENCH_DIR")))
    try:
        rows = bench_payload(bin_dir, work, args.repeats) + bench_end_to_end(bin_dir, work, args.repeats)
        print(f"{args.repeats} interleaved repeats per side; rate = median [min-max]; "
              "ratio = median / median of the baseline [range of per-repeat ratios]")
        print(f"{'what':44} {'amount':>12} {'median s':>9} {'rate':>28} {'ratio':>22}")
        for name, amount, secs, rate, low, high, unit, ratio, rlow, rhigh in rows:
            print(f"{name:44} {amount:>12} {secs:>9.2f} {rate:>8.1f} [{low:>7.1f}-{high:>7.1f}] {unit:>5} "
                  f"{ratio:>6.3f} [{rlow:.3f}-{rhigh:.3f}]")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
