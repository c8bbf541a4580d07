"""SpecForge 0.2.0 trains online from hsx-server through its own data plane: a
FeatureStore (specforge.runtime.data_plane) whose samples hsx-server extracts on
demand, and the SampleRefs that point into it. SpecForge's Trainer takes "a ref
source + a store" and is otherwise the same online, offline or disaggregated; its
FeatureDataLoader reads each ref from the store, applies the strategy's per-sample
normalizer and its collator, and yields the TrainBatch its step consumes.

    store = HsxFeatureStore(["host:50051"], target_model="/path/to/target")
    refs = store.refs(rows, max_len=2048, ttt_length=7)          # this rank's share
    loader = FeatureDataLoader(store, refs=refs, batch_size=B,
                               per_sample_transform=build_offline_normalizer(max_len),
                               collate_fn=build_offline_collator(), strategy="eagle3")
    # or: SpecForge's Trainer(..., store=store, ref_source={"refs": refs,
    #     "refs_for_epoch": lambda e: store.refs(rows, ..., seed=S, epoch=e)})

store.get(ref) returns exactly the tensors of SpecForge's offline EAGLE-3 feature file
(the .ckpt its OfflineManifestReader refs point at, and hsx.convert --to specforge
writes): input_ids [T], loss_mask [T] (the row's, else all ones), hidden_state
[1, T, H] (the post-final-norm state: the target) and aux_hidden_state [1, T, 3H]
(the auxiliary layers, default EAGLE-3's 2, N/2, N-3). Nothing is written to disk.
The rows (python -m hsx.prepare's {"input_ids", "loss_mask", "id"}) travel in the
refs' metadata; refs() gives each rank its share of the epoch's order
(hsx.sharding: rank and world size given or torch.distributed's, a seeded order).

Before its first sample each process checks that every server answers, accepts the
token and serves the target model's config (hsx.preflight); check() does the same
in the caller.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from specforge.runtime.contracts import SCHEMA_VERSION, FeatureHandle, SampleRef
from specforge.runtime.data_plane.feature_store import FeatureStore

from ..capture import parse_capture
from ..client import Client
from ..preflight import config_expectation, preflight
from ..sharding import Consumer, distributed_rank, epoch_order, share

FEATURE_KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")


class HsxFeatureStore(FeatureStore):
    """A read-only SpecForge FeatureStore over hsx-server (see the module doc): get()
    extracts and verifies the sample a ref names; put() is refused (hsx-server is the
    producer); release and abort have nothing to free. Picklable into workers; each
    process opens its own connections on first use."""

    def __init__(self, servers: str | Sequence[str], target_model: str | os.PathLike | None = None,
                 token: str | None = None, capture: Sequence[int] | None = None, connect_timeout: float = 20.0,
                 retries: int = 30) -> None:
        self.servers = [s.strip() for s in servers.split(",")] if isinstance(servers, str) else list(servers)
        if not self.servers:
            raise ValueError("servers: expected at least one hsx-server address")
        self.target_model = os.fspath(target_model) if target_model is not None else None
        self.token = token
        self.capture = sorted(set(int(c) for c in capture)) if capture else None
        self.connect_timeout = connect_timeout
        self.retries = retries
        self._pid: int | None = None
        self._clients: list[Client] = []
        self._aux: list[int] = []
        self._turn = itertools.count()
        self._leases = itertools.count(1)

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "_pid": None, "_clients": []}
        state.pop("_turn"), state.pop("_leases")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _turn=itertools.count(), _leases=itertools.count(1))

    def check(self) -> list[int]:
        """Checks every server (hsx.preflight); returns the auxiliary capture ids."""
        expect = config_expectation(self.target_model) if self.target_model else {}
        infos = preflight(self.servers, self.token, None, self.connect_timeout, expect, self.capture,
                          source=f"the target model's config ({self.target_model})")
        layers = int(infos[0]["num_layers"])
        return self.capture or list(parse_capture("specforge", layers)[0])

    def refs(self, rows: Sequence[Mapping[str, Any]], *, max_len: int, ttt_length: int, run_id: str = "hsx",
             seed: int | None = None, epoch: int = 0, rank: int | None = None,
             world_size: int | None = None) -> list[SampleRef]:
        """This rank's SampleRefs of an epoch: its share of the rows' order (input order,
        or a permutation fixed by seed and epoch), metadata as OfflineManifestReader's
        plus the row's tokens and mask."""
        if rank is None or world_size is None:
            rank, world_size = distributed_rank()
        order = share(epoch_order(len(rows), seed, epoch), Consumer(rank, world_size))
        return [self._ref(i, rows[i], run_id, max_len, ttt_length) for i in order]

    def _ref(self, index: int, row: Mapping[str, Any], run_id: str, max_len: int, ttt_length: int) -> SampleRef:
        ids = [int(t) for t in row["input_ids"]]
        mask = [int(m) for m in row["loss_mask"]] if row.get("loss_mask") is not None else [1] * len(ids)
        if len(mask) != len(ids):
            raise ValueError(f"row {index}: loss_mask has {len(mask)} values for {len(ids)} tokens")
        sample_id = f"{run_id}:{index:08d}"
        return SampleRef(
            sample_id=sample_id, run_id=run_id, source_task_id=None,
            feature_store_uri=f"hsx://{self.servers[index % len(self.servers)]}/{sample_id}",
            feature_keys={k: k for k in FEATURE_KEYS}, feature_specs={}, strategy="eagle3",
            schema_version=SCHEMA_VERSION, num_tokens=len(ids),
            metadata={"format": "offline_eagle3", "target_repr": "hidden_state", "schema_version": SCHEMA_VERSION,
                      "ttt_length": ttt_length, "max_len": max_len, "file_index": index,
                      "hsx_id": str(row.get("id", index)), "input_ids": ids, "loss_mask": mask})

    def _connect(self) -> None:
        if self._pid != os.getpid():
            self._aux = self.check()
            self._clients = [Client(s, token=self.token, retries=self.retries) for s in self.servers]
            self._pid = os.getpid()

    def get(self, sample_ref: SampleRef, *, device: torch.device | str = "cpu",
            names: list[str] | None = None) -> tuple[dict[str, torch.Tensor], FeatureHandle]:
        self._connect()
        meta = sample_ref.metadata
        client = self._clients[next(self._turn) % len(self._clients)]
        got = client.extract(meta["input_ids"], capture=self._aux, final_norm=True, torch=True,
                             sample_id=meta.get("hsx_id", sample_ref.sample_id), loss_mask=meta["loss_mask"])
        hs = got["hidden_states"]
        tensors = {"input_ids": got["token_ids"].to(torch.long), "loss_mask": got["loss_mask"].to(torch.long),
                   "hidden_state": got["final_norm_hidden_states"].unsqueeze(0),
                   "aux_hidden_state": hs.reshape(hs.shape[0], -1).unsqueeze(0)}
        wanted = names or list(sample_ref.feature_keys)
        tensors = {name: tensors[sample_ref.feature_keys.get(name, name)].to(device) for name in wanted}
        handle = FeatureHandle(sample_id=sample_ref.sample_id, generation=0,
                               lease_token=f"{sample_ref.sample_id}:0:{next(self._leases)}")
        return tensors, handle

    def put(self, tensors: dict[str, torch.Tensor], *, sample_id: str, metadata: dict[str, Any]) -> SampleRef:
        raise NotImplementedError("HsxFeatureStore is read-only: hsx-server produces the features (use refs())")

    def release(self, handle: FeatureHandle, *, reason: str = "consumed") -> None:
        """Nothing is held: each get() extracted its own tensors."""

    def abort(self, sample_id: str, *, reason: str) -> None:
        """Nothing is held."""

    def health(self) -> dict[str, Any]:
        return {"backend": "hsx", "servers": list(self.servers), "release_pending": 0}
