#!/usr/bin/env python3
"""Two versions of the Python client, A/B, against one hsx-server, next to hsx-dump --discard:
CPU-ns per streamed byte.

The stream_cost.py set-up (hidden 7168, vocabulary 32000, --capture 0, 64 samples of 512-2048
tokens, concurrency 4), one server for every side. A and B are directories holding an `hsx`
package (e.g. client/python of two checkouts, the generated hsx/v1 stubs included: build them
with `pip install`, or copy them from an installed package); each runs stream_cost.py's python
role (hsx.Client.extract_many in a child process, getrusage around the transfer alone) with
PYTHONPATH pointing at it. hsx-dump --discard --concurrency 4 runs in the same rounds (rusage
from wait4, its whole life). After a warm-up round the sides alternate, the order rotating each
round, so that all see the same server, page cache and neighbours. With --floor, a fourth side:
grpcio alone, the same Extract calls (4 threads) with no deserializer, each message's bytes
counted and dropped: what any client built on grpcio's synchronous API pays before it looks at a
byte. Prints median [min-max] per side, B / A, and each side / hsx-dump --discard (ratios of
medians), then the same ratios taken within each round (median and range over the rounds).

    ~/.cache/hsx/venv/bin/python bench/python_ab.py A_DIR B_DIR [--dtype bf16] [--repeats 8]
        [--bin-dir build/bin] [--env-b NAME=VALUE ...] [--floor] [--warm] [--raw | --raw-b] [--fixed-order]

--warm times each client's second pass over the samples, in the same process: its native
receive path's pool then holds blocks, as in a long job, where the first pass also faults in
the first samples' fresh memory (stream_cost.py's python side is such a first pass).
--fixed-order runs each round's sides in one order (A, B, the floor, then hsx-dump) instead of
rotating it: on a VM whose fresh memory is dear, a client's first pass pays for its place (the
first client after hsx-dump finds memory the host took back), and a fixed order shows how much.
Each side's minor page faults per pass are printed beside its CPU (median [min-max]).
"""

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "python"))
import stream_cost as sc  # noqa: E402
from hsx_server import HsxServer  # noqa: E402


def grpcio_floor(address, samples_path, dtype):
    """The --floor side's child (B's hsx package for the request message): prints bytes, CPU seconds and
    minor faults of the transfer."""
    import concurrent.futures
    import json

    import grpc
    from hsx.v1 import hsx_pb2
    samples = [json.loads(line) for line in open(samples_path)]
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
    extract = channel.unary_stream("/hsx.v1.HiddenStates/Extract",
                                   request_serializer=hsx_pb2.ExtractRequest.SerializeToString)
    dtype_value = {"bf16": hsx_pb2.DTYPE_BF16, "fp16": hsx_pb2.DTYPE_FP16, "fp32": hsx_pb2.DTYPE_FP32}[dtype]

    def one(sample):
        request = hsx_pb2.ExtractRequest(sample_id=sample["id"], token_ids=sample["input_ids"], capture_ids=[0],
                                         dtype=dtype_value)
        return sum(len(message) for message in extract(request, timeout=600))

    start, faults = sc.own_cpu(), sc.own_faults()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        total = sum(pool.map(one, samples))
    print(total, sc.own_cpu() - start, sc.own_faults() - faults)
    channel.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", nargs="?", help="directory holding the A version of the hsx package")
    parser.add_argument("b", nargs="?", help="directory holding the B version of the hsx package")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--bin-dir", default=str(REPO / "build" / "bin"), help="hsx-server, hsx-dump, hsx-make-model")
    parser.add_argument("--env-b", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for B's runs only (repeatable)")
    parser.add_argument("--raw", action="store_true",
                        help="fp8 handed on as received (dequantize=False), as stream_cost.py's python-raw side")
    parser.add_argument("--raw-b", action="store_true",
                        help="B alone with dequantize=False (A and B may then be the same package)")
    parser.add_argument("--floor", action="store_true", help="also run grpcio alone (no deserializer, no checks)")
    parser.add_argument("--warm", action="store_true",
                        help="time each client's second pass over the samples (the first warms its native pool)")
    parser.add_argument("--fixed-order", action="store_true",
                        help="each round runs A, B (the floor), then hsx-dump, in that order (default: rotating)")
    parser.add_argument("--role", choices=["floor"], help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--samples-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "floor":
        return grpcio_floor(args.address, args.samples_path, args.dtype)
    if not args.a or not args.b:
        parser.error("A_DIR and B_DIR are required")
    if args.repeats < 3:
        parser.error("--repeats must be at least 3")
    for d in (args.a, args.b):
        if not (Path(d) / "hsx" / "v1" / "hsx_pb2.py").exists():
            parser.error(f"{d}: no hsx/v1/hsx_pb2.py (the generated stubs) under it")
    bin_dir = Path(args.bin_dir)
    extra = {"A": {}, "B": dict(kv.split("=", 1) for kv in args.env_b)}
    for name in ("A", "B"):  # each side must import its own package, not an installed one
        where = Path(getattr(args, name.lower())).resolve()
        found = subprocess.run([sys.executable, "-c", "import hsx; print(hsx.__file__)"], capture_output=True,
                               text=True, env={**os.environ, "PYTHONPATH": str(where)}).stdout.strip()
        if not found.startswith(str(where) + os.sep):
            parser.error(f"{name}: PYTHONPATH={where} imports hsx from {found or 'nowhere'}")
    with sc.workspace(bin_dir, "hsx-python-ab-") as (work, model, samples):
        with HsxServer(bin_dir, model, "--capture", "0", "--max-batch-tokens", "8192") as server:
            def python(name, script=sc.__file__, role="python"):
                package = args.b if name == "floor" else getattr(args, name.lower())
                env = {**os.environ, "PYTHONPATH": str(Path(package).resolve()), **extra.get(name, {})}
                raw = args.raw or (args.raw_b and name == "B")
                flags = [f for f, on in (("--warm", args.warm), ("--raw", raw)) if on and role == "python"]
                stdout, _ = sc.child([sys.executable, script, "--role", role, "--address", server.address,
                                      "--samples-path", samples, "--dtype", args.dtype, *flags], env=env)
                nbytes, cpu, faults = stdout.split()[:3]
                return float(cpu) * 1e9 / int(nbytes), int(faults)

            def dump():
                usage = {}
                nbytes, cpu = sc.run_dump(bin_dir / "hsx-dump", server.address, samples, work / "out", args.dtype, True,
                                          usage_out=usage)
                return cpu * 1e9 / nbytes, usage["usage"].ru_minflt

            sides = {"A": lambda: python("A"), "B": lambda: python("B"), "dump": dump}
            if args.floor:
                sides["floor"] = lambda: python("floor", __file__, "floor")
            names = [n for n in sides if n != "dump"] + ["dump"]
            results = {name: [] for name in names}
            faults = {name: [] for name in names}
            for r in range(args.repeats + 1):  # round 0 warms up
                order = names if args.fixed_order else names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    value, fault_count = sides[name]()
                    if r > 0:
                        results[name].append(value)
                        faults[name].append(fault_count)
    med = {name: statistics.median(v) for name, v in results.items()}
    print(f"python client A/B, {args.dtype}, {args.repeats} interleaved repeats"
          + (" in a fixed order (A, B, then hsx-dump)" if args.fixed_order else "") + ", CPU-ns per byte"
          + (" (each client's second pass)" if args.warm else "") + ", and minor page faults per pass:")

    def line(name, label):
        print(f"  {name:5} {sc.fmt(results[name])}  faults {sc.fmt(faults[name], 0)}  {label}".rstrip())
    line("A", args.a)
    line("B", f"{args.b} {' '.join(args.env_b)}{' dequantize=False' if args.raw_b else ''}")
    line("dump", "hsx-dump --discard")
    if args.floor:
        line("floor", "grpcio alone (no deserializer, no checks)")
    print(f"  B / A {med['B'] / med['A']:.2f}; A / dump {med['A'] / med['dump']:.2f}; "
          f"B / dump {med['B'] / med['dump']:.2f}" + (f"; floor / dump {med['floor'] / med['dump']:.2f}; "
                                                       f"B - floor {med['B'] - med['floor']:.3f}" if args.floor else ""))
    # Per round (the runs of one round are neighbours in time): less moved by the host's slow
    # drift than the ratios of medians above.
    def per_round(x, y):
        return sc.fmt([b / a for a, b in zip(results[x], results[y])], 2)
    print(f"  per round, median [min-max]: B / A {per_round('A', 'B')}; A / dump {per_round('dump', 'A')}; "
          f"B / dump {per_round('dump', 'B')}")


if __name__ == "__main__":
    main()
