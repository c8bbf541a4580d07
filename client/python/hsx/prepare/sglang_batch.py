"""Runs a requests file of `hsx.prepare requests --engine sglang` through SGLang's offline engine.

    python client/python/hsx/prepare/sglang_batch.py --model-path MODEL --input REQUESTS.jsonl \\
        --output OUTPUTS.jsonl [--chunk N] [--engine-arg KEY=JSON ...]

Run it where sglang is installed (this file imports nothing of hsx: run it as a file). SGLang has no
batch-file runner of its own; its offline entry point is sglang.Engine.generate, whose keyword
arguments are those of a /generate request (GenerateReqInput). Each request line is one such set,
{"rid", "input_ids", "sampling_params"}; the requests go to Engine.generate N at a time (lists of each
argument) and each answer is written as one line as the engine returns it: {"text", "output_ids",
"meta_info": {"id": RID, "finish_reason", ...}}. A chunk the engine refuses is sent again one request
at a time; a request it refuses then is written as {"error": {"message"}, "meta_info": {"id": RID}}.

Resumable: the answers go to OUTPUTS.partial, fsynced after each chunk; a rerun cuts a torn last
line, skips the requests answered there and goes on; OUTPUTS appears when every request is answered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--engine-arg {text!r}: expected KEY=JSON, e.g. tp_size=8")
    try:
        return key, json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--engine-arg {text!r}: the value is not JSON") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang_batch.py", description=__doc__.split("\n\n")[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="the model sglang.Engine serves (the one the requests are for)")
    p.add_argument("--input", required=True, type=Path, help="requests from `hsx.prepare requests --engine sglang`")
    p.add_argument("--output", required=True, type=Path, help="the outputs to write (for `hsx.prepare responses`)")
    p.add_argument("--chunk", type=int, default=256, help="requests per Engine.generate call (default 256)")
    p.add_argument("--engine-arg", type=_arg, action="append", default=[], metavar="KEY=JSON",
                   help="a keyword argument of sglang.Engine, e.g. tp_size=8 (repeatable)")
    return p


def answered(partial: Path) -> set[str]:
    """The request ids PARTIAL answers; a last line without its newline (a kill mid-write) is cut."""
    done: set[str] = set()
    if not partial.exists():
        return done
    whole = 0
    with open(partial, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            whole += len(raw)
            meta = json.loads(raw).get("meta_info") or {}
            done.add(meta.get("id"))
    os.truncate(partial, whole)
    return done


def _generate(engine, requests: list[dict]) -> list[dict]:
    return engine.generate(input_ids=[r["input_ids"] for r in requests],
                           sampling_params=[r["sampling_params"] for r in requests],
                           rid=[r["rid"] for r in requests])


def _answers(engine, requests: list[dict]) -> list[dict]:
    try:
        return _generate(engine, requests)
    except Exception:  # one bad request fails the whole call: find it
        answers = []
        for request in requests:
            try:
                answers.extend(_generate(engine, [request]))
            except Exception as error:  # the engine's own (ValueError, ...), reported per request
                answers.append({"error": {"message": f"{type(error).__name__}: {error}"},
                                "meta_info": {"id": request["rid"]}})
        return answers


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else str(value)


def _write(out, answers: list[dict]) -> None:
    for answer in answers:
        out.write((json.dumps(answer, default=_plain) + "\n").encode("utf-8"))
    out.flush()
    os.fsync(out.fileno())


def run(engine, source: Path, output: Path, chunk: int) -> int:
    """Answers every request of SOURCE not yet in OUTPUT.partial; returns how many it sent."""
    partial = Path(f"{output}.partial")
    done, sent, pending = answered(partial), 0, []
    with open(source, encoding="utf-8") as requests, open(partial, "ab") as out:
        for line in requests:
            if not line.strip():
                continue
            request = json.loads(line)
            if request["rid"] in done:
                continue
            pending.append(request)
            if len(pending) == chunk:
                _write(out, _answers(engine, pending))
                sent, pending = sent + len(pending), []
        if pending:
            _write(out, _answers(engine, pending))
            sent += len(pending)
    os.replace(partial, output)
    return sent


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.output.exists():
        print(f"sglang_batch.py: error: {args.output}: exists", file=sys.stderr)
        return 1
    import sglang  # only here: --help works without it

    engine = sglang.Engine(model_path=args.model_path, **dict(args.engine_arg))
    try:
        sent = run(engine, args.input, args.output, max(1, args.chunk))
    finally:
        engine.shutdown()
    print(f"sglang_batch.py: {sent} requests answered; wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
