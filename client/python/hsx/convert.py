"""python -m hsx.convert DIR --to specforge|modelopt|speculators-legacy OUT

Rewrites an hsx-dump directory in the format another trainer reads, exactly
(keys, shapes, dtypes, pre/post-norm as each tool expects; see docs/formats.md):

  specforge           OUT/rows_{g}-{g+2000}/data_{i}.ckpt: input_ids [T], loss_mask [T],
                      hidden_state [1, T, H] (post-norm), aux_hidden_state [1, T, 3H]
  modelopt            OUT/data_{i}.pt: input_ids [T], hidden_states [T, H], aux_hidden_states [T, 3H],
                      conversation_id (the sample id, when it has one), loss_mask [T]
                      (+ hidden_states_prenorm when the post-norm state was not extracted)
  speculators-legacy  OUT/data_{i}.pt: input_ids [T], loss_mask [T], hidden_states: a list of
                      L tensors [T, H] ascending; plus sample_lengths.json and data_config.json

Files are named by the sample index i (the dump's hs_{i}), never by the sample
id: ids are arbitrary strings ("a/b", "..", duplicates, none at all) and cannot
safely be file names. OUT/sample_ids.jsonl maps every written file to its index
and id: {"index": i, "id": ID or null, "file": "data_{i}.pt"}.

OUT must not exist or be empty. Everything is written to a temporary directory
beside OUT and renamed to OUT at the end, so OUT holds either the whole
conversion or nothing. The journal (manifest.jsonl) says what is complete, by
hsx-dump's rules: without it nothing is; only a torn (unterminated) last line is
skipped; a journal entry that does not parse, whose file name is not a plain name
in DIR, or a second entry for one index (other than a redo's "supersedes"), is an
error, and so is a journaled file of another size. Nothing is written then.

The auxiliary layers are the captured ids below N (three for EAGLE-3); the
target is the post-final-norm state when present (required by SpecForge).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .files import read_sample
from .journal import JournalError, complete_samples

SPECFORGE_GROUP = 2000
IDS_FILE = "sample_ids.jsonl"


class ConvertError(ValueError):
    """A dump that cannot be converted, or an unusable OUT; the message names the file."""


def _samples(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(index, path) of every complete sample, in index order, over all the directory's
    journals (hsx.journal.complete_samples: the rules of docs/formats.md)."""
    try:
        return [(index, path) for index, path, _ in complete_samples(directory)]
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


def _empty_out(out):
    """Refuses an OUT that holds anything: converting into it could mix two dumps."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConvertError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise ConvertError(f"{out}: not empty; convert into a new directory")


def convert(directory: str | os.PathLike, target: str, out: str | os.PathLike) -> int:
    """Converts every journaled sample of `directory` into `out`; returns the count.
    Raises ConvertError (nothing written) on a bad or missing journal, a damaged
    or unreadable sample file, or an unusable OUT; never exits the process."""
    if target not in ("specforge", "modelopt", "speculators-legacy"):
        raise ConvertError(f"unknown format {target!r}")
    out = Path(out)
    _empty_out(out)
    samples = _samples(directory)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        lengths, ids, written, layer_ids = {}, [], set(), None
        for index, path in samples:
            try:
                sample = read_sample(path, torch=True)
            except (OSError, ValueError, KeyError) as error:
                raise ConvertError(f"{path}: cannot read: {error}") from None
            layer_ids = sample.capture_ids
            name, record = _record(target, index, path, sample)
            if name in written:  # cannot happen with index names; the guarantee is checked, not assumed
                raise ConvertError(f"{path}: {name} would be written twice")
            written.add(name)
            dest = staging / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            torch.save(record, dest)
            lengths[str(index)] = int(record["input_ids"].numel())
            ids.append({"index": index, "id": sample.metadata.get("sample_id"), "file": name})
        (staging / IDS_FILE).write_text("".join(json.dumps(entry) + "\n" for entry in ids))
        if target == "speculators-legacy":
            (staging / "sample_lengths.json").write_text(json.dumps(lengths))
            (staging / "data_config.json").write_text(json.dumps({
                "version": "2.0", "generator": "hsx", "layer_ids": layer_ids,
                "file_pattern": "data_{idx}.pt", "num_samples": len(ids),
                "schema": {"input_ids": "int64 [T]", "loss_mask": "int64 [T]",
                           "hidden_states": "list of [T, H] tensors, ascending layer id"}}, indent=1))
        _empty_out(out)  # again: something may have appeared meanwhile
        if out.is_dir():
            out.rmdir()
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return len(ids)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: prints the count, or "hsx.convert: error: ..." and returns 1."""
    parser = argparse.ArgumentParser(prog="python -m hsx.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="an hsx-dump output directory")
    parser.add_argument("--to", required=True, choices=["specforge", "modelopt", "speculators-legacy"])
    parser.add_argument("out", help="output directory")
    args = parser.parse_args(argv)
    try:
        count = convert(args.directory, args.to, args.out)
    except (ConvertError, OSError) as error:
        print(f"hsx.convert: error: {error}", file=sys.stderr)
        return 1
    print(f"hsx.convert: wrote {count} samples in {args.to} format to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
