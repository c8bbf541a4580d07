"""hsx.OnlineDataset: a torch IterableDataset that streams training-ready samples
straight from hsx-server(s), for online training of draft models."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from .client import Client
from .sample import Sample


class OnlineDataset(IterableDataset):
    """Yields hsx.Sample objects (torch tensors), the shape Client and read_sample
    give: hidden_states [T, L, H], token_ids [T] int64, loss_mask [T] int64 when the
    sample has one, final_norm_hidden_states [T, H] with final_norm=True; .index is
    the sample's position in `samples`, .sample_id its "id" (or the index). With
    dtype="fp8" the states travel as e4m3 with a scale per token per layer (half of bf16's
    bytes) and are yielded dequantized, as bf16 tensors (hsx.fp8).

    samples: a sequence of dicts with "input_ids" and optionally "loss_mask", "id".
    servers: addresses; each worker spreads its samples over all of them.
    With DataLoader workers, worker w of n takes samples w, w + n, w + 2n, ...,
    so every sample is yielded exactly once per epoch. At most `concurrency`
    samples per worker are in flight or waiting (bounded prefetch). A server
    restart costs retries (the client backs off and retries UNAVAILABLE for up
    to `retries` attempts per sample), not samples. Samples come in completion
    order; set ordered=True for input order (at some cost in throughput).

    With DataLoader workers, use multiprocessing_context="spawn" if the parent
    process has used gRPC already: gRPC does not survive fork() by default.
    """

    def __init__(self, samples: Sequence[Mapping[str, Any]], servers: str | Sequence[str], concurrency: int = 8,
                 capture: Sequence[int] | None = None, dtype: str | None = None, final_norm: bool = False,
                 token: str | None = None, tls: bool | dict[str, Any] | None = None, retries: int = 30,
                 ordered: bool = False) -> None:
        super().__init__()
        self.samples = samples
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self.concurrency = concurrency
        self.options = dict(capture=capture, dtype=dtype, final_norm=final_norm)
        self.client_options = dict(token=token, tls=tls, retries=retries)
        self.ordered = ordered

    def _my_indices(self) -> range:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        return range(worker, len(self.samples), workers)

    def __iter__(self) -> Iterator[Sample]:
        indices = list(self._my_indices())
        clients = [Client(s, **self.client_options) for s in self.servers]
        try:
            # Round-robin over servers: one extract_many per server, interleaved.
            streams = [clients[k].extract_many(
                ({**self.samples[i], "id": self.samples[i].get("id", i)} for i in indices[k::len(clients)]),
                concurrency=max(1, self.concurrency // len(clients)), torch=True, **self.options)
                for k in range(len(clients))]
            maps = [indices[k::len(clients)] for k in range(len(clients))]
            produced = (
                (maps[k][local], sample)
                for k, stream in enumerate(streams) for local, sample in stream
            ) if len(clients) == 1 else _interleave(streams, maps)
            if self.ordered:
                produced = _in_order(produced, indices)
            for index, sample in produced:
                sample.index = index  # extract_many numbered the samples of one server's share
                yield sample
        finally:
            for client in clients:
                client.close()


def _interleave(streams, maps):
    iterators = [iter(s) for s in streams]
    live = list(range(len(iterators)))
    while live:
        for k in list(live):
            item = next(iterators[k], None)
            if item is None:
                live.remove(k)
                continue
            local, sample = item
            yield maps[k][local], sample


def _in_order(produced, indices):
    waiting = {}
    expected = iter(indices)
    want = next(expected, None)
    for index, sample in produced:
        waiting[index] = sample
        while want in waiting:
            yield want, waiting.pop(want)
            want = next(expected, None)
