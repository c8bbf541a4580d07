"""hsx.journal: which samples of an hsx-dump output directory are complete.

The one reader of a dump's journals in Python (docs/formats.md, "Output
directory"); the converters and anything else that lists a dump's samples call
complete_samples(). A directory has a journal per shard:

  manifest.jsonl                 an unsharded run's (--shard 0/1), and the one
                                 shared journal of dumps made before per-shard journals
  journal/shard-I-of-N.jsonl     shard I of N (N > 1)

A sample is complete if and only if exactly one journal has a current entry for
it. Within a journal: only an unterminated last line (a torn append) is
skipped, any other bad line is an error; a line with "supersedes": N replaces
line N, its sample's current entry; a sample on two lines otherwise is an error.
A journaled file must have the journaled size. quarantined() lists the samples
hsx-dump quarantined (quarantine/*.jsonl) and no journal records since.

file_problems() says whether a journaled file holds what its entry says, as
hsx-verify checks it (format/sample_file_checker.cc): the metadata's
sample_index, sample_id, capture_ids, dtype and model, token_ids and loss_mask
against the entry's XXH64s (of their int64 little-endian bytes, seed 0, as
hsx-dump computes them), final_norm, and with digest=True the whole file's
XXH64 (the entry's xxh64), which reads every byte.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

JOURNAL_FILE = "manifest.jsonl"
JOURNAL_DIR = "journal"
QUARANTINE_DIR = "quarantine"

# Every journal line's fields and their JSON types (client/dump/journal.h);
# "supersedes" is optional.
FIELDS = {"index": int, "id": str, "file": str, "tokens": int, "bytes": int, "xxh64": str, "capture_ids": list,
          "final_norm": bool, "dtype": str, "model": str, "model_revision": str, "compute_precision": str,
          "token_ids_xxh64": str, "loss_mask_xxh64": str, "input_xxh64": str}


class JournalError(ValueError):
    """A journal that says nothing reliable; the message names the file and line."""


class Entry(dict):
    """One journal line's fields, with .where: "JOURNAL:LINE" (the line that says it)."""

    where: str = ""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain_name(name: object) -> bool:
    """True when `name` is one path component naming a file inside a directory, or DIGITS/name
    (hsx-dump --layout nested: a subdirectory per 1000 samples)."""
    if not isinstance(name, str):
        return False
    subdir, _, name = name.rpartition("/") if "/" in name else ("0", "", name)
    return (subdir.isascii() and subdir.isdigit() and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and "\0" not in subdir)


def _entry(text: str, where: str, directory: Path) -> dict[str, Any]:
    """One complete journal line, checked as hsx-dump reads it."""
    try:
        entry = json.loads(text)
    except json.JSONDecodeError as error:
        raise JournalError(f"{where}: corrupt journal line (not valid JSON: {error.msg})") from None
    if not isinstance(entry, dict):
        raise JournalError(f"{where}: corrupt journal line (not a JSON object)")
    index, name = entry.get("index"), entry.get("file")
    if not _is_int(index) or index < 0:
        raise JournalError(f"{where}: 'index' must be a non-negative integer, not {index!r}")
    if not _plain_name(name):
        raise JournalError(f"{where}: 'file' must be a plain file name in {directory}, not {name!r}")
    for key, kind in FIELDS.items():
        value = entry.get(key)
        if key not in entry or not (_is_int(value) if kind is int else isinstance(value, kind)):
            raise JournalError(f"{where}: corrupt journal line ({key!r} missing or not {kind.__name__})")
    if entry["tokens"] < 1 or entry["bytes"] < 1:
        raise JournalError(f"{where}: corrupt journal line ('tokens' and 'bytes' must be positive)")
    supersedes = entry.get("supersedes")
    if "supersedes" in entry and (not _is_int(supersedes) or supersedes < 1):
        raise JournalError(f"{where}: corrupt journal line ('supersedes' must be a line number)")
    return entry


def journal_paths(directory: str | os.PathLike) -> list[Path]:
    """The journals present: manifest.jsonl first, then journal/*.jsonl in name order."""
    directory = Path(directory)
    paths = [directory / JOURNAL_FILE] if (directory / JOURNAL_FILE).is_file() else []
    shard_dir = directory / JOURNAL_DIR
    if shard_dir.is_dir():
        paths += sorted(p for p in shard_dir.iterdir() if p.suffix == ".jsonl" and p.is_file()
                        and not p.name.startswith("."))
    return paths


def _current_entries(path: Path, directory: Path) -> dict[int, tuple[int, dict[str, Any]]]:
    """index -> (line number, entry) of one journal's current entries."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    complete = text[: text.rfind("\n") + 1]  # what follows the last newline is a torn append
    current: dict[int, tuple[int, dict[str, Any]]] = {}
    for number, line in enumerate(complete.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        entry = _entry(line, where, directory)
        index, target = entry["index"], entry.get("supersedes")
        if target is not None:
            if target >= number or current.get(index, (None,))[0] != target:
                raise JournalError(f"{where}: supersedes line {target}, which is not sample {index}'s current entry")
        elif index in current:
            first, earlier = current[index]
            raise JournalError(f"{where}: index {index} is journaled twice (also on line {first}, as "
                               f"{earlier['file']!r}; this line has {entry['file']!r})")
        current[index] = (number, entry)
    return current


def complete_samples(directory: str | os.PathLike) -> list[tuple[int, Path, dict[str, Any]]]:
    """(index, path, journal entry) of every complete sample, in index order, over all the
    directory's journals. Raises JournalError when there is no journal (nothing is complete),
    on a bad line, on a sample current in two journals, and on a journaled file that is missing
    or not of the journaled size."""
    directory = Path(directory)
    paths = journal_paths(directory)
    if not paths:
        raise JournalError(f"{directory / JOURNAL_FILE}: missing, so nothing in {directory} is complete "
                           "(not an hsx-dump output directory?)")
    merged: dict[int, tuple[str, dict[str, Any]]] = {}  # index -> ("path:line", entry)
    for path in paths:
        for index, (number, entry) in _current_entries(path, directory).items():
            if index in merged:
                raise JournalError(f"{path}:{number}: index {index} is journaled twice (also at {merged[index][0]}); "
                                   "two runs with different --shard N wrote this directory at once?")
            merged[index] = (f"{path}:{number}", entry)
    samples = []
    for index in sorted(merged):
        where, entry = merged[index]
        path = directory / entry["file"]
        try:
            size = path.stat().st_size
        except OSError as error:
            raise JournalError(f"{path}: {error.strerror}, but {where} records sample {index} as done "
                               "(rerun hsx-dump: it redoes the sample)") from None
        if size != entry["bytes"]:
            raise JournalError(f"{path}: {size} bytes, {where} says {entry['bytes']} "
                               "(damaged; rerun hsx-dump: it redoes the sample)")
        samples.append((index, path, _located(entry, where)))
    return samples


def _located(entry: dict[str, Any], where: str) -> Entry:
    located = Entry(entry)
    located.where = where
    return located


def quarantined(directory: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """index -> the latest quarantine line ({"index", "id", "tokens", "code", "reason"}) of every
    sample hsx-dump quarantined and no journal records as complete since."""
    directory = Path(directory)
    entries: dict[int, dict[str, Any]] = {}
    qdir = directory / QUARANTINE_DIR
    for path in sorted(qdir.glob("*.jsonl")) if qdir.is_dir() else []:
        text = path.read_text(errors="replace")
        for number, line in enumerate(text[: text.rfind("\n") + 1].splitlines(), start=1):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                raise JournalError(f"{path}:{number}: corrupt quarantine line") from None
            if not isinstance(entry, dict) or not _is_int(entry.get("index")):
                raise JournalError(f"{path}:{number}: corrupt quarantine line (no integer 'index')")
            entries[entry["index"]] = entry
    done = set()
    for path in journal_paths(directory):
        done.update(_current_entries(path, directory))
    return {index: entry for index, entry in entries.items() if index not in done}


def file_xxh64(path: str | os.PathLike) -> str:
    """XXH64 (seed 0) of the whole file, as hex: the journal's "xxh64". Hashes a read-only
    mapping, without copying (about twice as fast as reading into a buffer)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh64(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return xxhash.xxh64(data).hexdigest()


def _int64_hash(name: str, values: Any, tokens: int, want: str) -> str | None:
    """The problem with tensor `name` (int64 [tokens], hashing to `want`), or None."""
    array = np.asarray(values)
    if array.dtype != np.int64 or array.shape != (tokens,):
        return f"{name} is {array.dtype} {list(array.shape)}, the journal says int64 [{tokens}]"
    got = xxhash.xxh64(np.ascontiguousarray(array, dtype="<i8").tobytes()).hexdigest()
    verb = "hashes" if name == "loss_mask" else "hash"  # hsx-verify's words
    return None if got == want else f"{name} {verb} to {got}, the journal says {want}"


def _metadata_problems(metadata: dict[str, str], entry: dict[str, Any]) -> list[str]:
    problems = []
    index, sample_id = metadata.get("sample_index"), metadata.get("sample_id")
    if index != str(entry["index"]) or sample_id != entry["id"]:
        problems.append(f"it holds sample {index or '<missing>'} (id {sample_id!r}) by its metadata "
                        "sample_index and sample_id")
    try:
        ids = json.loads(metadata.get("capture_ids", ""))
    except json.JSONDecodeError:
        ids = None
    if ids != entry["capture_ids"]:
        problems.append(f"metadata capture_ids {metadata.get('capture_ids')!r}, the journal says "
                        f"{json.dumps(entry['capture_ids'])}")
    for key in ("dtype", "model"):
        if metadata.get(key) != entry[key]:
            problems.append(f"metadata {key} {metadata.get(key)!r}, the journal says {entry[key]!r}")
    return problems


def file_problems(path: str | os.PathLike, entry: dict[str, Any], sample: Any, digest: bool = True) -> list[str]:
    """What differs between the journaled file at `path`, read as `sample` (hsx.read_sample,
    numpy or torch), and its journal `entry`, in hsx-verify's words; [] when they agree.
    digest=True also compares the whole file's XXH64 (a read of every byte)."""
    problems = _metadata_problems(sample.metadata, entry)
    tokens = entry["tokens"]
    for name, key in (("token_ids", "token_ids_xxh64"), ("loss_mask", "loss_mask_xxh64")):
        if name not in sample:
            if entry[key] or name == "token_ids":
                problems.append(f"no {name}, the journal has its hash")
        elif not entry[key]:
            problems.append(f"a {name} the journal does not list")
        elif (problem := _int64_hash(name, sample[name], tokens, entry[key])) is not None:
            problems.append(problem)
    if ("final_norm_hidden_states" in sample) != entry["final_norm"]:
        problems.append(f"final_norm_hidden_states {'present' if entry['final_norm'] is False else 'absent'}, "
                        f"the journal says final_norm {str(entry['final_norm']).lower()}")
    if digest and (got := file_xxh64(path)) != entry["xxh64"]:
        problems.append(f"xxh64 {got}, the journal says {entry['xxh64']} (changed since hsx-dump wrote it)")
    return problems
