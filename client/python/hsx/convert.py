"""python -m hsx.convert DIR --to specforge|modelopt|speculators-legacy OUT

Rewrites an hsx-dump directory in the format another trainer reads, exactly
(file names, keys, shapes, dtypes, pre/post-norm as each tool expects; see
docs/formats.md):

  specforge           OUT/rows_{g}-{g+2000}/data_{i}.ckpt: input_ids [T], loss_mask [T],
                      hidden_state [1, T, H] (post-norm), aux_hidden_state [1, T, 3H]
  modelopt            OUT/{id}.pt: input_ids [T], hidden_states [T, H], aux_hidden_states [T, 3H],
                      conversation_id, loss_mask [T] (+ hidden_states_prenorm when the
                      post-norm state was not extracted)
  speculators-legacy  OUT/data_{i}.pt: input_ids [T], loss_mask [T], hidden_states: a list of
                      L tensors [T, H] ascending; plus sample_lengths.json and data_config.json

The auxiliary layers are the captured ids below N (three for EAGLE-3); the
target is the post-final-norm state when present (required by SpecForge).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .files import read_sample

SPECFORGE_GROUP = 2000


def _samples(directory):
    """(index, path) of every journaled sample, in index order."""
    directory = Path(directory)
    manifest = directory / "manifest.jsonl"
    if manifest.exists():
        entries = []
        for line in manifest.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line: not complete
            entries.append((int(entry["index"]), directory / entry["file"]))
        return sorted(set(entries))
    files = sorted(directory.glob("hs_*.safetensors"), key=lambda p: int(p.stem[3:]))
    return [(int(p.stem[3:]), p) for p in files]


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


def convert(directory, target, out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = {}
    count = 0
    layer_ids = None
    for index, path in _samples(directory):
        sample = read_sample(path, torch=True)
        num_layers = int(sample.metadata["num_layers"])
        layer_ids = sample.capture_ids
        input_ids = sample["token_ids"].clone()
        if target == "specforge":
            aux, _, final = _split(sample, num_layers)
            if final is None:
                raise SystemExit(f"{path}: SpecForge needs the post-norm state; dump with --final-norm")
            group = index // SPECFORGE_GROUP * SPECFORGE_GROUP
            dest = out / f"rows_{group}-{group + SPECFORGE_GROUP}" / f"data_{index}.ckpt"
            record = {"input_ids": input_ids, "loss_mask": _mask(sample),
                      "hidden_state": final.clone().unsqueeze(0), "aux_hidden_state": aux.unsqueeze(0)}
        elif target == "modelopt":
            aux, last, final = _split(sample, num_layers)
            conversation_id = sample.metadata.get("sample_id", str(index))
            dest = out / f"{conversation_id}.pt"
            record = {"input_ids": input_ids, "aux_hidden_states": aux, "conversation_id": conversation_id,
                      "loss_mask": _mask(sample)}
            if final is not None:
                record["hidden_states"] = final.clone()
            elif last is not None:
                record["hidden_states"] = last.clone()
                record["hidden_states_prenorm"] = True
            else:
                raise SystemExit(f"{path}: ModelOpt needs capture id N or the final norm")
        elif target == "speculators-legacy":
            hs = sample["hidden_states"]
            dest = out / f"data_{index}.pt"
            record = {"input_ids": input_ids, "loss_mask": _mask(sample),
                      "hidden_states": [hs[:, i].clone() for i in range(hs.shape[1])]}
        else:
            raise SystemExit(f"unknown format {target!r}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        temp = dest.with_name(dest.name + ".tmp")
        torch.save(record, temp)
        os.replace(temp, dest)
        lengths[str(index)] = int(input_ids.numel())
        count += 1
    if target == "speculators-legacy":
        (out / "sample_lengths.json").write_text(json.dumps(lengths))
        (out / "data_config.json").write_text(json.dumps({
            "version": "2.0", "generator": "hsx", "layer_ids": layer_ids,
            "file_pattern": "data_{idx}.pt", "num_samples": count,
            "schema": {"input_ids": "int64 [T]", "loss_mask": "int64 [T]",
                       "hidden_states": "list of [T, H] tensors, ascending layer id"}}, indent=1))
    return count


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hsx.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="an hsx-dump output directory")
    parser.add_argument("--to", required=True, choices=["specforge", "modelopt", "speculators-legacy"])
    parser.add_argument("out", help="output directory")
    args = parser.parse_args(argv)
    count = convert(args.directory, args.to, args.out)
    print(f"hsx.convert: wrote {count} samples in {args.to} format to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
