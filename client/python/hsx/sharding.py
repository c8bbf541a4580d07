"""Which samples one consumer of an epoch takes: torch.distributed ranks times
DataLoader workers, each consumer a disjoint share, together all samples.

A consumer is one DataLoader worker of one rank (or the rank itself without
workers): consumer = rank * workers + worker, of world_size * workers. The
epoch's order is the input order, or with a seed a permutation that depends only
on (seed, epoch), so every rank computes the same one without talking to the
others; consumer c takes positions c, c + consumers, c + 2 * consumers, ... of
it. Every sample goes to exactly one consumer, and the shares differ in size by
at most one sample.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Consumer:
    """This process's place among an epoch's consumers: number `index` of `count`."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"consumer {self.index} of {self.count}: expected 0 <= index < count")


def this_consumer(rank: int | None = None, world_size: int | None = None) -> Consumer:
    """The calling process's Consumer: rank and world size given, or torch.distributed's
    when it is initialised (else rank 0 of 1), times the DataLoader worker it runs in."""
    if rank is None or world_size is None:
        rank, world_size = distributed_rank()
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    workers, worker = (info.num_workers, info.id) if info else (1, 0)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}: expected 0 <= rank < world size")
    return Consumer(rank * workers + worker, world_size * workers)


def distributed_rank() -> tuple[int, int]:
    """(rank, world size) of torch.distributed's default group, or (0, 1) when it is not
    initialised (as in a spawned DataLoader worker: a dataset records its rank's place
    when it is pickled for the worker, in the rank's process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def epoch_order(count: int, seed: int | None, epoch: int = 0) -> list[int]:
    """The sample indices of an epoch in the order they are trained: input order without
    a seed, else a permutation fixed by (seed, epoch) alone."""
    order = list(range(count))
    if seed is not None:
        random.Random(f"hsx-epoch:{seed}:{epoch}").shuffle(order)
    return order


def share(order: list[int], consumer: Consumer) -> list[int]:
    """The consumer's part of an epoch's order, in that order."""
    return order[consumer.index::consumer.count]
