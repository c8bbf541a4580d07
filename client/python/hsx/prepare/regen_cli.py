"""The command line of regeneration: `python -m hsx.prepare requests ...` and `... responses ...`.

Exit status 0 when OUTPUT is in place, 1 on an error (one line on stderr, `hsx.prepare: error: ...`,
naming the file and line at fault), 2 on a usage error; the same files, report, resume and
summary as the chat path (cli.py, run.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .cli import _positive, _template_arg, verifier_vocab_size
from .engines import ENDPOINTS, ENGINES, Sampling
from .masking import Masker, PrepareError, load_tokenizer, tokenizer_fingerprint
from .regenerate import ON_TRUNCATED, TRUNCATED, TURNS, ReplyReader, RequestIndex, RequestMaker
from .run import ON_LONG, Options, Run, Stats

COMMANDS = ("requests", "responses")

REQUESTS = """\
Writes one request per turn to regenerate (id ID#turnK, K the index of the assistant message in the
conversation) in the format ENGINE's offline runner reads: vllm, a `vllm run-batch` input line
(/v1/completions with the prompt as token ids, the default, needs vLLM >= 0.34.0; --endpoint
chat-completions sends the messages instead, for older vLLM); sglang, a GenerateReqInput
{"rid", "input_ids", "sampling_params"} as sglang.Engine.generate and POST /generate take it (run it
with hsx/prepare/sglang_batch.py). The prompt ids are the chat template's rendering of the messages
before the turn with the generation prompt, tokenized as apply_chat_template(..., tokenize=True)
does. The turns: every assistant message, and the answer a conversation ending with a user or tool
message waits for; --turns last only the last of them. Sampling defaults to greedy (temperature 0),
which is what makes acceptance estimates exact later; a parameter not given is left to the engine
(often the model's generation_config.json). Reference: docs/prepare.md."""

RESPONSES = """\
Reads ENGINE's outputs for a requests file written by `hsx.prepare requests` and writes hsx-dump's
input: per answered request, the prompt ids and the generated ids exactly as the engine returns them,
masked on the generated ids only (id: the request's id). The prompt ids the engine reports must be the
request's (an error naming both files and lines). A chat completion without token ids is rendered
with MODEL's template (text, reasoning, tool calls as the assistant message). Engine errors,
generations cut at the token limit (finish_reason length) and requests without an answer are listed
in OUTPUT.report.jsonl and counted. Resumable: rerun the same command. Reference: docs/prepare.md."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strict", action="store_true",
                   help="anything that would be skipped and listed in OUTPUT.report.jsonl is an error instead")
    p.add_argument("--chat-template", metavar="FILE", type=Path,
                   help="use this Jinja chat template instead of the model directory's own")
    p.add_argument("--template-arg", type=_template_arg, action="append", default=[], metavar="KEY=JSON",
                   help="a variable passed to the chat template, e.g. thinking=false (repeatable)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a tokenizer implemented by Python files in MODEL_DIR; that code runs in this process")
    p.add_argument("--checkpoint-every", type=_positive, default=1000, metavar="N",
                   help="write the resume journal every N input lines (default 1000)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _requests_parser(sub) -> None:
    p = sub.add_parser("requests", description=REQUESTS, formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="chat conversations -> an engine's batch requests, one per turn")
    p.add_argument("--model", required=True, metavar="MODEL_DIR", help="local model directory (tokenizer, template)")
    p.add_argument("--input", required=True, metavar="CHATS.jsonl",
                   help="chat conversations, as hsx.prepare reads them")
    p.add_argument("--output", required=True, metavar="REQUESTS.jsonl", help="the requests to write (must not exist)")
    p.add_argument("--engine", required=True, choices=ENGINES, help="the runner the requests are for")
    p.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="completions",
                   help="vllm only: completions (token-id prompts; vLLM >= 0.34.0 runs them in run-batch) or "
                        "chat-completions (messages, rendered by vLLM's own template) (default: completions)")
    p.add_argument("--turns", choices=TURNS, default="all", help="regenerate every turn or the last one (default all)")
    p.add_argument("--max-new-tokens", required=True, type=_positive, metavar="N",
                   help="the most tokens the engine generates per turn (required: the right limit depends on "
                        "the model; a reasoning model needs tens of thousands)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy decoding")
    p.add_argument("--top-p", type=float, help="nucleus sampling (default: the engine's)")
    p.add_argument("--top-k", type=int, help="top-k sampling (default: the engine's)")
    p.add_argument("--seed", type=int, help="per-request sampling seed (vllm: seed; sglang: sampling_seed)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="a token id that ends the generation, besides the model's own (repeatable)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help='vllm only: the body\'s "model" (default: none, vLLM answers with the model it serves)')
    _common(p)


def _responses_parser(sub) -> None:
    p = sub.add_parser("responses", description=RESPONSES, formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="an engine's outputs -> hsx-dump input rows")
    p.add_argument("--engine", required=True, choices=ENGINES, help="the runner that wrote OUTPUTS")
    p.add_argument("--requests", required=True, metavar="REQUESTS.jsonl", help="what `hsx.prepare requests` wrote")
    p.add_argument("--input", required=True, metavar="OUTPUTS.jsonl", help="the engine's output file")
    p.add_argument("--output", required=True, metavar="OUT.jsonl", help="hsx-dump input to write (must not exist)")
    p.add_argument("--model", required=True, metavar="MODEL_DIR",
                   help="the model the requests were made for: its vocab_size (OUTPUT.freq.json, and every id "
                        "is checked below it) and, for chat completions, its template")
    p.add_argument("--on-truncated", choices=ON_TRUNCATED, default="keep",
                   help="a generation the engine cut at --max-new-tokens (finish_reason length): keep it (its "
                        "tokens are still the model's own) or drop it; either way listed and counted (default keep)")
    p.add_argument("--max-tokens", type=_positive, metavar="N", help="longest row written, in tokens (default: none)")
    p.add_argument("--on-long", choices=ON_LONG, default="truncate", help="a row over --max-tokens (default truncate)")
    p.add_argument("--count-all-tokens", action="store_true",
                   help="count every token in OUTPUT.freq.json, not only the generated ones")
    _common(p)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hsx.prepare", description="Regeneration with vLLM or SGLang: "
                                "requests, then the engine's batch run, then responses.")
    sub = p.add_subparsers(dest="command", required=True)
    _requests_parser(sub)
    _responses_parser(sub)
    return p


def _tokenizer(args):
    template = None
    if args.chat_template is not None:
        try:
            template = args.chat_template.read_text(encoding="utf-8")
        except OSError as error:
            raise PrepareError(f"{args.chat_template}: {error.strerror}") from None
    for path in (args.input, *([args.requests] if args.command == "responses" else [])):
        if not os.path.isfile(path):
            raise PrepareError(f"{path}: no such file")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise PrepareError(f"{args.output}: its directory does not exist")
    return load_tokenizer(args.model, args.trust_remote_code, template)


def _options(args, **more) -> Options:
    return Options(input=Path(args.input), output=Path(args.output), strict=args.strict,
                   checkpoint_every=args.checkpoint_every, progress=not args.no_progress, **more)


def _settings(args, tokenizer, **more) -> dict:
    return {"command": args.command, "input": os.path.realpath(args.input), "model": os.path.realpath(args.model),
            "tokenizer": tokenizer_fingerprint(tokenizer), "engine": args.engine, "strict": args.strict,
            "template_args": dict(args.template_arg), **more}


def requests(args) -> tuple[Stats, str]:
    if args.engine != "vllm" and (args.endpoint != "completions" or args.served_model_name):
        raise PrepareError("--endpoint and --served-model-name are for --engine vllm")
    tokenizer = _tokenizer(args)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed,
                        list(args.stop), list(args.stop_token_id))
    maker = RequestMaker(Masker(tokenizer, dict(args.template_arg)), args.engine, sampling, args.turns,
                         ENDPOINTS[args.endpoint], args.served_model_name)
    settings = _settings(args, tokenizer, endpoint=args.endpoint, turns=args.turns, sampling=sampling.settings(),
                         served_model_name=args.served_model_name)
    stats = Run(_options(args), maker.line, settings, None, frequencies=False).run()
    parts = [f"{n} skipped ({reason})" for reason, n in sorted(stats.skipped.items())] or ["none skipped"]
    return stats, (f"hsx.prepare: wrote {stats.written} {args.engine} requests ({stats.tokens} prompt tokens) to "
                   f"{args.output}; {', '.join(parts)}; listed in {args.output}.report.jsonl")


def responses(args) -> tuple[Stats, str]:
    tokenizer = _tokenizer(args)
    vocab_size = verifier_vocab_size(args.model, tokenizer)
    index = RequestIndex(Path(args.requests), args.engine)
    maskers: dict[str, Masker] = {}

    def masker(template_args):
        merged = {**dict(args.template_arg), **template_args}
        key = json.dumps(merged, sort_keys=True)
        return maskers.setdefault(key, Masker(tokenizer, merged))

    reader = ReplyReader(args.engine, index, Path(args.input), masker, vocab_size, args.on_truncated)
    settings = _settings(args, tokenizer, requests=os.path.realpath(args.requests), requests_xxh64=index.digest,
                         vocab_size=vocab_size, on_truncated=args.on_truncated, max_tokens=args.max_tokens,
                         on_long=args.on_long, count_all_tokens=args.count_all_tokens)
    options = _options(args, max_tokens=args.max_tokens, on_long=args.on_long, count_all_tokens=args.count_all_tokens)
    stats = Run(options, reader.line, settings, vocab_size, trailer=reader.missing).run()
    return stats, summary(args, stats)


def summary(args, stats: Stats) -> str:
    cut = stats.kept.get(TRUNCATED, 0) + stats.skipped.get(TRUNCATED, 0)
    parts = [f"{cut} generations truncated by the engine (finish_reason length; "
             f"{'kept' if args.on_truncated == 'keep' else 'dropped'})"]
    parts += [f"{n} skipped ({reason})" for reason, n in sorted(stats.skipped.items()) if reason != TRUNCATED]
    parts += [f"{stats.truncated} truncated", f"{stats.dropped} dropped"]
    limit = f" (--max-tokens {args.max_tokens})" if args.max_tokens else ""
    return (f"hsx.prepare: wrote {stats.written} samples, {stats.tokens} tokens ({stats.masked} masked) to "
            f"{args.output}; {', '.join(parts)}{limit}; listed in {args.output}.report.jsonl")


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        stats, line = (requests if args.command == "requests" else responses)(args)
    except PrepareError as error:
        print(f"hsx.prepare: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hsx.prepare: interrupted; rerun the same command to continue", file=sys.stderr)
        return 130
    print(line, file=sys.stderr)
    return 0
