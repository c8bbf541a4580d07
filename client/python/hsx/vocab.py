"""python -m hsx.vocab --frequencies F [F ...] --draft-vocab-size N --format FMT --out PATH

Owns the draft vocabulary of an EAGLE-3 draft model: which N target tokens the
draft predicts, chosen from token frequencies, written as the d2t/t2d mapping in
the file layout each trainer loads:

  speculators  OUT is a directory (e.g. the prepared data path, where
               `speculators train` looks by default): OUT/d2t-{N}.npy int64 [N] and
               OUT/t2d-{N}.npy bool [V] (numpy .npy; --d2t-path/--t2d-path)
  specforge    OUT is a file (e.g. vocab_mapping.pt): torch.save of
               {"d2t": int64 [N], "t2d": bool [V]} (the draft model's load_vocab_mapping)
  modelopt     OUT is a file (e.g. d2t.pt): torch.save of the int64 [N] d2t tensor alone
               (data.draft_vocab_cache; ModelOpt derives the rest from d2t)

In all three, d2t holds offsets: draft token i is target token i + d2t[i]; t2d[t]
is true exactly for the N chosen target ids. The chosen ids are in ascending
order, so d2t is non-decreasing and non-negative.

Selection: the N target tokens with the highest counts, ties broken by the lower
token id. When fewer than N distinct tokens were seen, the rest are the lowest
token ids not seen (0, 1, 2, ...), and the command says how many it padded.

Input: one or more token-frequency files (python -m hsx.prepare writes
<OUTPUT>.freq.json; one per shard with --shard I/N), each a JSON object

  {"format": "hsx-token-frequencies/1", "vocab_size": V, "scope": "assistant" | "all",
   "samples": S, "tokens": T, "counts": [[token_id, count], ...]}

with counts sorted by token id, strictly ascending (no duplicates), only non-zero
counts, 0 <= token_id < V, and T the sum of the counts (the tokens counted in the
scope). Several files are summed; they must agree on V and scope. Anything else
is refused with a message naming the file and the entry, and nothing is written.

Writing is atomic per file: each file is written beside its final name
(.NAME.XXXXXXXX.partial), fsynced and renamed over it (an existing mapping is
replaced); for speculators both files are written before either is renamed. A
failed write, fsync or rename (a full disk: "no space left on device") is one
line naming the file, what OUT holds now (nothing new, the previous mapping
unchanged, or which file was replaced) and that a rerun of the same command
writes the mapping anew; no temporary is left.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import atomic

FORMAT_TAG = "hsx-token-frequencies/1"
SCOPES = ("assistant", "all")
FORMATS = ("speculators", "specforge", "modelopt")


class VocabError(ValueError):
    """Frequencies that cannot be used, or a draft size that cannot be met; the message names the file."""


@dataclass
class Frequencies:
    """Token counts over a target vocabulary (one file, or several summed)."""

    vocab_size: int
    scope: str
    samples: int
    tokens: int
    counts: dict[int, int]


@dataclass
class Mapping:
    """The chosen target ids (ascending) and the two tensors every trainer's format derives from."""

    target_ids: np.ndarray  # int64 [N], ascending
    d2t: np.ndarray  # int64 [N]: target id - draft index
    t2d: np.ndarray  # bool [V]
    padded: int  # how many ids were taken from unseen tokens
    covered: int  # the counts of the chosen ids, summed


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(data: dict, key: str, where: str, minimum: int) -> int:
    value = data.get(key)
    if not _is_int(value) or value < minimum:
        raise VocabError(f"{where}: {key!r} must be an integer >= {minimum}, not {value!r}")
    return value


def _counts(entries: object, vocab_size: int, where: str) -> dict[int, int]:
    """The "counts" list, checked: [id, count] pairs, ids in range and strictly ascending, counts >= 1."""
    if not isinstance(entries, list):
        raise VocabError(f"{where}: 'counts' must be a list of [token_id, count] pairs")
    counts: dict[int, int] = {}
    previous = -1
    for k, entry in enumerate(entries):
        at = f"{where}: counts[{k}]"
        if not (isinstance(entry, list) and len(entry) == 2 and all(_is_int(v) for v in entry)):
            raise VocabError(f"{at}: must be a pair of integers [token_id, count], not {entry!r}")
        token, count = entry
        if not 0 <= token < vocab_size:
            raise VocabError(f"{at}: token id {token} is out of range (vocab_size {vocab_size})")
        if count < 1:
            raise VocabError(f"{at}: count {count} for token {token} (only non-zero counts are listed)")
        if token == previous:
            raise VocabError(f"{at}: token id {token} listed twice")
        if token < previous:
            raise VocabError(f"{at}: token id {token} after {previous} (counts must be sorted by token id)")
        counts[token] = count
        previous = token
    return counts


def read_frequencies(path: str | os.PathLike) -> Frequencies:
    """One token-frequency file, checked against the format (module docstring)."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise VocabError(f"{where}: cannot read ({error.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise VocabError(f"{where}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise VocabError(f"{where}: not a JSON object")
    if data.get("format") != FORMAT_TAG:
        raise VocabError(f"{where}: 'format' is {data.get('format')!r}, expected {FORMAT_TAG!r}")
    vocab_size = _field(data, "vocab_size", where, 1)
    if data.get("scope") not in SCOPES:
        raise VocabError(f"{where}: 'scope' is {data.get('scope')!r}, expected one of {', '.join(SCOPES)}")
    samples = _field(data, "samples", where, 0)
    tokens = _field(data, "tokens", where, 0)
    counts = _counts(data.get("counts"), vocab_size, where)
    if sum(counts.values()) != tokens:
        raise VocabError(f"{where}: 'tokens' is {tokens} but the counts sum to {sum(counts.values())}")
    return Frequencies(vocab_size, data["scope"], samples, tokens, counts)


def sum_frequencies(paths: Sequence[str | os.PathLike]) -> Frequencies:
    """Several files (e.g. one per shard) summed; they must agree on vocab_size and scope."""
    if not paths:
        raise VocabError("no frequency file given")
    total = read_frequencies(paths[0])
    for path in paths[1:]:
        part = read_frequencies(path)
        for key in ("vocab_size", "scope"):
            if getattr(part, key) != getattr(total, key):
                raise VocabError(f"{path}: {key!r} is {getattr(part, key)!r}, but {paths[0]} has "
                                 f"{getattr(total, key)!r} (files to sum must agree)")
        total.samples += part.samples
        total.tokens += part.tokens
        for token, count in part.counts.items():
            total.counts[token] = total.counts.get(token, 0) + count
    return total


def select(freq: Frequencies, draft_vocab_size: int) -> Mapping:
    """The top-N target ids by count (ties: lower id first), padded with the lowest unseen ids, ascending."""
    n, vocab = draft_vocab_size, freq.vocab_size
    if n < 1:
        raise VocabError(f"--draft-vocab-size must be at least 1, not {n}")
    if n > vocab:
        raise VocabError(f"--draft-vocab-size {n} is larger than the target vocabulary ({vocab} tokens)")
    ranked = sorted(freq.counts, key=lambda token: (-freq.counts[token], token))
    chosen = ranked[:n]
    padded = 0
    if len(chosen) < n:
        seen = set(chosen)
        missing = n - len(chosen)
        for token in range(vocab):
            if padded == missing:
                break
            if token not in seen:
                chosen.append(token)
                padded += 1
    target_ids = np.array(sorted(chosen), dtype=np.int64)
    t2d = np.zeros(vocab, dtype=np.bool_)
    t2d[target_ids] = True
    covered = sum(freq.counts.get(int(t), 0) for t in target_ids)
    return Mapping(target_ids, target_ids - np.arange(n, dtype=np.int64), t2d, padded, covered)


def _torch_writer(obj_factory: Callable[[], object]) -> Callable[[object], None]:
    def write(sink) -> None:
        import torch  # only the .pt formats need torch
        torch.save(obj_factory(), sink)  # into a file object: hsx.atomic sees the OSError behind a failure
    return write


def _npy_writer(array: np.ndarray) -> Callable[[object], None]:
    def write(sink) -> None:
        np.save(sink, array)  # through sink.write, not tofile, whose short write has no errno
    return write


def output_files(fmt: str, out: str | os.PathLike, draft_vocab_size: int) -> list[Path]:
    """The files `fmt` writes for OUT."""
    out = Path(out)
    if fmt == "speculators":
        return [out / f"d2t-{draft_vocab_size}.npy", out / f"t2d-{draft_vocab_size}.npy"]
    return [out]


def write_mapping(mapping: Mapping, fmt: str, out: str | os.PathLike) -> list[Path]:
    """Writes `mapping` in trainer format `fmt` at OUT (module docstring); returns the files written."""
    out = Path(out)
    n = len(mapping.d2t)
    if fmt not in FORMATS:
        raise VocabError(f"unknown format {fmt!r} (expected one of {', '.join(FORMATS)})")
    if fmt == "speculators":
        if out.exists() and not out.is_dir():
            raise VocabError(f"{out}: exists and is not a directory (speculators' OUT is a directory)")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise VocabError(f"{out}: {atomic.reason(error)}; no mapping was written") from None
        writers = [_npy_writer(mapping.d2t), _npy_writer(mapping.t2d)]
    else:
        if out.is_dir():
            raise VocabError(f"{out}: is a directory ({fmt}'s OUT is a file)")
        if not out.parent.is_dir():
            raise VocabError(f"{out.parent}: no such directory")
        if fmt == "specforge":
            writers = [_torch_writer(lambda: _torch_pair(mapping))]
        else:
            writers = [_torch_writer(lambda: _torch_tensor(mapping.d2t))]
    finals = output_files(fmt, out, n)
    _write_all(writers, finals)
    return finals


def _temporary(final: Path) -> Path:
    """A new name beside `final` (.NAME.XXXXXXXX.partial), created exclusively."""
    try:
        fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
    except OSError as error:
        raise atomic.WriteFailed(final, error) from None
    os.close(fd)
    return Path(name)


def _write_all(writers: list[Callable[[object], None]], finals: list[Path]) -> None:
    """Stages every file (written and fsynced under a temporary name), then renames each
    over its final name. A failed write, fsync or rename is a VocabError saying what OUT
    holds now; no temporary is left."""
    existed = [final.exists() for final in finals]
    staged: list[Path] = []
    replaced: list[Path] = []
    try:
        for write, final in zip(writers, finals):
            staged.append(_temporary(final))
            atomic.stage(final, write, staged[-1])
        for temporary, final in zip(staged, finals):
            atomic.commit(temporary, final)
            replaced.append(final)
    except atomic.WriteFailed as failed:
        if failed.renamed:
            replaced.append(failed.path)
        raise VocabError(_write_failure(failed, finals, replaced, existed)) from None
    finally:
        for temporary in staged:  # gone when renamed; stage and commit remove theirs on failure
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)


def _write_failure(failed: atomic.WriteFailed, finals: list[Path], replaced: list[Path],
                   existed: list[bool]) -> str:
    """The one line for a failed write: the file and the strerror, what OUT holds now, and the rerun."""
    if replaced:
        rest = [final for final in finals if final not in replaced]
        kept = (f"{' and '.join(map(str, replaced))} was replaced but {' and '.join(map(str, rest))} was not: "
                "the files do not belong together")
    elif any(existed):
        kept = f"the previous mapping ({', '.join(str(f) for f, e in zip(finals, existed) if e)}) is unchanged"
    else:
        kept = "no mapping was written"
    room = "free some space and " if failed.error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return f"{failed}; {kept}; {room}rerun the same command: it writes the mapping anew"


def _torch_tensor(array: np.ndarray) -> object:
    import torch
    return torch.from_numpy(array.copy())


def _torch_pair(mapping: Mapping) -> dict:
    return {"d2t": _torch_tensor(mapping.d2t), "t2d": _torch_tensor(mapping.t2d)}


def build(frequencies: Sequence[str | os.PathLike], draft_vocab_size: int, fmt: str,
          out: str | os.PathLike) -> tuple[Mapping, Frequencies, list[Path]]:
    """Reads and sums `frequencies`, selects, writes; the library form of the command."""
    freq = sum_frequencies(frequencies)
    mapping = select(freq, draft_vocab_size)
    return mapping, freq, write_mapping(mapping, fmt, out)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hsx.vocab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frequencies", required=True, nargs="+", metavar="F",
                        help="token-frequency file(s) (<OUTPUT>.freq.json from python -m hsx.prepare); "
                             "several (one per --shard I/N) are summed")
    parser.add_argument("--draft-vocab-size", required=True, type=int, metavar="N",
                        help="how many target tokens the draft predicts (1 <= N <= vocab_size); "
                             "e.g. 32000 for a 163840-token Kimi-K2 verifier")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="the trainer whose file layout to write (see above)")
    parser.add_argument("--out", required=True, metavar="PATH",
                        help="speculators: a directory (created if missing) that receives "
                             "d2t-{N}.npy and t2d-{N}.npy; specforge, modelopt: the .pt file to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command; prints one summary line, or one error line on stderr and returns 1."""
    args = _parser().parse_args(argv)
    try:
        mapping, freq, files = build(args.frequencies, args.draft_vocab_size, args.format, args.out)
    except VocabError as error:
        print(f"hsx.vocab: {error}", file=sys.stderr)
        return 1
    n = len(mapping.d2t)
    share = 100.0 * mapping.covered / freq.tokens if freq.tokens else 0.0
    if mapping.padded:
        print(f"hsx.vocab: only {n - mapping.padded} distinct tokens were seen; padded with the "
              f"{mapping.padded} lowest unseen token ids", file=sys.stderr)
    print(f"wrote {', '.join(map(str, files))}: {n} of {freq.vocab_size} target tokens, covering "
          f"{share:.2f}% of {freq.tokens} counted tokens (scope {freq.scope}, {freq.samples} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
