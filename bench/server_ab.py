#!/usr/bin/env python3
"""Two hsx-server builds, A/B, under the same client: CPU-ns per streamed byte.

The stream_cost.py set-up (hidden 7168, vocabulary 32000, --capture 0, 64 samples of 512-2048
tokens), both servers up at once on the same model; one hsx-dump --discard --concurrency 4 (from
--bin-dir) runs against A and B in turn, A B, B A, ... after a warm-up of each, so both see the
same client, page cache and neighbours. A server's CPU is its /proc/PID/stat utime+stime around
each run, per byte the client reports; "engine" is its threads named hsx-engine* (servers built
before the threads were named report 0 there), "streaming" the rest. Prints median [min-max] per
server and the ratios of medians (B / A), and hsx-dump's own CPU per byte against each.

    ~/.cache/hsx/venv/bin/python bench/server_ab.py A_BIN_DIR B_BIN_DIR [--dtype bf16] [--repeats 6]
        [--server-flag-b=--max-chunk-bytes=256KiB ...]

A_BIN_DIR and B_BIN_DIR hold an hsx-server each (e.g. a build of an older commit's bin/, copied away);
they may be the same, with --server-flag-b making the difference.
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
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--bin-dir", default=str(REPO / "build" / "bin"), help="hsx-dump and hsx-make-model")
    parser.add_argument("--server-flag-b", action="append", default=[], help="extra flag for server B (repeatable)")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3")
    bin_dir = Path(args.bin_dir)
    with sc.workspace(bin_dir, "hsx-server-ab-") as (work, model, samples):
        flags = ["--capture", "0", "--max-batch-tokens", "8192"]
        results = {"A": [], "B": []}
        with HsxServer(Path(args.a), model, *flags) as a, \
                HsxServer(Path(args.b), model, *flags, *args.server_flag_b) as b:
            servers = {"A": a, "B": b}
            for r in range(args.repeats + 1):  # round 0 warms up
                for name in (["A", "B"] if r % 2 == 0 else ["B", "A"]):
                    server = servers[name]
                    pid = server.proc.pid
                    before, engine_before = sc.proc_cpu(pid), sc.engine_cpu(pid)
                    total, client = sc.run_dump(bin_dir / "hsx-dump", server.address, samples, work / "out", args.dtype,
                                           discard=True)
                    cpu, engine = sc.proc_cpu(pid) - before, sc.engine_cpu(pid) - engine_before
                    if r > 0:
                        results[name].append((cpu * 1e9 / total, engine * 1e9 / total, client * 1e9 / total))
        print(f"hsx-server A/B, {args.dtype}, hsx-dump --discard, {args.repeats} interleaved repeats, "
              f"server CPU-ns per byte:")
        medians = {}
        for name, path in (("A", args.a), ("B", args.b)):
            whole = [w for w, _, _ in results[name]]
            engine = [e for _, e, _ in results[name]]
            streaming = [w - e for w, e, _ in results[name]]
            client = [c for _, _, c in results[name]]
            medians[name] = (statistics.median(whole), statistics.median(streaming), statistics.median(client))
            extra = f" {' '.join(args.server_flag_b)}" if name == "B" and args.server_flag_b else ""
            print(f"  {name} whole {sc.fmt(whole)}  engine {sc.fmt(engine)}  streaming {sc.fmt(streaming)}  "
                  f"hsx-dump {sc.fmt(client)}  {path}{extra}")
        ratios = [medians["B"][i] / medians["A"][i] for i in range(3)]
        print(f"  B / A: whole {ratios[0]:.2f}, streaming {ratios[1]:.2f}, hsx-dump {ratios[2]:.2f}")


if __name__ == "__main__":
    main()
