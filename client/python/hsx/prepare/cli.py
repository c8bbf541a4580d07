"""The command line of hsx.prepare (python -m hsx.prepare, hsx-prepare): flags, the summary, exit codes.

Exit status 0 when OUTPUT is in place, 1 on an error (one line on stderr,
`hsx.prepare: error: ...`, naming the file and line at fault), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..shard import shard_arg
from ..model_config import language_config
from . import limits
from .masking import Masker, PrepareError, load_tokenizer, tokenizer_fingerprint
from .rows import ROWS, RowMaker
from .run import ON_LONG, Options, Run, Stats

DESCRIPTION = """\
Renders chat conversations with a model's own tokenizer and chat template and writes hsx-dump's
input: one {"input_ids": [...], "loss_mask": [...], "id": ...} per line, the mask 1 on the tokens
of assistant messages only. Every row is checked to hold what each assistant message holds
(content, reasoning_content, tool calls); a conversation the template would lose some of is written
one row per assistant turn at its generation boundary (ids "ID#turnK") or skipped and reported,
never written as if nothing happened (--rows). Input layouts (per line): ShareGPT {"conversations": [{"from",
"value"}]}, OpenAI {"messages": [{"role", "content", "tool_calls"?, ...}], "tools"?}, or
{"prompt", "response", "system"?}. Sample id: the line's "id" (string or integer), else
"sha256:" + 16 hex digits of the SHA-256 of the line's canonical JSON. Beside OUTPUT:
OUTPUT.report.jsonl (every skipped, dropped or truncated sample) and OUTPUT.freq.json (token
frequencies). Resumable: after a kill, rerun the same command. Reference: docs/prepare.md.

Regeneration (the target model answers each prompt itself, with vLLM or SGLang):
  python -m hsx.prepare requests --help     conversations -> the engine's batch requests
  python -m hsx.prepare responses --help    the engine's outputs -> hsx-dump input"""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _template_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--template-arg {text!r}: expected KEY=JSON, e.g. thinking=false")
    try:
        return key, json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--template-arg {text!r}: the value is not JSON") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hsx.prepare", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="MODEL_DIR",
                   help="local model directory holding the tokenizer and its chat template (never downloaded)")
    p.add_argument("--input", required=True, metavar="CHATS.jsonl", help="chat conversations, one JSON object a line")
    p.add_argument("--output", required=True, metavar="OUT.jsonl",
                   help="hsx-dump input to write; must not exist (unless an interrupted run is being resumed)")
    p.add_argument("--max-tokens", type=_positive, metavar="N",
                   help="longest sample written, in tokens; longer ones are handled by --on-long (default: no limit)")
    p.add_argument("--on-long", choices=ON_LONG, default="truncate",
                   help="a sample over --max-tokens: truncate keeps its first N tokens (dropped if none of them "
                        "is an assistant token), drop leaves it out, error stops the run; each truncated or "
                        "dropped sample is listed in OUTPUT.report.jsonl (default: truncate)")
    p.add_argument("--shard", type=shard_arg, default=(0, 1), metavar="I/N",
                   help="process only input lines whose 1-based number L has (L-1) %% N == I (default 0/1)")
    p.add_argument("--rows", choices=ROWS, default="auto",
                   help="auto: one row per conversation where the template is append-only for it and drops "
                        "nothing the assistant wrote, else one row per assistant turn (each listed in "
                        "OUTPUT.report.jsonl with why); packed: one row or skipped; per-turn: always one row per "
                        "assistant turn: the prompt the template gives at inference, then the completion, "
                        "masked on the completion only, id ID#turnK (default: auto)")
    p.add_argument("--strict", action="store_true",
                   help="a conversation or turn that would be skipped (no assistant message, a template that "
                        "drops a field of a message or renders earlier turns differently once later ones follow, "
                        "where --rows cannot help) is an error instead")
    p.add_argument("--count-all-tokens", action="store_true",
                   help="count every token in OUTPUT.freq.json, not only the assistant (loss-mask 1) tokens")
    p.add_argument("--chat-template", metavar="FILE", type=Path,
                   help="use this Jinja chat template instead of the model directory's own")
    p.add_argument("--template-arg", type=_template_arg, action="append", default=[], metavar="KEY=JSON",
                   help="a variable passed to the chat template, e.g. thinking=false (repeatable)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a tokenizer implemented by Python files in MODEL_DIR (tokenization_*.py, e.g. "
                        "Kimi's tiktoken tokenizer); that code runs in this process")
    p.add_argument("--max-line-bytes", type=_positive, default=limits.MAX_LINE_BYTES, metavar="N",
                   help="an input line longer than N bytes (its newline not counted) stops the run with its "
                        f"FILE:LINE; it is never read whole (default {limits.MAX_LINE_BYTES}, 8 MiB: a "
                        "256k-token conversation takes at most about 3 MiB)")
    p.add_argument("--max-turns", type=_positive, default=limits.MAX_TURNS, metavar="N",
                   help="a conversation of more than N messages is skipped and listed (an error under "
                        "--strict); rendering costs time quadratic in the messages (default "
                        f"{limits.MAX_TURNS})")
    p.add_argument("--max-seconds-per-conversation", type=_seconds, default=limits.MAX_SECONDS, metavar="S",
                   help="a conversation whose rendering and tokenizing takes longer is stopped, skipped and "
                        f"listed (an error under --strict) (default {limits.MAX_SECONDS:g})")
    p.add_argument("--checkpoint-every", type=_positive, default=1000, metavar="N",
                   help="write the resume journal every N samples read (lines of this shard; default 1000)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway when stderr "
                   "is not a terminal)")
    return p


def summary(output: Path, stats: Stats, options: Options) -> str:
    parts = [f"{n} written per turn ({reason})" for reason, n in sorted(stats.per_turn.items())]
    parts += [f"{stats.truncated} truncated", f"{stats.dropped} dropped"]
    parts += [f"{n} skipped ({reason})" for reason, n in sorted(stats.skipped.items())]
    limit = f" (--max-tokens {options.max_tokens})" if options.max_tokens else ""
    return (f"hsx.prepare: wrote {stats.written} samples, {stats.tokens} tokens ({stats.masked} masked) to {output}; "
            f"{', '.join(parts)}{limit}; listed in {output}.report.jsonl")


def verifier_vocab_size(model_dir: str, tokenizer) -> int:
    """The vocabulary size the frequencies are counted against: the model's own (config.json's
    `vocab_size`, or `text_config.vocab_size` for a nested config such as K2.5's, as hsx-server
    reads it: hsx.model_config.language_config), which is what
    each trainer checks a draft mapping against and is often larger than the tokenizer (padded
    embeddings); len(tokenizer) when the directory has no config.json."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return len(tokenizer)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise PrepareError(f"{path}: not readable as JSON ({error})") from None
    size = language_config(config).get("vocab_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        where = "text_config.vocab_size" if "text_config" in config else "vocab_size"
        raise PrepareError(f"{path}: no positive integer {where}")
    if size < len(tokenizer):
        raise PrepareError(f"{path}: vocab_size {size} is smaller than the tokenizer's {len(tokenizer)} ids")
    return size


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("requests", "responses"):
        from .regen_cli import main as regenerate  # imports this module's helpers

        return regenerate(argv)
    args = parser().parse_args(argv)
    try:
        template = None
        if args.chat_template is not None:
            try:
                template = args.chat_template.read_text(encoding="utf-8")
            except OSError as error:
                raise PrepareError(f"{args.chat_template}: {error.strerror}") from None
        if not os.path.isfile(args.input):
            raise PrepareError(f"{args.input}: no such file")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
            raise PrepareError(f"{args.output}: its directory does not exist")
        tokenizer = load_tokenizer(args.model, args.trust_remote_code, template)
        vocab_size = verifier_vocab_size(args.model, tokenizer)
        options = Options(input=Path(args.input), output=Path(args.output), max_tokens=args.max_tokens,
                          on_long=args.on_long, shard=args.shard, strict=args.strict,
                          count_all_tokens=args.count_all_tokens, checkpoint_every=args.checkpoint_every,
                          progress=not args.no_progress, max_line_bytes=args.max_line_bytes)
        kwargs = dict(args.template_arg)
        settings = {"input": os.path.realpath(args.input), "model": os.path.realpath(args.model),
                    "tokenizer": tokenizer_fingerprint(tokenizer), "vocab_size": vocab_size, "max_tokens": args.max_tokens,
                    "on_long": args.on_long, "shard": f"{args.shard[0]}/{args.shard[1]}", "strict": args.strict,
                    "count_all_tokens": args.count_all_tokens, "template_args": kwargs, "rows": args.rows,
                    "max_line_bytes": args.max_line_bytes, "max_turns": args.max_turns,
                    "max_seconds_per_conversation": args.max_seconds_per_conversation}
        stats = Run(options, RowMaker(Masker(tokenizer, kwargs), args.rows, args.max_turns,
                                      args.max_seconds_per_conversation).line, settings, vocab_size).run()
    except PrepareError as error:
        print(f"hsx.prepare: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hsx.prepare: interrupted; rerun the same command to continue", file=sys.stderr)
        return 130
    print(summary(options.output, stats, options), file=sys.stderr)
    return 0
