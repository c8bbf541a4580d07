"""ModelOpt 0.47.0 trains online from hsx-server through its own online interface:
a StreamingDataset (modelopt/torch/speculative/plugins/hf_streaming_dataset.py)
whose backend hook, _fetch, extracts the sample from hsx-server, and whose
algorithm hook, _format, is ModelOpt's own EAGLE one (EagleVllmStreamingDataset's).
Its __getitem__ loop (resample an unfit entry, the consecutive-failure breaker)
and the dict it yields are ModelOpt's: input_ids, base_model_hidden_states,
aux_hidden_states, attention_mask, loss_mask, labels, base_hidden_prenorm, as its
OfflineSupervisedDataset yields them; EagleOfflineDataCollator batches them and
transformers.Trainer (or ModelOpt's example's) trains on them. It is map-style:
the Trainer's DistributedSampler shares indices out over ranks; DataLoader workers
give the concurrency (one extraction in flight per worker).

    dataset = HsxEagleStreamingDataset(entries, tokenizer=None, config=HsxStreamingConfig(
        servers=["host:50051"], model="/path/to/base", answer_only_loss=True))

entries: pre-tokenized rows ({"input_ids", "loss_mask", "id"}: python -m hsx.prepare's
JSONL) or ModelOpt's conversation entries ({"conversation_id", "conversations"},
tokenized with `tokenizer` by ModelOpt's own code). With final_norm (the default) the
target is the server's post-norm state (base_hidden_prenorm False, as hsx.convert's
files from a --final-norm dump); without, capture id N (pre-norm; ModelOpt re-applies
the norm). The auxiliary layers are `capture` (default EAGLE-3's 2, N/2, N-3).

Before its first sample each process checks that every server answers, accepts the
token and serves the model `model`'s config.json describes (hsx.preflight); check()
does the same in the caller. Errors are hsx.ServerError / ModelMismatch, which
ModelOpt does not mistake for a transient fetch miss.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from modelopt.torch.speculative.plugins.hf_streaming_dataset import (EagleFetchPayload, EagleVllmStreamingDataset,
                                                                      StreamingConfig, StreamingDataset)
from pydantic import Field, field_validator

from ..capture import parse_capture
from ..client import Client
from ..preflight import config_expectation, preflight


class HsxStreamingConfig(StreamingConfig):
    """ModelOpt's StreamingConfig plus where and how to extract: hsx-server addresses
    (a list or comma-separated), the token, the auxiliary capture ids, the final norm,
    the base model's checkpoint (its config.json is what the server must serve)."""

    servers: list[str]
    token: str | None = None
    model: str | None = None
    capture: list[int] | None = None
    final_norm: bool = True
    connect_timeout: float = Field(default=20.0, gt=0)
    retries: int = Field(default=30, ge=0)
    # Read by ModelOpt's EAGLE _format: the last plane is the base hidden state, distinct
    # from the auxiliary ones; it is pre-norm exactly when the final norm is not extracted.
    final_aux_is_base_hidden: bool = False

    @field_validator("servers", mode="before")
    @classmethod
    def _split(cls, value: Any) -> list[str]:
        if isinstance(value, str):
            value = value.split(",")
        servers = [s.strip() for s in value if s and s.strip()]
        if not servers:
            raise ValueError("servers: expected at least one hsx-server address")
        return servers

    @property
    def base_hidden_prenorm(self) -> bool:
        return not self.final_norm


class HsxEagleStreamingDataset(StreamingDataset):
    """EAGLE (ModelOpt's algorithm hook) x hsx-server (the backend hook); see the module doc."""

    config_cls = HsxStreamingConfig
    fetch_payload_cls = EagleFetchPayload
    _format = EagleVllmStreamingDataset._format

    def __init__(self, entries: list[dict], tokenizer: Any = None, config: HsxStreamingConfig | None = None) -> None:
        if config is None:
            raise ValueError("HsxEagleStreamingDataset needs a config with the hsx-server addresses")
        super().__init__(entries=entries, tokenizer=tokenizer, config=config)
        self.config: HsxStreamingConfig = config
        self._pid: int | None = None
        self._clients: list[Client] = []
        self._next = 0
        self._capture: list[int] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": None, "_clients": []}

    def check(self) -> list[int]:
        """Checks every server (hsx.preflight) and returns the capture ids the samples are
        extracted with: the auxiliary ones, then N unless the final norm is the target."""
        cfg = self.config
        expect = config_expectation(cfg.model) if cfg.model else {}
        infos = preflight(cfg.servers, cfg.token, None, cfg.connect_timeout, expect, cfg.capture,
                          source=f"the base model's config ({cfg.model})")
        layers = int(infos[0]["num_layers"])
        aux = sorted(set(cfg.capture)) if cfg.capture else list(parse_capture("modelopt", layers)[0])
        return aux if cfg.final_norm else aux + [layers]

    def _connect(self) -> None:
        if self._pid != os.getpid():
            self._capture = self.check()
            self._clients = [Client(s, token=self.config.token, retries=self.config.retries)
                             for s in self.config.servers]
            self._pid = os.getpid()

    def _tokenize_entry(self, entry: dict) -> dict | None:
        """A pre-tokenized row as it is (loss_mask used with answer_only_loss, else all ones,
        as ModelOpt's own tokenization and offline dataset do); a conversation entry by
        ModelOpt's own tokenization."""
        if "input_ids" not in entry:
            return super()._tokenize_entry(entry)
        ids = [int(t) for t in entry["input_ids"]]
        if self.config.answer_only_loss:
            if "loss_mask" not in entry:
                raise ValueError(f"entry {entry.get('id')!r}: answer_only_loss needs its loss_mask")
            mask = torch.tensor(entry["loss_mask"], dtype=torch.long)
        else:
            mask = torch.ones(len(ids), dtype=torch.long)
        if self.config.max_seq_len is not None:
            ids, mask = ids[:self.config.max_seq_len], mask[:self.config.max_seq_len]
        if int(mask.sum()) == 0:
            return None  # nothing to train on: ModelOpt's rule for its own entries
        return {"cid": str(entry.get("id", entry.get("conversation_id", ""))), "token_ids": ids, "loss_mask": mask}

    def _fetch(self, sample: dict) -> EagleFetchPayload:
        self._connect()
        client = self._clients[self._next % len(self._clients)]
        self._next += 1
        got = client.extract(sample["token_ids"], capture=self._capture, final_norm=self.config.final_norm,
                             torch=True, sample_id=sample["cid"] or None)
        hidden = got["hidden_states"]
        if self.config.final_norm:  # the base hidden state is the last plane, as _format reads it
            hidden = torch.cat([hidden, got["final_norm_hidden_states"].unsqueeze(1)], dim=1)
        return {"token_ids": got["token_ids"].to(torch.long), "hidden_states": hidden, "loss_mask": sample["loss_mask"]}
