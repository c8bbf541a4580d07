"""hsx.read_sample: an hsx-dump file (hs_{i}.safetensors), memory-mapped."""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from . import fp8
from .arrays import SAFETENSORS_DTYPES, to_torch
from .sample import Sample


def read_sample(path: str | os.PathLike, torch: bool = False, dequantize: bool = True) -> Sample:
    """Reads one file as an hsx.Sample: hidden_states [T, L, H], token_ids [T], and
    loss_mask / final_norm_hidden_states when present, without copying (numpy
    memmap views; torch=True gives tensors), with .capture_ids, .sample_id,
    .index (the file's sample index) and .metadata. Raises ValueError on a
    malformed file.

    An fp8 file (metadata dtype "fp8", hsx.fp8) is checked first: every scale
    finite and positive, no NaN value, no layer all zeros (ValueError naming the
    tensor, layer and row otherwise). It is then given dequantized (bf16, the
    shape of the other dtypes; the converters rely on this), or with
    dequantize=False as stored: the e4m3 values and their *_scales tensors."""
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
        sample[name] = array
    if metadata.get("dtype") == "fp8":
        _check_fp8(path, sample, json.loads(metadata.get("capture_ids", "[]")))
        if dequantize:
            sample.update(fp8.dequantize_tensors(sample))
            for name in fp8.SCALES.values():
                sample.pop(name, None)
    if torch:
        for name, array in sample.items():
            sample[name] = to_torch(array)
    sample.metadata = metadata
    sample.capture_ids = json.loads(metadata.get("capture_ids", "[]"))
    sample.sample_id = metadata.get("sample_id")
    index = metadata.get("sample_index", "")
    sample.index = int(index) if index.isdigit() else None
    return sample


def _check_fp8(path: str | os.PathLike, sample: Sample, capture_ids: list[int]) -> None:
    """ValueError unless the fp8 tensors have their scales, each finite and positive,
    and no NaN value or all-zero layer (hsx.fp8.first_problem, the C++ checker's words)."""
    for name, scales_name in fp8.SCALES.items():
        if name not in sample:
            continue
        values, scales = sample.get(name), sample.get(scales_name)
        if scales is None or values.dtype != fp8.FP8 or scales.dtype != np.float32 or \
                scales.shape != values.shape[:-1] + (1,):
            raise ValueError(f"{path}: fp8 tensor {name!r} lacks its float32 scales {scales_name!r} of shape "
                             f"{list(values.shape[:-1]) + [1]}")
        if name == "hidden_states":
            names = [f"hidden_states capture id {c}" for c in capture_ids] if len(capture_ids) == values.shape[1] \
                else [f"hidden_states layer {l}" for l in range(values.shape[1])]
            problem = fp8.first_problem(values, scales, names)
        else:
            problem = fp8.first_problem(values[:, None, :], scales[:, None, :], [name])
        if problem is not None:
            raise ValueError(f"{path}: {problem}")
