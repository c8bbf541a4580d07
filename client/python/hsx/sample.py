"""hsx.Sample: the one shape of a sample, whichever way it arrives.

`Client.extract` / `Client.extract_many`, `OnlineDataset` and `read_sample`
all give a `Sample`: a dict from the names of an hsx-dump file's tensors to
arrays (numpy; torch tensors with torch=True / in OnlineDataset):

    hidden_states             [T, L, H]  bf16 / fp16 / fp32 (fp8 dequantized to bf16, hsx.fp8), layers ascending
    token_ids                 [T]        int64, the sample's token ids
    loss_mask                 [T]        int64 (0/1), when the input had one
    final_norm_hidden_states  [T, H]     as hidden_states, when the final norm was extracted

An fp8 sample asked for with dequantize=False (every one of them takes the keyword) holds
the states as received or stored instead: hidden_states and final_norm_hidden_states as
e4m3 (ml_dtypes.float8_e4m3fn / torch.float8_e4m3fn), with hidden_states_scales [T, L, 1]
and final_norm_hidden_states_scales [T, 1] (float32) beside them; a streamed sample's
tensors are byte for byte those of hsx-dump's file of it. For a trainer that dequantizes
on its GPU.

plus attributes:

    capture_ids  list[int]   the captured layers, ascending (hidden_states[:, l] is capture_ids[l])
    sample_id    str | None  the sample's id (the request's, or the file's metadata)
    index        int | None  its position: in the samples given to extract_many / OnlineDataset,
                             or the file's hs_{index} (None for a lone Client.extract)
    metadata     dict        a file's string metadata (docs/formats.md); {} for a streamed sample
"""

from __future__ import annotations

from typing import Any


class Sample(dict):
    """One sample's tensors by name (see the module docstring), with .capture_ids,
    .sample_id, .index and .metadata. A dict, so that torch's DataLoader and
    pickling keep it (and its attributes) whole."""

    capture_ids: list[int]
    sample_id: str | None
    index: int | None
    metadata: dict[str, str]

    def __init__(self, tensors: dict[str, Any] | None = None, *, capture_ids: list[int] | None = None,
                 sample_id: str | None = None, index: int | None = None,
                 metadata: dict[str, str] | None = None) -> None:
        super().__init__(tensors or {})
        self.capture_ids = list(capture_ids or [])
        self.sample_id = sample_id
        self.index = index
        self.metadata = dict(metadata or {})

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.items()}
        return f"Sample(index={self.index}, id={self.sample_id!r}, capture_ids={self.capture_ids}, {shapes})"
