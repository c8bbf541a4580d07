"""hsx.OnlineDataset: a torch IterableDataset that streams training-ready samples
straight from hsx-server(s), for online training of draft models."""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from .client import Client
from .preflight import preflight
from .sample import Sample
from .sharding import distributed_rank, epoch_order, share, this_consumer


class OnlineDataset(IterableDataset):
    """Yields hsx.Sample objects (torch tensors), the shape Client and read_sample
    give: hidden_states [T, L, H], token_ids [T] int64, loss_mask [T] int64 when the
    sample has one, final_norm_hidden_states [T, H] with final_norm=True; .index is
    the sample's position in `samples`, .sample_id its "id" (or the index). With
    dtype="fp8" the states travel as e4m3 with a scale per token per layer (half of bf16's
    bytes) and are yielded dequantized, as bf16 tensors (hsx.fp8); with dequantize=False
    as received: torch.float8_e4m3fn hidden_states with float32 hidden_states_scales
    [T, L, 1] (and final_norm_hidden_states_scales [T, 1]), what read_sample(...,
    dequantize=False) gives, for a trainer that dequantizes on its GPU (half the bytes
    to copy there). dequantize has no effect on other dtypes.

    samples: a sequence of dicts with "input_ids" and optionally "loss_mask", "id".
    servers: addresses; each consumer spreads its samples over all of them, round-robin.

    Sharding (hsx.sharding): a consumer is one DataLoader worker of one
    torch.distributed rank (rank and world_size given, or torch.distributed's when
    initialised); consumer c of C takes positions c, c + C, ... of the epoch's order,
    so every sample goes to exactly one consumer per epoch. The order is the input
    order, or with `seed` a permutation fixed by (seed, epoch) (set_epoch; the same on
    every rank). ordered=True (the default with a seed) yields each consumer's share
    in that order; ordered=False in completion order (more throughput, no fixed order).
    Shares differ by at most one sample: a DDP loop that needs the same number of steps
    on every rank stops each epoch at len(samples) // consumers samples per consumer.

    Back-pressure: at most `concurrency` samples per consumer are in flight or
    received and waiting to be consumed; a slow consumer holds no more than that.

    Delivery guarantee: exactly once per epoch, to the one consumer whose share it is.
    A sample is yielded only after its whole stream arrived and passed every check
    (IntegrityError otherwise); a broken stream (the server killed or restarted, the
    connection lost) is retried from scratch -- UNAVAILABLE, DEADLINE_EXCEEDED and
    RESOURCE_EXHAUSTED, `retries` times with backoff capped at 10 s, about 4.5 minutes
    for the default 30 -- and a restarted server on the same address is reconnected to.
    Nothing of a half-received stream is ever yielded, so a retry repeats no sample;
    if the server stays away longer, iteration raises ServerError (nothing is skipped
    silently).

    Before its first sample each consumer checks every server (hsx.preflight): it
    answers within `connect_timeout` seconds (else ServerUnreachable), accepts the
    token (else ServerError), and serves the model `expect` names (hidden_size,
    vocab_size, num_layers; else ModelMismatch); check() runs the same in the caller.

    With DataLoader workers, use multiprocessing_context="spawn" if the parent
    process has used gRPC already (check() included): gRPC does not survive fork()
    by default. set_epoch reaches workers that are started per epoch (the default,
    persistent_workers=False).
    """

    def __init__(self, samples: Sequence[Mapping[str, Any]], servers: str | Sequence[str], concurrency: int = 8,
                 capture: Sequence[int] | None = None, dtype: str | None = None, final_norm: bool = False,
                 token: str | None = None, tls: bool | dict[str, Any] | None = None, retries: int = 30,
                 ordered: bool | None = None, seed: int | None = None, rank: int | None = None,
                 world_size: int | None = None, connect_timeout: float = 20.0,
                 expect: Mapping[str, int] | None = None, dequantize: bool = True) -> None:
        super().__init__()
        if concurrency < 1:
            raise ValueError(f"concurrency {concurrency}: expected at least 1")
        self.samples = samples
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        if not self.servers:
            raise ValueError("servers: expected at least one address")
        self.concurrency = concurrency
        self.options = dict(capture=capture, dtype=dtype, final_norm=final_norm, dequantize=dequantize)
        self.client_options = dict(token=token, tls=tls, retries=retries)
        self.ordered = seed is not None if ordered is None else ordered
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self.connect_timeout = connect_timeout
        self.expect = dict(expect or {})
        self.epoch = 0

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a spawned DataLoader worker, in the rank's process: the worker has no
        process group of its own, so it gets the rank's place (hsx.sharding.distributed_rank)."""
        state = dict(self.__dict__)
        if state["rank"] is None or state["world_size"] is None:
            state["rank"], state["world_size"] = distributed_rank()
        return state

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order (with a seed) the next iteration follows."""
        self.epoch = epoch

    def indices(self) -> list[int]:
        """The sample indices this consumer takes this epoch, in order."""
        return share(epoch_order(len(self.samples), self.seed, self.epoch), this_consumer(self.rank, self.world_size))

    def check(self) -> list[dict[str, Any]]:
        """Every server's ModelInfo, after the checks each consumer makes before its first
        sample (see the class doc)."""
        return preflight(self.servers, self.client_options["token"], self.client_options["tls"],
                         self.connect_timeout, self.expect, self.options["capture"])

    def __iter__(self) -> Iterator[Sample]:
        indices = self.indices()
        self.check()
        clients = [Client(s, **self.client_options) for s in self.servers]
        try:
            yield from _fetch(clients, self.samples, indices, self.concurrency, self.ordered, self.options)
        finally:
            for client in clients:
                client.close()


def _fetch(clients: list[Client], samples: Sequence[Mapping[str, Any]], indices: list[int], concurrency: int,
           ordered: bool, options: dict[str, Any]) -> Iterator[Sample]:
    """The samples at `indices`, sample k from clients[k % len(clients)], with at most
    `concurrency` in flight or waiting; in the order of `indices` when ordered."""
    pool = concurrent.futures.ThreadPoolExecutor(concurrency)
    window: collections.deque[concurrent.futures.Future] = collections.deque()
    source = iter(enumerate(indices))

    def submit() -> None:
        for k, i in source:
            row = samples[i]
            window.append(pool.submit(clients[k % len(clients)].extract, row["input_ids"],
                                      sample_id=str(row.get("id", i)), loss_mask=row.get("loss_mask"), index=i,
                                      torch=True, **options))
            return

    def take() -> Sample:
        if not ordered:
            done, _ = concurrent.futures.wait(window, return_when=concurrent.futures.FIRST_COMPLETED)
            first = next(f for f in window if f in done)  # the earliest submitted of those done
            window.remove(first)
            return first.result()
        return window.popleft().result()

    try:
        for _ in range(concurrency):
            submit()
        while window:
            ready = [take()]
            submit()
            # No name here holds the sample while the caller has it: one the caller has let go
            # of is freed before the next ones arrive.
            yield ready.pop()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
