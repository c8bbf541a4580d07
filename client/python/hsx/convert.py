"""python -m hsx.convert DIR --to specforge|modelopt|speculators-legacy OUT [--shard I/N]

Rewrites an hsx-dump directory in the format another trainer reads, exactly
(keys, shapes, dtypes, pre/post-norm as each tool expects; see docs/formats.md):

  specforge           OUT/rows_{g}-{g+2000}/data_{i}.ckpt: input_ids [T], loss_mask [T],
                      hidden_state [1, T, H] (post-norm), aux_hidden_state [1, T, 3H]
  modelopt            OUT/data_{i}.pt: input_ids [T], hidden_states [T, H], aux_hidden_states [T, 3H],
                      conversation_id (the sample id, when it has one), loss_mask [T]
                      (+ hidden_states_prenorm when the post-norm state was not extracted)
  speculators-legacy  OUT/data_{i}.pt: input_ids [T], loss_mask [T], hidden_states: a list of
                      L tensors [T, H] ascending; plus sample_lengths.json and data_config.json

(speculators' current trainer reads hsx-dump's files as they are: no conversion.)

Files are named by the sample index i (the dump's hs_{i}), never by the sample
id: ids are arbitrary strings ("a/b", "..", duplicates, none at all) and cannot
safely be file names. OUT/sample_ids.jsonl maps every written file to its index
and id: {"index": i, "id": ID or null, "file": "data_{i}.pt"}; it is written
last, when every shard is done: OUT is complete exactly when it exists.

One sample at a time: each file is written beside its name, fsynced and renamed
into place, then recorded in OUT's own journal (OUT/.hsx-convert/). After a
crash or kill, the same command resumes where it stopped; the result is
byte-identical to an uninterrupted run. With --shard I/N, N processes (any
hosts sharing OUT) each convert the samples whose index % N == I (hsx-dump's
rule); the last to finish writes sample_ids.jsonl.

OUT must not exist, be empty, or be this conversion's own output (same dump,
format and shard count); anything else is refused. The dump's journal
(manifest.jsonl) says what is complete, by hsx-dump's rules: without it nothing
is; only a torn (unterminated) last line is skipped; a journal entry that does
not parse, whose file name is not a plain name in DIR, or a second entry for one
index (other than a redo's "supersedes"), is an error, and so is a journaled
file of another size. Nothing is written then.

Each file is checked against its journal entry before it is converted, as
hsx-verify checks it (hsx.journal.file_problems): the metadata's sample_index,
sample_id, capture_ids, dtype and model, the token ids' and loss mask's XXH64,
the final norm's presence, and the whole file's XXH64 (--no-digest skips that
one, a read of every byte). A file that disagrees stops the run with an error
naming the journal line, the sample's index and id, the file and what differs
(what it holds); nothing is written for it, what earlier samples wrote stays.

A failed write, fsync or rename (a full disk) stops the run with one line: the
file, the strerror ("no space left on device"), the samples converted and
journaled that are kept, and that a rerun of the same command resumes; no
temporary is left (hsx.atomic).

The auxiliary layers are the captured ids below N (three for EAGLE-3); the
target is the post-final-norm state when present (required by SpecForge).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import heapq
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash

from . import atomic
from .files import read_sample
from .journal import JournalError, complete_samples, file_problems
from .shard import in_shard, shard_arg

SPECFORGE_GROUP = 2000
IDS_FILE = "sample_ids.jsonl"
JOURNAL_DIR = ".hsx-convert"  # OUT's own journal: run.json, journal.I-of-N.jsonl, lock
RUN_FILE = "run.json"
FORMATS = ("specforge", "modelopt", "speculators-legacy")


class ConvertError(ValueError):
    """A dump that cannot be converted, or an unusable OUT; the message names the file."""


def _samples(directory: str | os.PathLike) -> list[tuple[int, Path, dict]]:
    """(index, path, journal entry) of every complete sample, in index order, over all the
    directory's journals (hsx.journal.complete_samples: the rules of docs/formats.md)."""
    try:
        return complete_samples(directory)
    except JournalError as error:
        raise ConvertError(str(error)) from None


def _split(sample, num_layers):
    """(aux [T, k*H], last_pre_norm [T, H] or None, final_norm [T, H] or None)."""
    hs = sample["hidden_states"]
    ids = sample.capture_ids
    aux_positions = [i for i, c in enumerate(ids) if c < num_layers]
    aux = torch.cat([hs[:, i] for i in aux_positions], dim=-1)
    last = hs[:, ids.index(num_layers)] if num_layers in ids else None
    return aux, last, sample.get("final_norm_hidden_states")


def _mask(sample):
    ids = sample["token_ids"]
    return sample["loss_mask"].clone() if "loss_mask" in sample else torch.ones_like(ids)


def _record(target, index, path, sample):
    """(relative file name, record) of one sample in `target`'s format."""
    try:
        num_layers = int(sample.metadata["num_layers"])
    except (KeyError, ValueError):
        raise ConvertError(f"{path}: metadata 'num_layers' is missing or not an integer") from None
    input_ids = sample["token_ids"].clone()
    if target == "specforge":
        aux, _, final = _split(sample, num_layers)
        if final is None:
            raise ConvertError(f"{path}: SpecForge needs the post-norm state; dump with --final-norm")
        group = index // SPECFORGE_GROUP * SPECFORGE_GROUP
        return (f"rows_{group}-{group + SPECFORGE_GROUP}/data_{index}.ckpt",
                {"input_ids": input_ids, "loss_mask": _mask(sample),
                 "hidden_state": final.clone().unsqueeze(0), "aux_hidden_state": aux.unsqueeze(0)})
    if target == "modelopt":
        aux, last, final = _split(sample, num_layers)
        record = {"input_ids": input_ids, "aux_hidden_states": aux, "loss_mask": _mask(sample)}
        if "sample_id" in sample.metadata:
            record["conversation_id"] = sample.metadata["sample_id"]
        if final is not None:
            record["hidden_states"] = final.clone()
        elif last is not None:
            record["hidden_states"] = last.clone()
            record["hidden_states_prenorm"] = True
        else:
            raise ConvertError(f"{path}: ModelOpt needs capture id N or the final norm")
        return f"data_{index}.pt", record
    if target == "speculators-legacy":
        hs = sample["hidden_states"]
        return (f"data_{index}.pt", {"input_ids": input_ids, "loss_mask": _mask(sample),
                                     "hidden_states": [hs[:, i].clone() for i in range(hs.shape[1])]})
    raise ConvertError(f"unknown format {target!r}")


# --- OUT: written in place, one file at a time, resumable from its own journal.

class _Bar:
    """Stands in for tqdm where it is not installed or not wanted."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, initial: int, enabled: bool):
    """A tqdm bar on stderr (hidden when stderr is not a terminal); none without tqdm."""
    if enabled:
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm comes with hsx[prepare]; the conversion does not need it
            return _Bar()
        return tqdm(total=total, initial=initial, unit="sample", desc="hsx.convert", disable=None,
                    dynamic_ncols=True)
    return _Bar()


def _write_atomic(dest: Path, write) -> int:
    """Writes `dest` through write(file) beside it (.NAME.partial), fsyncs, renames it over
    `dest` and fsyncs the directory (hsx.atomic); returns its size. The temporary name is
    fixed: one process per shard, and each sample belongs to one shard. A failed write is
    atomic.WriteFailed, with the temporary removed."""
    return atomic.write_atomic(dest, write)


class _Out:
    """OUT and its journal directory OUT/.hsx-convert/: run.json (format, shard
    count, layer ids), journal.I-of-N.jsonl (a header naming shard I's samples,
    one line per converted sample, then {"done": count}), lock."""

    def __init__(self, out: Path, run: dict[str, Any], shard: tuple[int, int]):
        self.out, self.run, self.shard = out, run, shard
        self.meta = out / JOURNAL_DIR
        self.journal = self.meta / f"journal.{shard[0]}-of-{shard[1]}.jsonl"

    def claim(self) -> None:
        """Refuses an OUT that is neither empty nor this conversion's (same dump,
        format and shard count), so two conversions never mix; records run.json."""
        out = self.out
        if out.is_symlink() or (out.exists() and not out.is_dir()):
            raise ConvertError(f"{out}: exists and is not a directory")
        ours = (self.meta / RUN_FILE).is_file()
        if not ours and out.is_dir() and any(p.name != JOURNAL_DIR for p in out.iterdir()):
            raise ConvertError(f"{out}: not empty (and not a resumable hsx.convert output); "
                               "convert into a new directory")
        self.meta.mkdir(parents=True, exist_ok=True)
        with self.locked():
            path = self.meta / RUN_FILE
            if path.is_file():
                theirs = json.loads(path.read_text())
                if theirs != self.run:
                    keys = sorted(k for k in set(theirs) | set(self.run) if theirs.get(k) != self.run.get(k))
                    raise ConvertError(f"{out}: holds another conversion ({path.name} differs in "
                                       f"{', '.join(keys)}: {[theirs.get(k) for k in keys]} there, "
                                       f"{[self.run.get(k) for k in keys]} here); convert into a new directory")
            else:
                _write_atomic(path, lambda f: f.write((json.dumps(self.run, indent=1) + "\n").encode()))

    @contextlib.contextmanager
    def locked(self):
        with open(self.meta / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def resume(self, header: dict[str, Any]) -> tuple[set[int], bool, bool]:
        """(indices this shard's journal records, whether it says done, whether it has
        its header line); truncates a torn last line (a killed append); refuses a
        journal of another dump (its header line); checks each recorded file's size."""
        data = self.journal.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            try:
                with open(self.journal, "r+b") as f:
                    f.truncate(len(complete))
                    os.fsync(f.fileno())
            except OSError as error:
                raise atomic.WriteFailed(self.journal, error) from None
        done, finished, lines = set(), False, complete.decode("utf-8", errors="replace").splitlines()
        for number, line in enumerate(lines, start=1):
            where = f"{self.journal}:{number}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                raise ConvertError(f"{where}: corrupt journal line; convert into a new directory") from None
            if number == 1 and entry != header:
                raise ConvertError(f"{where}: shard {self.shard[0]}/{self.shard[1]} of {self.out} was begun on "
                                   f"another dump ({entry} there, {header} here); convert into a new directory")
            if "index" not in entry:
                finished |= "done" in entry
                continue
            path = self.out / entry["file"]
            if not path.is_file() or path.stat().st_size != entry["bytes"]:
                raise ConvertError(f"{path}: missing or not the {entry['bytes']} bytes {where} records; "
                                   "convert into a new directory")
            done.add(entry["index"])
        return done, finished, bool(lines)

    def lines(self, shard_index: int):
        """The sample lines of one shard's journal, in index order."""
        path = self.meta / f"journal.{shard_index}-of-{self.shard[1]}.jsonl"
        with open(path, encoding="utf-8") as f:
            for line in f:
                entry = json.loads(line)
                if "index" in entry:
                    yield entry

    def all_done(self) -> list[int]:
        """The shards whose journals do not yet say done."""
        pending = []
        for i in range(self.shard[1]):
            path = self.meta / f"journal.{i}-of-{self.shard[1]}.jsonl"
            last = path.read_bytes().splitlines()[-1:] if path.is_file() else []
            if not (last and last[0].startswith(b'{"done": ')):
                pending.append(i)
        return pending

    def finish(self, target: str) -> None:
        """Writes sample_ids.jsonl (last: its presence means OUT is complete) and,
        for speculators-legacy, sample_lengths.json and data_config.json, merging
        the shards' journals in index order (one line in memory per shard)."""
        merged = lambda: heapq.merge(*(self.lines(i) for i in range(self.shard[1])),  # noqa: E731
                                     key=lambda e: e["index"])
        if target == "speculators-legacy":
            count = 0

            def lengths(f):
                nonlocal count
                f.write(b"{")
                for count, e in enumerate(merged(), start=1):
                    f.write(f'{", " if count > 1 else ""}{json.dumps(str(e["index"]))}: {e["tokens"]}'.encode())
                f.write(b"}")
            _write_atomic(self.out / "sample_lengths.json", lengths)
            config = {"version": "2.0", "generator": "hsx", "layer_ids": self.run["layer_ids"],
                      "file_pattern": "data_{idx}.pt", "num_samples": count,  # counted in the pass above
                      "schema": {"input_ids": "int64 [T]", "loss_mask": "int64 [T]",
                                 "hidden_states": "list of [T, H] tensors, ascending layer id"}}
            _write_atomic(self.out / "data_config.json", lambda f: f.write(json.dumps(config, indent=1).encode()))

        def ids(f):
            for e in merged():
                f.write((json.dumps({"index": e["index"], "id": e["id"], "file": e["file"]}) + "\n").encode())
        _write_atomic(self.out / IDS_FILE, ids)


def _append(journal, entry: dict[str, Any]) -> None:
    """One journal line, durable before the next step (written whole, or torn where the write
    failed: resume() truncates a torn last line)."""
    atomic.append_line(journal.fileno(), (json.dumps(entry) + "\n").encode(), Path(journal.name))


def _digest(samples: list[tuple[int, Path, dict]]) -> str:
    """Identifies the dump's list of complete samples (index, file, size: the journaled size,
    which complete_samples checked against the file)."""
    h = xxhash.xxh64()
    for index, path, entry in samples:
        h.update(f"{index}\t{path.name}\t{entry['bytes']}\n".encode())
    return h.hexdigest()


def _read(index: int, path: Path, entry: dict, digest: bool):
    """The sample file, checked against its journal entry first (hsx.journal.file_problems:
    what hsx-verify checks; the whole file's XXH64 with `digest`)."""
    try:
        sample = read_sample(path, torch=True)
        problems = file_problems(path, entry, sample, digest=digest)
    except (OSError, ValueError, KeyError) as error:
        raise ConvertError(f"{path}: cannot read: {error}") from None
    if problems:
        raise ConvertError(f"{entry.where}: sample {index} (id {entry['id']!r}) is journaled as {path}, but that file "
                           f"disagrees: {'; '.join(problems)}")
    return sample


def _plan(directory, target: str, shard: tuple[int, int]):
    """(run.json's content, the shard journal's header line, this shard's samples):
    the dump's journal is checked and the shard's first sample checked against its
    entry (all but the digest) and converted in memory before anything is written.
    The header identifies the shard's samples (index, file, size), so each shard may
    come from its own dump directory (hsx-dump --shard I/N --out DIR-I) or all from one."""
    if target not in FORMATS:
        raise ConvertError(f"unknown format {target!r}")
    samples = _samples(directory)
    mine = [sample for sample in samples if in_shard(sample[0], shard)]
    if mine:
        try:  # the format's needs, checked once; the digest waits for the loop (one read of the file)
            _record(target, mine[0][0], mine[0][1], _read(*mine[0], digest=False))
        except ConvertError as error:
            raise ConvertError(f"{error}; nothing was written") from None
    run = {"format": "hsx-convert/1", "to": target, "shards": shard[1],
           "layer_ids": samples[0][2]["capture_ids"] if samples else []}
    return run, {"dump_xxh64": _digest(mine), "samples": len(mine)}, mine


class Result(int):
    """convert()'s count (the samples of this shard in OUT), with .complete: whether
    OUT holds every shard (sample_ids.jsonl written) and .pending: the shards not done."""

    complete: bool
    pending: list[int]


def _kept(mine: list, done: set[int], shard: tuple[int, int]) -> str:
    """What OUT keeps of this shard: "samples 0..k converted and journaled are kept"."""
    of = f" of shard {shard[0]}/{shard[1]}" if shard[1] > 1 else ""
    indices = [index for index, _, _ in mine if index in done]
    if not indices:
        return f"no sample{of} was converted yet"
    if len(indices) == len(mine):
        return f"all {len(indices)} samples{of} converted and journaled are kept"
    span = f"{indices[0]}..{indices[-1]}"
    if not of and indices == list(range(indices[0], indices[-1] + 1)):
        return f"samples {span} converted and journaled are kept"
    return f"{len(indices)} of the {len(mine)} samples{of} (indices {span}) converted and journaled are kept"


def _write_failure(failed: atomic.WriteFailed, mine: list, done: set[int], shard: tuple[int, int]) -> str:
    """The one line for a failed write, fsync or rename in OUT: the file and the strerror,
    what is kept, and the rerun that resumes."""
    kept = _kept(mine, done, shard)
    if failed.path.name in (IDS_FILE, "sample_lengths.json", "data_config.json"):
        kept += f"; {IDS_FILE}, which marks OUT complete, was not written"
    room = "free some space and " if failed.error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return f"{failed}; {kept}; {room}rerun the same command: it resumes where this run stopped"


class _Refused(ConvertError):
    """A sample of the loop that cannot be converted (unreadable, not what its journal entry says)."""


def _convert_samples(target: str, out: Path, mine: list, done: set[int], journal, bar, digest: bool) -> None:
    """Converts the samples of `mine` not in `done`, in index order, adding each to `done`
    once its journal line is written."""
    for index, path, entry in mine:
        if index in done:
            continue
        try:
            sample = _read(index, path, entry, digest)
            name, record = _record(target, index, path, sample)
        except ConvertError as error:
            raise _Refused(f"{error}; nothing was written for sample {index}") from None
        size = _write_atomic(out / name, lambda f: torch.save(record, f))
        line = {"index": index, "id": sample.metadata.get("sample_id"), "file": name,
                "tokens": int(record["input_ids"].numel()), "bytes": size}
        del sample, record  # one sample in memory at a time
        _append(journal, line)
        done.add(index)
        bar.update(1)


def convert(directory: str | os.PathLike, target: str, out: str | os.PathLike, shard: tuple[int, int] = (0, 1),
            progress: bool = False, digest: bool = True) -> Result:
    """Converts every journaled sample of `directory` whose index % N == I (shard
    (I, N)) into `out`, one sample at a time, each checked against its journal entry
    first (with `digest`, the whole file's XXH64 too), resuming from OUT's own journal;
    returns the shard's count. Raises ConvertError on a bad or missing journal, a
    damaged, unreadable or mismatched sample file, an OUT holding anything else
    (nothing is written when the journal, the first sample or OUT is refused), or a
    failed write (what was converted stays, and the same call resumes)."""
    out = Path(out)
    run, header, mine = _plan(directory, target, shard)
    state = _Out(out, run, shard)
    done: set[int] = set()
    try:
        state.claim()
        with open(state.journal, "ab") as journal:
            try:
                fcntl.flock(journal, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ConvertError(f"{out}: shard {shard[0]}/{shard[1]} is being converted by another "
                                   "process") from None
            recorded, finished, has_header = state.resume(header)
            done |= recorded
            if not has_header:
                _append(journal, header)
            bar = _progress(len(mine), len(done), progress)
            try:
                _convert_samples(target, out, mine, done, journal, bar, digest)
            finally:
                bar.close()
            if not finished:
                _append(journal, {"done": len(mine)})
        with state.locked():
            result = Result(len(mine))
            result.pending = state.all_done()
            result.complete = not result.pending
            if result.complete:
                state.finish(target)
    except _Refused as error:
        raise ConvertError(f"{error}, and {_kept(mine, done, shard)}; hsx-verify {directory} lists the dump's "
                           "problems; once they are repaired, the same command resumes (if the dump still lists "
                           "the same files)") from None
    except atomic.WriteFailed as failed:
        raise ConvertError(_write_failure(failed, mine, done, shard)) from None
    except OSError as error:  # creating .hsx-convert/, its lock or journal
        failed = atomic.WriteFailed(Path(error.filename or out), error)
        raise ConvertError(_write_failure(failed, mine, done, shard)) from None
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: prints the count, or "hsx.convert: error: ..." and returns 1."""
    parser = argparse.ArgumentParser(prog="python -m hsx.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="an hsx-dump output directory")
    parser.add_argument("--to", required=True, choices=list(FORMATS))
    parser.add_argument("out", help="output directory (new, empty, or this conversion's own to resume)")
    parser.add_argument("--shard", type=shard_arg, default=(0, 1), metavar="I/N",
                        help="convert only the samples whose index %% N == I (as hsx-dump's --shard); the N "
                             "shards share OUT, and the last to finish writes sample_ids.jsonl")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (tqdm) on stderr")
    parser.add_argument("--no-digest", action="store_true",
                        help="do not compare each file's XXH64 with the journal's (a read of every byte); the "
                             "metadata, token ids and loss mask are checked all the same")
    args = parser.parse_args(argv)
    try:
        result = convert(args.directory, args.to, args.out, shard=args.shard, progress=not args.no_progress,
                         digest=not args.no_digest)
    except (ConvertError, OSError) as error:
        print(f"hsx.convert: error: {error}", file=sys.stderr)
        return 1
    if result.complete:
        total = sum(1 for _ in open(Path(args.out) / IDS_FILE, encoding="utf-8"))
        print(f"hsx.convert: wrote {total} samples in {args.to} format to {args.out}")
    else:
        print(f"hsx.convert: shard {args.shard[0]}/{args.shard[1]}: {int(result)} samples in {args.out}; "
              f"shards {', '.join(map(str, result.pending))} are not done yet (the last to finish writes "
              f"{IDS_FILE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
