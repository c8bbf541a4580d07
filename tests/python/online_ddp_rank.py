"""One rank of test_online_dataset's 2-rank DDP run: joins a gloo process group
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment), iterates
hsx.OnlineDataset through a DataLoader with two spawned workers, and gathers
which samples every consumer (rank, worker) saw.

    python online_ddp_rank.py SERVER SAMPLES.json OUT.json

Rank 0 writes OUT.json: {"seen": [[rank, worker, index, token_ids_ok], ...]}."""

import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, get_worker_info

import hsx


class Tagged(torch.utils.data.IterableDataset):
    """The online dataset's samples, each tagged with the worker that received it."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        worker = get_worker_info().id
        for sample in self.inner:
            yield {"worker": worker, "index": sample.index, "token_ids": sample["token_ids"]}


def main(server, samples_path, out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    samples = json.loads(open(samples_path).read())
    dataset = hsx.OnlineDataset(samples, server, concurrency=3, seed=5)
    loader = DataLoader(Tagged(dataset), batch_size=None, num_workers=2, multiprocessing_context="spawn")
    seen = [[rank, item["worker"], item["index"], item["token_ids"].tolist() == samples[item["index"]]["input_ids"]]
            for item in loader]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seen)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"seen": [row for part in gathered for row in part]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
