"""hsx.read_sample: an hsx-dump file (hs_{i}.safetensors), memory-mapped."""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from .arrays import SAFETENSORS_DTYPES, to_torch
from .sample import Sample


def read_sample(path: str | os.PathLike, torch: bool = False) -> Sample:
    """Reads one file as an hsx.Sample: hidden_states [T, L, H], token_ids [T], and
    loss_mask / final_norm_hidden_states when present, without copying (numpy
    memmap views; torch=True gives tensors), with .capture_ids, .sample_id,
    .index (the file's sample index) and .metadata. Raises ValueError on a
    malformed file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > 100_000_000:
            raise ValueError(f"{path}: header length {length} is too large")
        header = json.loads(f.read(length))
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + length)  # copy-on-write: writable views, file untouched
    metadata = header.pop("__metadata__", {})
    sample = Sample()
    for name, entry in header.items():
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        count = int(np.prod(entry["shape"], dtype=np.int64))
        if end > data.size or end - begin != count * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} has inconsistent offsets")
        array = data[begin:end].view(dtype).reshape(entry["shape"])
        sample[name] = to_torch(array) if torch else array
    sample.metadata = metadata
    sample.capture_ids = json.loads(metadata.get("capture_ids", "[]"))
    sample.sample_id = metadata.get("sample_id")
    index = metadata.get("sample_index", "")
    sample.index = int(index) if index.isdigit() else None
    return sample
