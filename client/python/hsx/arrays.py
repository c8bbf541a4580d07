"""dtype handling shared by the client and the file reader (numpy, optional torch)."""

import ml_dtypes
import numpy as np

NUMPY_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16),
                "fp32": np.dtype(np.float32), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
SAFETENSORS_DTYPES = {"BF16": NUMPY_DTYPES["bf16"], "F16": NUMPY_DTYPES["fp16"],
                      "F32": NUMPY_DTYPES["fp32"], "I64": np.dtype(np.int64),
                      "I32": np.dtype(np.int32), "F8_E4M3": NUMPY_DTYPES["fp8"]}


def to_torch(array):
    """A torch tensor sharing memory where possible (bfloat16 via a uint16 view, float8
    e4m3 via a uint8 view)."""
    import torch

    if array.dtype == NUMPY_DTYPES["bf16"]:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
    if array.dtype == NUMPY_DTYPES["fp8"]:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(array))
