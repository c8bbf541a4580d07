"""fp8 samples: float8 e4m3 values with a float32 scale per row (per token per layer).

The dtype "fp8" (docs/formats.md, "fp8"): each row of hidden_states [T, L, H] (and of
final_norm_hidden_states [T, H]) is stored as e4m3 ("e4m3fn": no infinities, 0x7f / 0xff
are NaN, largest 448) with its own float32 scale, value = e4m3 * scale. The scale is the
row's largest |value| / 448 (at least the smallest normal float32), and 1 for a row of
zeros, so every scale is finite and positive; a stream or file with another is refused.
On the wire a row is its 4-byte little-endian scale, then its H bytes; in a file the
scales are the tensors hidden_states_scales [T, L, 1] and final_norm_hidden_states_scales
[T, 1] (float32), beside the F8_E4M3 tensors.

hsx.Client, hsx.OnlineDataset and hsx.read_sample give fp8 samples dequantized (bf16,
the product taken in float32), the same shape as the other dtypes; with dequantize=False
they give the e4m3 values and their scales as received or stored, the file's tensors
(a streamed sample's byte for byte those of hsx-dump's file of it; dequantize() of them
is the default's bf16 bit for bit). Pass it when the trainer dequantizes on its GPU: the
host then writes and copies one byte a value instead of two.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_BYTES = 4
SCALES = {"hidden_states": "hidden_states_scales", "final_norm_hidden_states": "final_norm_hidden_states_scales"}


def first_problem(values: np.ndarray, scales: np.ndarray, names: list[str]) -> str | None:
    """The first thing wrong with [T, L, H] e4m3 values and their [T, L, 1] scales,
    in the C++ checks' order and words, or None: the first bad row (scale not finite
    and positive, or a NaN value; the scale is checked before its row's values) by
    row, then by layer; then a layer all zeros."""
    bits = values.view(np.uint8) & 0x7F
    bad_scale = ~(np.isfinite(scales[..., 0]) & (scales[..., 0] > 0))  # [T, L]
    nan = bits == 0x7F
    bad_row = bad_scale | nan.any(axis=2)
    if bad_row.any():
        t, l = np.unravel_index(int(np.argmax(bad_row)), bad_row.shape)
        if bad_scale[t, l]:
            return f"scale ({format_float(float(scales[t, l, 0]))}) of {names[l]} row {t} is not finite and positive"
        return f"non-finite value (nan) in {names[l]} row {t} column {int(np.argmax(nan[t, l]))}"
    nonzero = bits.any(axis=(0, 2))
    for l, ok in enumerate(nonzero):
        if not ok:
            return f"{names[l]} is all zeros"
    return None


def format_float(value: float) -> str:
    """A float32 as C++'s absl::StrCat writes it (%g: "nan", "inf", "-0", "0.25")."""
    return f"{value:g}"


def dequantize(values: np.ndarray, scales: np.ndarray, dtype: str = "bf16") -> np.ndarray:
    """e4m3 values times their scales (broadcast), in float32, as `dtype` ("bf16" or "fp32")."""
    product = values.astype(np.float32) * scales.astype(np.float32)
    return product.astype(ml_dtypes.bfloat16) if dtype == "bf16" else product


def dequantize_tensors(tensors: dict, dtype: str = "bf16") -> dict:
    """The tensors with each fp8 tensor that has its scales replaced by its values
    (numpy), the scales dropped; other tensors as they are."""
    out = dict(tensors)
    for name, scales_name in SCALES.items():
        if name in out and scales_name in out:
            out[name] = dequantize(np.asarray(out[name]), np.asarray(out.pop(scales_name)), dtype)
    return out
