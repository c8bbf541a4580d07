#!/usr/bin/env python3
"""Service benchmarks (not tests): issue 5 and 6 numbers in one run.

1. Payload throughput hsx-server -> hsx-dump, into a null sink (--discard: verified, not
   written) and onto disk, against a plain TCP socket moving the same number of bytes over
   loopback in the same run. The model is shaped so that transport, not compute, is the
   bottleneck: hidden 4096, one decoder layer, fp32, capture all + final norm (48 KiB per token).
2. End-to-end tokens/s of a remote dump against the in-process dump of the same samples
   (the tiny preset, bf16, eagle3): what a data-prep job sees.
3. The Python client (hsx.Client.extract_many) against hsx-dump --discard on the same server:
   samples/s and MB/s.

    ~/.cache/hsx/venv/bin/python bench/service_bench.py [--bin-dir build/bin]
"""

import argparse
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))
from hsx_server import HsxServer  # noqa: E402

SUMMARY = re.compile(r"(\d+) tokens, (\d+) bytes .* in ([\d.]+) s")


def run(cmd):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{proc.stderr}")
    return proc.stdout


def dump_numbers(stdout):
    m = SUMMARY.search(stdout)
    if not m:
        raise SystemExit(f"no summary in hsx-dump output:\n{stdout}")
    return int(m.group(1)), int(m.group(2)), float(m.group(3))


def transport_model(bin_dir, work):
    run([bin_dir / "hsx-make-model", "--preset", "tiny", "--out", work / "tiny_for_config"])
    config = json.loads((work / "tiny_for_config" / "config.json").read_text())
    config.update({"hidden_size": 4096, "num_hidden_layers": 1, "vocab_size": 1024, "intermediate_size": 32,
                   "num_attention_heads": 1, "num_key_value_heads": 1, "q_lora_rank": 64, "kv_lora_rank": 32,
                   "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1})
    (work / "wide.json").write_text(json.dumps(config))
    run([bin_dir / "hsx-make-model", "--config", work / "wide.json", "--out", work / "wide"])
    return work / "wide"


def write_samples(path, count, vocab, lengths, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(count):
            n = rng.choice(lengths)
            f.write(json.dumps({"id": str(i), "input_ids": [rng.randrange(vocab) for _ in range(n)]}) + "\n")
    return path


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


def bench_payload(bin_dir, work, rows):
    model = transport_model(bin_dir, work)
    samples = write_samples(work / "wide.jsonl", 64, 1024, [512, 1024, 2048])
    flags = ["--capture", "all", "--final-norm", "--dtype", "fp32", "--concurrency", "8"]
    with HsxServer(bin_dir, model, "--precision", "fp32", "--max-batch-tokens", "8192") as server:
        run([bin_dir / "hsx-dump", "--server", server.address, "--input", samples, "--out", work / "warm",
             "--discard", *flags])
        t, null_bytes, null_s = dump_numbers(run([bin_dir / "hsx-dump", "--server", server.address, "--input",
                                                  samples, "--out", work / "null", "--discard", *flags]))
        _, disk_bytes, disk_s = dump_numbers(run([bin_dir / "hsx-dump", "--server", server.address, "--input",
                                                  samples, "--out", work / "disk", *flags]))
        shutil.rmtree(work / "disk", ignore_errors=True)
        python = bench_python_client(server, samples)
    tcp_s = tcp_baseline(null_bytes)
    tcp_rate = null_bytes / tcp_s
    rows.append(("plain TCP socket (loopback)", null_bytes, tcp_s, tcp_rate, 1.0))
    rows.append(("hsx-server -> hsx-dump, null sink", null_bytes, null_s, null_bytes / null_s, null_bytes / null_s / tcp_rate))
    rows.append(("hsx-server -> hsx-dump, to disk", disk_bytes, disk_s, disk_bytes / disk_s, disk_bytes / disk_s / tcp_rate))
    return null_bytes / null_s, python


def bench_python_client(server, samples_path):
    import hsx

    samples = [json.loads(line) for line in open(samples_path)]
    client = hsx.Client(server.address)
    for _ in client.extract_many(samples[:4], concurrency=4, capture=[0, 1], final_norm=True, dtype="fp32"):
        pass  # warm-up
    start = time.perf_counter()
    total = 0
    for _, sample in client.extract_many(samples, concurrency=8, capture=[0, 1], final_norm=True, dtype="fp32"):
        total += sample["hidden_states"].nbytes + sample["final_norm_hidden_states"].nbytes
    seconds = time.perf_counter() - start
    client.close()
    return len(samples), total, seconds


def bench_end_to_end(bin_dir, work, rows):
    model = work / "tiny"
    run([bin_dir / "hsx-make-model", "--preset", "tiny", "--out", model])
    samples = write_samples(work / "tiny.jsonl", 96, 2048, [64, 128, 256, 512, 1024])
    flags = ["--capture", "eagle3", "--dtype", "bf16"]
    tokens, _, local_s = dump_numbers(run([bin_dir / "hsx-dump", "--model", model, "--input", samples,
                                           "--out", work / "local", *flags]))
    with HsxServer(bin_dir, model) as server:
        _, _, remote_s = dump_numbers(run([bin_dir / "hsx-dump", "--server", server.address, "--input", samples,
                                           "--out", work / "remote", *flags]))
    rows.append(("in-process hsx-dump (tiny, tokens/s)", tokens, local_s, tokens / local_s, 1.0))
    rows.append(("remote hsx-dump (tiny, tokens/s)", tokens, remote_s, tokens / remote_s, local_s / remote_s))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", default=str(REPO / "build" / "bin"))
    args = parser.parse_args()
    bin_dir = Path(args.bin_dir)
    work = Path(tempfile.mkdtemp(prefix="hsx-service-bench-", dir=os.environ.get("HSX_BENCH_DIR")))
    try:
        rows = []
        dump_rate, (n, total, seconds) = bench_payload(bin_dir, work, rows)
        bench_end_to_end(bin_dir, work, rows)
        print(f"{'what':42} {'amount':>14} {'seconds':>9} {'rate':>16} {'ratio':>7}")
        for name, amount, secs, rate, ratio in rows:
            unit = "tok/s" if "tokens" in name else "MB/s"
            value = rate if unit == "tok/s" else rate / 1e6
            print(f"{name:42} {amount:>14} {secs:>9.2f} {value:>10.1f} {unit:>5} {ratio:>7.3f}")
        py_rate = total / seconds
        print(f"{'python hsx.Client.extract_many':42} {total:>14} {seconds:>9.2f} {py_rate / 1e6:>10.1f}  MB/s "
              f"{py_rate / dump_rate:>7.3f}  ({n / seconds:.1f} samples/s; ratio vs hsx-dump null sink)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
