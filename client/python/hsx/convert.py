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
conversion or nothing. A journal entry whose file name is not a plain name in
DIR, or two entries with the same index, is an error (nothing is written).

The auxiliary layers are the captured ids below N (three for EAGLE-3); the
target is the post-final-norm state when present (required by SpecForge).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .files import read_sample

SPECFORGE_GROUP = 2000
IDS_FILE = "sample_ids.jsonl"


class ConvertError(ValueError):
    """A dump that cannot be converted, or an unusable OUT; the message names the file."""


def _plain_name(name):
    """True when `name` is one path component naming a file inside a directory."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def _samples(directory):
    """(index, path) of every journaled sample, in index order; the journal's
    entries are checked (plain file names in DIR, one file per index)."""
    directory = Path(directory)
    manifest = directory / "manifest.jsonl"
    by_index = {}
    if manifest.exists():
        for number, line in enumerate(manifest.read_text().splitlines(), start=1):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line: not complete
            where = f"{manifest}:{number}"
            index, name = entry.get("index"), entry.get("file")
            if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                raise ConvertError(f"{where}: 'index' must be a non-negative integer, not {index!r}")
            if not _plain_name(name):
                raise ConvertError(f"{where}: 'file' must be a plain file name in {directory}, not {name!r}")
            if by_index.get(index, name) != name:
                raise ConvertError(f"{where}: index {index} is journaled twice, as {by_index[index]!r} and {name!r}")
            by_index[index] = name
    else:
        for p in directory.glob("hs_*.safetensors"):
            if p.stem[3:].isdigit():
                by_index[int(p.stem[3:])] = p.name
    return [(index, directory / by_index[index]) for index in sorted(by_index)]


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
    num_layers = int(sample.metadata["num_layers"])
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


def convert(directory, target, out):
    """Converts every journaled sample of `directory` into `out`; returns the count.
    Raises ConvertError (nothing written) on a bad journal, OUT or sample."""
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
            sample = read_sample(path, torch=True)
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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hsx.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="an hsx-dump output directory")
    parser.add_argument("--to", required=True, choices=["specforge", "modelopt", "speculators-legacy"])
    parser.add_argument("out", help="output directory")
    args = parser.parse_args(argv)
    try:
        count = convert(args.directory, args.to, args.out)
    except (ConvertError, ValueError, OSError) as error:
        print(f"hsx.convert: error: {error}", file=sys.stderr)
        return 1
    print(f"hsx.convert: wrote {count} samples in {args.to} format to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
