#!/usr/bin/env python3
"""Two hsx-dump binaries, A/B, against one hsx-server: CPU-ns per byte.

The stream_cost.py set-up (hidden 7168, vocabulary 32000, --capture 0, 64 samples of 512-2048
tokens, --concurrency 4), one server for both binaries; the runs alternate A B, B A, ... after a
warm-up of each, so both see the same server, page cache and neighbours. CPU is hsx-dump's rusage
from wait4 (its whole life), per byte it reports receiving. Prints median [min-max] per binary and
the ratio of medians (B / A), and the same for the server's CPU (/proc/PID/stat) during each run.

    ~/.cache/hsx/venv/bin/python bench/dump_ab.py A_HSX_DUMP B_HSX_DUMP [--mode disk|discard]
        [--dtype bf16] [--repeats 8]

To get an older binary: check out its sources, build the hsx-dump target, copy bin/hsx-dump away.
"""

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "python"))
import stream_cost as sc  # noqa: E402
from hsx_server import HsxServer  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--mode", choices=["disk", "discard"], default="disk")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--capture", default="0",
                        help="hsx-dump's --capture (the model has one layer: ids 0 and 1; 0,1 streams two)")
    parser.add_argument("--final-norm", action="store_true", help="hsx-dump's --final-norm")
    parser.add_argument("--server-flag", action="append", default=[],
                        help="extra hsx-server flag (repeatable), e.g. --server-flag=--max-chunk-bytes=256KiB")
    parser.add_argument("--bin-dir", default=str(REPO / "build" / "bin"), help="hsx-server and hsx-make-model")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3")
    bin_dir = Path(args.bin_dir)
    with sc.workspace(bin_dir, "hsx-dump-ab-") as (work, model, samples):
        binaries = {"A": args.a, "B": args.b}
        results = {"A": [], "B": []}
        rss = {"A": [], "B": []}
        server_results = {"A": [], "B": []}  # the server's CPU while each binary ran
        with HsxServer(bin_dir, model, "--capture", "0", "--max-batch-tokens", "8192", *args.server_flag) as server:
            for r in range(args.repeats + 1):  # round 0 warms up
                for name in (["A", "B"] if r % 2 == 0 else ["B", "A"]):
                    usage = {}
                    server_before = sc.proc_cpu(server.proc.pid)
                    nbytes, cpu = sc.run_dump(binaries[name], server.address, samples, work / "out", args.dtype,
                                              args.mode == "discard", args.capture, args.final_norm, usage)
                    server_cpu = sc.proc_cpu(server.proc.pid) - server_before
                    if r > 0:
                        results[name].append(cpu * 1e9 / nbytes)
                        server_results[name].append(server_cpu * 1e9 / nbytes)
                        rss[name].append(usage["usage"].ru_maxrss / 1024)  # KiB -> MiB
        print(f"hsx-dump {args.mode}, {args.dtype}, --capture {args.capture}{' --final-norm' if args.final_norm else ''},"
              f" {args.repeats} interleaved repeats, CPU-ns per byte:")
        for name in ("A", "B"):
            print(f"  {name} {sc.fmt(results[name])}  {binaries[name]}")
        print(f"  B / A {statistics.median(results['B']) / statistics.median(results['A']):.2f}")
        print("the server's CPU-ns per byte meanwhile (a client's settings can move it):")
        for name in ("A", "B"):
            print(f"  {name} {sc.fmt(server_results[name])}")
        print(f"  B / A {statistics.median(server_results['B']) / statistics.median(server_results['A']):.2f}")
        print("peak RSS, MiB:")
        for name in ("A", "B"):
            print(f"  {name} {statistics.median(rss[name]):.0f} [{min(rss[name]):.0f}-{max(rss[name]):.0f}]")


if __name__ == "__main__":
    main()
