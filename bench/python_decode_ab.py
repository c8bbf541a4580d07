#!/usr/bin/env python3
"""The Python client's decoding alone, A/B: CPU-ns per byte of turning recorded Extract
streams into verified samples.

stream_cost.py's model and samples, one hsx-server; the first --samples samples' Extract
streams (capture 0, --dtype) are recorded once as the raw message bytes grpcio delivers.
Then, in child processes alternating A B, B A, ... after a warm-up of each, each version of
the `hsx` package (a directory put on PYTHONPATH, as in python_ab.py) deserializes and
assembles every recorded stream on one thread: its Client's deserializer
(hsx.client.parse_response where it exists, else the generated ExtractResponse.FromString)
and hsx.client.assemble, every check included. CPU is getrusage around that pass alone, so
grpcio's receive path, the threads and the server are out of the picture. Prints median
[min-max] per version and B / A.

    ~/.cache/hsx/venv/bin/python bench/python_decode_ab.py A_DIR B_DIR [--dtype bf16]
        [--samples 16] [--repeats 8] [--bin-dir build/bin]
"""

import argparse
import json
import os
import pickle
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "python"))
import stream_cost as sc  # noqa: E402
from hsx_server import HsxServer  # noqa: E402

DTYPES = {"bf16": 1, "fp16": 2, "fp32": 3}  # hsx.v1.DType


def record(address, samples_path, count, dtype, out):
    """Writes [(sample, [message bytes, ...]), ...] for the first `count` samples to out."""
    import grpc
    from hsx.v1 import hsx_pb2
    samples = [json.loads(line) for line in open(samples_path)][:count]
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        extract = channel.unary_stream("/hsx.v1.HiddenStates/Extract",
                                       request_serializer=hsx_pb2.ExtractRequest.SerializeToString)
        streams = [(s, list(extract(hsx_pb2.ExtractRequest(sample_id=s["id"], token_ids=s["input_ids"],
                                                            capture_ids=[0], dtype=DTYPES[dtype]), timeout=600)))
                   for s in samples]
    with open(out, "wb") as f:
        pickle.dump(streams, f)


def decode(recorded, dtype):
    """The child: one pass over the recorded streams; prints bytes and CPU seconds."""
    import hsx.client as hc
    from hsx.v1 import hsx_pb2
    parse = getattr(hc, "parse_response", hsx_pb2.ExtractResponse.FromString)
    with open(recorded, "rb") as f:
        streams = pickle.load(f)
    start = sc.own_cpu()
    total = 0
    for sample, messages in streams:
        expect = hc.StreamExpectation(sample_id=sample["id"], token_ids=tuple(sample["input_ids"]), capture_ids=(0,),
                                      final_norm=False, dtype=dtype)
        total += hc.assemble((parse(m) for m in messages), expect)["hidden_states"].nbytes
    print(total, sc.own_cpu() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", nargs="?", help="directory holding the A version of the hsx package")
    parser.add_argument("b", nargs="?", help="directory holding the B version of the hsx package")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--bin-dir", default=str(REPO / "build" / "bin"), help="hsx-server and hsx-make-model")
    parser.add_argument("--role", choices=["decode"], help=argparse.SUPPRESS)
    parser.add_argument("--recorded", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "decode":
        return decode(args.recorded, args.dtype)
    if not args.a or not args.b:
        parser.error("A_DIR and B_DIR are required")
    if args.repeats < 3:
        parser.error("--repeats must be at least 3")
    bin_dir = Path(args.bin_dir)
    dirs = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    with sc.workspace(bin_dir, "hsx-python-decode-ab-") as (work, model, samples):
        recorded = work / "streams.pickle"
        with HsxServer(bin_dir, model, "--capture", "0", "--max-batch-tokens", "8192") as server:
            record(server.address, samples, args.samples, args.dtype, recorded)
        results = {"A": [], "B": []}
        for r in range(args.repeats + 1):  # round 0 warms up
            for name in (["A", "B"] if r % 2 == 0 else ["B", "A"]):
                stdout, _ = sc.child([sys.executable, __file__, "--role", "decode", "--recorded", recorded,
                                      "--dtype", args.dtype], env={**os.environ, "PYTHONPATH": str(dirs[name])})
                nbytes, cpu = stdout.split()[:2]
                if r > 0:
                    results[name].append(float(cpu) * 1e9 / int(nbytes))
    print(f"python decoding alone, {args.dtype}, {args.samples} recorded streams, {args.repeats} interleaved repeats, "
          "CPU-ns per byte:")
    for name in ("A", "B"):
        print(f"  {name} {sc.fmt(results[name])}  {dirs[name]}")
    print(f"  B / A {statistics.median(results['B']) / statistics.median(results['A']):.2f}")


if __name__ == "__main__":
    main()
