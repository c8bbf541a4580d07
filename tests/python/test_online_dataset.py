"""hsx.OnlineDataset as trainers use it: shared over torch.distributed ranks and
DataLoader workers (every sample to exactly one consumer per epoch, a seeded order
that is the same on every rank), bounded under back-pressure, exactly once across
a server restart, and a clear error at start for a wrong address, a refused token
or a model other than the one the trainer expects."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import hsx
from hsx.preflight import ModelMismatch, ServerUnreachable
from hsx.sharding import Consumer, epoch_order, share
from dump_helpers import free_port
from hsx_server import HsxServer
from test_python_client import HIDDEN, VOCAB, N, rows

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def server(bin_dir, tiny):
    with HsxServer(bin_dir, tiny, metrics=False) as srv:
        yield srv


# --------------------------------------------------------------------------- sharding, no server


@pytest.mark.parametrize("count,consumers", [(0, 1), (1, 4), (17, 4), (24, 6), (5, 1)])
def test_shares_are_disjoint_and_cover_the_epoch(count, consumers):
    for seed in (None, 3):
        order = epoch_order(count, seed, epoch=1)
        shares = [share(order, Consumer(c, consumers)) for c in range(consumers)]
        flat = [i for s in shares for i in s]
        assert sorted(flat) == list(range(count))  # each sample once
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_seeded_order_is_fixed_by_seed_and_epoch():
    assert epoch_order(50, 7, 0) == epoch_order(50, 7, 0)
    assert epoch_order(50, 7, 0) != epoch_order(50, 7, 1) != epoch_order(50, 8, 0)
    assert epoch_order(50, None, 3) == list(range(50))


def test_consumer_numbering_spans_ranks_and_workers():
    dataset = hsx.OnlineDataset(rows(10), "unused:1", rank=1, world_size=2, seed=1)
    # Outside a DataLoader worker, rank 1 of 2 is consumer 1 of 2.
    assert dataset.indices() == epoch_order(10, 1)[1::2]
    with pytest.raises(ValueError, match="rank 2 of world size 2"):
        hsx.OnlineDataset(rows(3), "unused:1", rank=2, world_size=2).indices()


# --------------------------------------------------------------------------- against hsx-server


def test_two_rank_gloo_ddp_with_two_workers_each_sees_every_sample_once(server, tmp_path):
    """Two real torch.distributed ranks (gloo), two DataLoader workers each: four consumers."""
    samples = rows(37, seed=21)
    (tmp_path / "samples.json").write_text(json.dumps(samples))
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, HERE / "online_ddp_rank.py", server.address, tmp_path / "samples.json",
                               tmp_path / "seen.json"], env={**env, "RANK": str(r)}, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    errors = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    seen = json.loads((tmp_path / "seen.json").read_text())["seen"]
    assert all(ok for *_, ok in seen)
    assert sorted(i for _, _, i, _ in seen) == list(range(len(samples)))  # exactly once in the epoch
    order = epoch_order(len(samples), 5)
    for rank in range(2):
        for worker in range(2):
            mine = [i for r, w, i, _ in seen if (r, w) == (rank, worker)]
            assert mine == share(order, Consumer(rank * 2 + worker, 4))  # the seeded order, per consumer


def test_window_bounds_what_is_in_flight_or_waiting(server, monkeypatch):
    """A consumer that stops taking samples holds at most `concurrency` of them."""
    started = []
    original = hsx.Client.extract
    monkeypatch.setattr(hsx.Client, "extract", lambda self, *a, **k: (started.append(1), original(self, *a, **k))[1])
    iterator = iter(hsx.OnlineDataset(rows(40, seed=2), server.address, concurrency=3, seed=0))
    next(iterator)
    deadline = time.monotonic() + 10
    while len(started) < 4 and time.monotonic() < deadline:  # the window fills
        time.sleep(0.02)
    time.sleep(0.5)  # plenty for more to start, had nothing held them back
    assert len(started) == 4  # the one taken + 3 in the window, and no more
    iterator.close()


def test_server_killed_and_restarted_mid_epoch_loses_and_repeats_nothing(bin_dir, tiny):
    """kill -9 after 6 samples, a new server on the same port a second later: the epoch's
    order is yielded exactly, each sample once (a broken stream is retried from scratch)."""
    address = f"127.0.0.1:{free_port()}"
    servers = [HsxServer(bin_dir, tiny, listen=address, metrics=False).start()]
    dataset = hsx.OnlineDataset(rows(24, seed=9), address, concurrency=3, seed=4)
    seen, restart = [], None
    try:
        for sample in dataset:
            seen.append(sample.index)
            if len(seen) == 6:
                servers[0].kill()
                restart = threading.Thread(target=lambda: (time.sleep(1.0), servers.append(
                    HsxServer(bin_dir, tiny, listen=address, metrics=False).start())))
                restart.start()
    finally:
        if restart is not None:
            restart.join(timeout=60)  # no server started after the others are stopped
        for srv in servers:
            srv.kill()
    assert len(servers) == 2, "the server was never restarted"
    assert seen == dataset.indices()


def test_a_wrong_address_fails_at_start_not_after_the_retries(tmp_path):
    dataset = hsx.OnlineDataset(rows(4), f"127.0.0.1:{free_port()}", connect_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(ServerUnreachable, match=r"did not answer within 1 s"):
        next(iter(dataset))
    assert time.monotonic() - start < 10  # the per-sample retries would take minutes
    # Through DataLoader workers too: the worker's error reaches the training loop.
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(ServerUnreachable, match="did not answer"):
        next(iter(loader))


def test_a_refused_token_fails_at_start(bin_dir, tiny, tmp_path):
    (tmp_path / "token").write_text("right-token\n")
    with HsxServer(bin_dir, tiny, "--auth-token-file", tmp_path / "token", metrics=False) as srv:
        for token, code in ((None, "UNAUTHENTICATED"), ("wrong-token", "PERMISSION_DENIED")):
            with pytest.raises(hsx.ServerError, match=f"{code}: hsx-server {srv.address} refused the token"):
                next(iter(hsx.OnlineDataset(rows(4), srv.address, token=token)))
        # Without a seed samples come as they complete: every one, in any order.
        assert sorted(s.index for s in hsx.OnlineDataset(rows(4), srv.address, token="right-token")) == [0, 1, 2, 3]


@pytest.mark.parametrize("field,value", [("hidden_size", 256), ("vocab_size", 32000), ("num_layers", 61)])
def test_a_model_other_than_the_expected_one_fails_at_start(server, field, value):
    expect = {"hidden_size": HIDDEN, "vocab_size": VOCAB, "num_layers": N, field: value}
    with pytest.raises(ModelMismatch, match=f"with {field} .* has {field} {value}: a different model"):
        next(iter(hsx.OnlineDataset(rows(4), server.address, expect=expect)))


def test_capture_ids_beyond_the_model_fail_at_start(server):
    with pytest.raises(ModelMismatch, match=r"capture ids \[9\] are not layers"):
        next(iter(hsx.OnlineDataset(rows(4), server.address, capture=[2, 9])))


@pytest.mark.parametrize("config,expected", [
    ({"hidden_size": 64, "vocab_size": 2048, "num_hidden_layers": 4}, {"hidden_size": 64, "vocab_size": 2048,
                                                                       "num_layers": 4}),
    ({"vocab_size": 32, "text_config": {"hidden_size": 64, "vocab_size": 4096, "num_hidden_layers": 2}},
     {"hidden_size": 64, "vocab_size": 4096, "num_layers": 2}),  # K2.5: the language model's, as the server reads
])
def test_the_expected_model_comes_from_where_the_server_reads_the_config(tmp_path, config, expected):
    """config_expectation (the adapters' preflight) reads a nested config's text_config, as hsx-server
    does, even when the top level has fields of its own (hsx.prepare's vocabulary size, through the
    same hsx.model_config: test_prepare_cli's "nested-wins")."""
    from hsx.preflight import config_expectation
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert config_expectation(tmp_path) == expected
