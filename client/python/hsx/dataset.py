"""hsx.OnlineDataset: a torch IterableDataset that streams training-ready samples
straight from hsx-server(s), for online training of draft models."""

import itertools

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .client import Client


class OnlineDataset(IterableDataset):
    """Yields dicts with input_ids [T] int64, loss_mask [T] int64, hidden_states
    [T, L, H] and, with final_norm=True, final_norm_hidden_states [T, H].

    samples: a sequence of dicts with "input_ids" and optionally "loss_mask".
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

    def __init__(self, samples, servers, concurrency=8, capture=None, dtype=None, final_norm=False,
                 token=None, tls=None, retries=30, ordered=False):
        super().__init__()
        self.samples = samples
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self.concurrency = concurrency
        self.options = dict(capture=capture, dtype=dtype, final_norm=final_norm)
        self.client_options = dict(token=token, tls=tls, retries=retries)
        self.ordered = ordered

    def _my_indices(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        return range(worker, len(self.samples), workers)

    def __iter__(self):
        indices = list(self._my_indices())
        clients = [Client(s, **self.client_options) for s in self.servers]
        try:
            # Round-robin over servers: one extract_many per server, interleaved.
            streams = [clients[k].extract_many(
                (self.samples[i] for i in indices[k::len(clients)]),
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
                yield self._training_dict(index, sample)
        finally:
            for client in clients:
                client.close()

    def _training_dict(self, index, sample):
        row = self.samples[index]
        ids = sample["token_ids"]
        mask = row.get("loss_mask")
        out = {
            "index": index,
            "input_ids": ids,
            "loss_mask": torch.as_tensor(mask, dtype=torch.int64) if mask is not None else torch.ones_like(ids),
            "hidden_states": sample["hidden_states"],
        }
        if "final_norm_hidden_states" in sample:
            out["final_norm_hidden_states"] = sample["final_norm_hidden_states"]
        return out


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
    for index, sample in itertools.chain(produced):
        waiting[index] = sample
        while want in waiting:
            yield want, waiting.pop(want)
            want = next(expected, None)
