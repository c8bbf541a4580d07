"""--shard I/N, as hsx-dump, hsx-verify (client/dump/shard.h), hsx.prepare and
hsx.convert read it: of N processes, number I takes the samples whose index % N == I."""

from __future__ import annotations

import argparse


def parse_shard(text: str) -> tuple[int, int]:
    """(I, N) from "I/N" with N >= 1 and 0 <= I < N; ValueError naming the form otherwise."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected I/N, e.g. 0/4") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"--shard {text!r}: needs N >= 1 and 0 <= I < N")
    return index, count


def shard_arg(text: str) -> tuple[int, int]:
    """parse_shard as an argparse `type` (its ValueError as a usage error)."""
    try:
        return parse_shard(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def in_shard(sample_index: int, shard: tuple[int, int]) -> bool:
    """True when the sample with this index belongs to shard (I, N)."""
    return sample_index % shard[1] == shard[0]
