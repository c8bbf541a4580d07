"""The Python package (client/python, installed with pip): Client, OnlineDataset,
read_sample and the format converters, against real hsx-server processes."""

import json
import random
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import hsx
from hsx.convert import convert
from dump_helpers import NATIVE_BUILT, RECEIVE_PATHS
from hsx_server import HsxServer

VOCAB = 2048
HIDDEN = 128
N = 8




def rows(count, seed=0, max_len=60, with_mask=True):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = rng.randrange(1, max_len)
        row = {"id": f"r{i}", "input_ids": [rng.randrange(VOCAB) for _ in range(n)]}
        if with_mask:
            row["loss_mask"] = [rng.randrange(2) for _ in range(n)]
        out.append(row)
    return out




@pytest.fixture(scope="module")
def server(bin_dir, tiny):
    with HsxServer(bin_dir, tiny) as srv:
        yield srv


def dump(run, model, samples, out, *flags):
    path = out.with_suffix(".jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in samples))
    run("hsx-dump", "--model", model, "--input", path, "--out", out, *flags)
    return out


@pytest.mark.parametrize("native", RECEIVE_PATHS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_client_equals_hsx_dump_byte_for_byte(run, tiny, server, tmp_path, dtype, native):
    samples = rows(6, seed=1)
    out = dump(run, tiny, samples, tmp_path / "dump", "--capture", "1,4,8", "--final-norm", "--dtype", dtype)
    client = hsx.Client(server.address, native=native)
    assert client.native == native
    got = dict(client.extract_many(samples, concurrency=3, capture=[1, 4, 8], final_norm=True, dtype=dtype))
    assert sorted(got) == list(range(len(samples)))
    for i, sample in got.items():
        ref = hsx.read_sample(out / f"hs_{i}.safetensors")
        assert sample.capture_ids == [1, 4, 8]
        for key in ("hidden_states", "token_ids", "final_norm_hidden_states"):
            assert sample[key].dtype == ref[key].dtype, key
            assert sample[key].shape == ref[key].shape, key
            assert sample[key].tobytes() == ref[key].tobytes(), (i, key)


@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_torch_output_and_read_sample_agree_with_safetensors(run, tiny, server, tmp_path, native):
    samples = rows(2, seed=2)
    out = dump(run, tiny, samples, tmp_path / "dump")
    client = hsx.Client(server.address, native=native)
    for i, row in enumerate(samples):
        sample = client.extract(row["input_ids"], torch=True)
        ref = load_file(str(out / f"hs_{i}.safetensors"))
        assert sample["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(sample["hidden_states"], ref["hidden_states"])
        assert torch.equal(sample["token_ids"], ref["token_ids"])
        mapped = hsx.read_sample(out / f"hs_{i}.safetensors", torch=True)
        assert torch.equal(mapped["loss_mask"], ref["loss_mask"])
        assert mapped.capture_ids == [2, 4, 5, 8]


@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_bad_request_raises_server_error(server, native):
    client = hsx.Client(server.address, native=native)
    with pytest.raises(hsx.ServerError) as error:
        client.extract([1, VOCAB + 5])
    assert error.value.code.name == "INVALID_ARGUMENT"


@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_default_capture_leaves_the_final_norm_to_the_server(bin_dir, tiny, native):
    """No capture ids: the server's default set, plus the final norm where it runs with --final-norm."""
    with HsxServer(bin_dir, tiny, "--final-norm") as srv:
        client = hsx.Client(srv.address, native=native)
        sample = client.extract([3, 1, 4, 1, 5])
        assert sample.capture_ids == [2, 4, 5, 8]
        assert sample["final_norm_hidden_states"].shape == (5, HIDDEN)
        assert "final_norm_hidden_states" not in client.extract([3, 1, 4], capture=[2])


@pytest.mark.skipif(not NATIVE_BUILT, reason="hsx._native is not built")
def test_native_arrays_are_writable_and_outlive_their_client(server):
    ids = list(range(1, 40))
    client = hsx.Client(server.address, native=True)
    sample = client.extract(ids, capture=[1, 8], final_norm=True, dtype="fp32")
    client.close()
    del client
    import gc
    gc.collect()
    reference = hsx.Client(server.address, native=False).extract(ids, capture=[1, 8], final_norm=True, dtype="fp32")
    for key in ("hidden_states", "final_norm_hidden_states"):
        array = sample[key]
        assert array.flags.writeable and array.flags.c_contiguous, key
        assert array.tobytes() == reference[key].tobytes(), key
    sample["hidden_states"][0, 0, 0] = 7.0
    assert sample["hidden_states"][0, 0, 0] == 7.0


@pytest.mark.skipif(not NATIVE_BUILT, reason="hsx._native is not built")
def test_extract_many_keeps_no_sample_the_caller_let_go_of(server):
    """A sample the caller drops is freed before extract_many starts the next call: with
    concurrency 1 and samples of one size, the native path writes every sample into the same
    pooled block (if extract_many still held the previous sample, two blocks would alternate)."""
    client = hsx.Client(server.address, native=True)
    addresses = []
    for _, sample in client.extract_many([[5, 6, 7, 8] * 8] * 6, concurrency=1, capture=[1, 8]):
        addresses.append(sample["hidden_states"].ctypes.data)
        del sample
    client.close()
    assert len(set(addresses)) == 1, addresses


def test_the_receive_path_is_chosen_as_documented(monkeypatch):
    assert hsx.Client("127.0.0.1:1").native == NATIVE_BUILT
    assert not hsx.Client("127.0.0.1:1", native=False).native
    monkeypatch.setenv("HSX_NATIVE", "0")
    assert not hsx.Client("127.0.0.1:1").native
    monkeypatch.setattr(hsx.client, "_native", None)
    monkeypatch.delenv("HSX_NATIVE")
    assert not hsx.Client("127.0.0.1:1").native
    monkeypatch.setattr(hsx.client, "_NATIVE_MISSING", "libgrpc++.so.1.51: cannot open shared object file")
    with pytest.raises(ImportError, match=r"hsx._native cannot be used \(libgrpc\+\+.so.1.51: cannot open"):
        hsx.Client("127.0.0.1:1", native=True)


@pytest.mark.parametrize("native", RECEIVE_PATHS)
@pytest.mark.parametrize("window", [0, 64 << 10, hsx.client.DEFAULT_STREAM_WINDOW])
def test_every_stream_window_gives_the_same_samples(server, native, window):
    """The window only paces the stream: the smallest one (many window updates per sample) and
    gRPC's automatic one give what the default gives."""
    samples = rows(6, seed=5, max_len=300, with_mask=False)
    want = {i: s["hidden_states"] for i, s in hsx.Client(server.address, native=native).extract_many(
        samples, capture=[0, 8], dtype="fp32")}
    with hsx.Client(server.address, native=native, stream_window=window) as client:
        got = {i: s["hidden_states"] for i, s in client.extract_many(samples, capture=[0, 8], dtype="fp32")}
    assert sorted(got) == sorted(want)
    for i in want:
        np.testing.assert_array_equal(got[i], want[i])


@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_the_stream_window_reaches_the_channel_before_the_callers_options(monkeypatch, native):
    """Client's stream_window becomes the two channel arguments hsx-dump sets (a fixed window,
    BDP probing off), on either receive path; options given for the same arguments come later,
    so they win (gRPC keeps the last of repeated channel arguments)."""
    seen = {}
    owner, name = (hsx.client._native, "Channel") if native else (hsx.client.grpc, "insecure_channel")
    real = getattr(owner, name)

    def recording(target, options, **kwargs):
        seen["options"] = options
        return real(target, options=options, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    hsx.Client("127.0.0.1:1", native=native, options=[("grpc.http2.lookahead_bytes", 1 << 20)])
    options = [o for o in seen["options"] if o[0].startswith("grpc.http2.")]
    assert options == [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4 << 20),
                       ("grpc.http2.lookahead_bytes", 1 << 20)]
    seen.clear()
    hsx.Client("127.0.0.1:1", native=native, stream_window=0)
    assert not [o for o in seen["options"] if o[0].startswith("grpc.http2.")]


@pytest.mark.parametrize("window", [-1, 1, (64 << 10) - 1, (1 << 30) + 1, 1.5, "4MiB", True, None])
def test_a_stream_window_out_of_range_is_refused_naming_it(window):
    with pytest.raises(ValueError, match=r"stream_window=.*: expected 0 \(gRPC's automatic window\) or a number "
                                         r"of bytes from 65536 \(64 KiB\) to 1073741824 \(1 GiB\)"):
        hsx.Client("127.0.0.1:1", stream_window=window)


def test_the_stream_window_default_and_bounds_are_hsx_dumps(bin_dir, tmp_path):
    """The Python client repeats hsx-dump's window constants (two languages): its default is
    hsx-dump's --stream-window default, and hsx-dump refuses exactly outside the same bounds (a
    refused window is an error of its own; an allowed one goes on to the unreachable server)."""
    import re
    import subprocess

    dump = str(bin_dir / "hsx-dump")
    helpfull = subprocess.run([dump, "--helpfull"], capture_output=True, text=True, timeout=60).stdout
    default = re.search(r"--stream_window \(.*?\); default: \"(\d+)MiB\";", helpfull, re.S)
    assert default and int(default.group(1)) << 20 == hsx.client.DEFAULT_STREAM_WINDOW
    low, high = hsx.client._MIN_STREAM_WINDOW, hsx.client._MAX_STREAM_WINDOW
    for window, refused in ((low - 1, True), (low, False), (high, False), (high + 1, True)):
        proc = subprocess.run([dump, "--server", "127.0.0.1:1", "--retries", "0", "--input", "/dev/null", "--out",
                               str(tmp_path / str(window)), f"--stream-window={window}"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0
        said = "a stream window of" if refused else "server 127.0.0.1:1: GetModelInfo: UNAVAILABLE"
        assert said in proc.stderr, (window, proc.stderr)


def test_a_native_module_that_does_not_load_leaves_the_grpcio_path(tmp_path):
    """A broken or foreign hsx/_native*.so (e.g. built against a libgrpc++ this machine lacks):
    the package still imports, Client(native=None) takes grpcio, native=True says why not."""
    import importlib.machinery
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    package = tmp_path / "hsx"
    shutil.copytree(Path(hsx.__file__).parent, package,
                    ignore=shutil.ignore_patterns("_native*", "__pycache__"))
    (package / ("_native" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"not an ELF file")
    probe = ("import hsx\n"
             "print(hsx.Client('127.0.0.1:1').native)\n"
             "try:\n    hsx.Client('127.0.0.1:1', native=True)\nexcept ImportError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "False"
    assert lines[1].startswith("hsx._native cannot be used (") and "not built" not in lines[1], lines


def _sockets_connected_to(port):
    """The inodes of this process's established TCP sockets whose peer port is `port`."""
    import os

    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            ours.add(link[len("socket:["):-1])
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01" and fields[9] in ours:
                    found.add(fields[9])
    return found


@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_a_client_holds_one_connection_per_server(server, native):
    """GetModelInfo and Extract share the receive path's channel (the native path makes no
    grpcio channel at all)."""
    port = int(server.address.rsplit(":", 1)[1])
    before = _sockets_connected_to(port)
    client = hsx.Client(server.address, native=native)
    assert client.model_info()["hidden_size"] == HIDDEN
    assert client.extract([5, 6, 7], capture=[1])["hidden_states"].shape == (3, 1, HIDDEN)
    assert len(_sockets_connected_to(port) - before) == 1
    client.close()
    if native:  # the module's channel refuses calls once closed
        with pytest.raises(hsx.ServerError, match="CANCELLED.*the client was closed"):
            client.model_info()


MALLOC_PROBE = """
import ctypes, threading
from hsx import _native
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
_native.Channel("127.0.0.1:1")
mapped = libc.mallinfo2().hblkhd
libc.malloc(3 << 20)
print(libc.mallinfo2().hblkhd - mapped)
# Eight threads allocating at once; malloc_stats() writes one "Arena N:" block per arena to stderr.
all_allocated = threading.Barrier(9)
def allocate():
    libc.malloc(1000)
    all_allocated.wait()
    all_allocated.wait()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
all_allocated.wait()
libc.malloc_stats()
all_allocated.wait()
for thread in threads:
    thread.join()
"""


@pytest.mark.skipif(not NATIVE_BUILT, reason="hsx._native is not built")
@pytest.mark.parametrize("setting", [None, "0"])
def test_the_native_modules_malloc_settings_can_be_left_alone(setting):
    """The first native Channel raises glibc's mmap threshold to 4 MiB (a 3 MiB block then comes
    from the heap; glibc's default maps it) and allows two malloc arenas (eight threads allocating
    at once share them; glibc's default gives them arenas of their own), unless
    HSX_NATIVE_MALLOPT=0."""
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("HSX_NATIVE_MALLOPT", "MALLOC_ARENA_MAX")}
    if setting is not None:
        env["HSX_NATIVE_MALLOPT"] = setting
    proc = subprocess.run([sys.executable, "-c", MALLOC_PROBE], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    newly_mapped = int(proc.stdout)
    arenas = len(re.findall(r"^Arena \d+:", proc.stderr, re.MULTILINE))
    if setting == "0":
        assert newly_mapped >= 3 << 20
        assert arenas > 2, proc.stderr
    else:
        assert newly_mapped == 0
        assert arenas == 2, proc.stderr


def test_online_dataset_two_workers_yield_each_sample_once(server):
    samples = rows(24, seed=3)
    dataset = hsx.OnlineDataset(samples, [server.address, server.address], concurrency=4)
    # gRPC does not survive fork() once it is initialised in the parent (as it is
    # here, by earlier tests): training scripts start workers with "spawn".
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                         multiprocessing_context="spawn")
    seen = []
    for item in loader:
        assert isinstance(item, hsx.Sample)  # the one shape, also through DataLoader workers
        i = item.index
        seen.append(i)
        assert item.sample_id == samples[i]["id"]
        assert item["token_ids"].tolist() == samples[i]["input_ids"]
        assert item["loss_mask"].tolist() == samples[i]["loss_mask"]
        assert tuple(item["hidden_states"].shape) == (len(samples[i]["input_ids"]), 4, HIDDEN)
    assert sorted(seen) == list(range(len(samples)))


# A server killed and restarted mid-iteration: test_online_dataset.py (the exact order, each sample once).


def test_converters_write_what_each_trainer_loads(run, tiny, tmp_path):
    samples = rows(5, seed=5)
    out = dump(run, tiny, samples, tmp_path / "dump", "--capture", "eagle3", "--final-norm")
    # SpecForge: rows_{g}-{g+2000}/data_{i}.ckpt, hidden_state post-norm [1, T, H], aux [1, T, 3H]
    assert convert(out, "specforge", tmp_path / "sf") == 5
    for i, row in enumerate(samples):
        t = len(row["input_ids"])
        d = torch.load(tmp_path / "sf" / "rows_0-2000" / f"data_{i}.ckpt")
        assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert d["input_ids"].dtype == torch.int64 and d["input_ids"].tolist() == row["input_ids"]
        assert d["loss_mask"].dtype == torch.int64 and d["loss_mask"].tolist() == row["loss_mask"]
        assert tuple(d["hidden_state"].shape) == (1, t, HIDDEN)
        assert tuple(d["aux_hidden_state"].shape) == (1, t, 3 * HIDDEN)
        ref = hsx.read_sample(out / f"hs_{i}.safetensors", torch=True)
        assert torch.equal(d["hidden_state"][0], ref["final_norm_hidden_states"])
        assert torch.equal(d["aux_hidden_state"][0, :, HIDDEN:2 * HIDDEN], ref["hidden_states"][:, 1])
    # ModelOpt: data_{i}.pt, the id in conversation_id
    assert convert(out, "modelopt", tmp_path / "mo") == 5
    for i, row in enumerate(samples):
        t = len(row["input_ids"])
        d = torch.load(tmp_path / "mo" / f"data_{i}.pt")
        assert set(d) == {"input_ids", "hidden_states", "aux_hidden_states", "conversation_id", "loss_mask"}
        assert d["conversation_id"] == row["id"]
        assert tuple(d["hidden_states"].shape) == (t, HIDDEN)
        assert tuple(d["aux_hidden_states"].shape) == (t, 3 * HIDDEN)
        assert d["input_ids"].dtype == torch.int64 and d["loss_mask"].dtype == torch.int64
    # speculators legacy: data_{i}.pt with a list of 4 [T, H] tensors, plus side files
    assert convert(out, "speculators-legacy", tmp_path / "sp") == 5
    lengths = json.loads((tmp_path / "sp" / "sample_lengths.json").read_text())
    config = json.loads((tmp_path / "sp" / "data_config.json").read_text())
    assert config["layer_ids"] == [2, 4, 5, 8] and config["file_pattern"] == "data_{idx}.pt"
    for i, row in enumerate(samples):
        t = len(row["input_ids"])
        d = torch.load(tmp_path / "sp" / f"data_{i}.pt")
        assert set(d) == {"input_ids", "loss_mask", "hidden_states"}
        assert isinstance(d["hidden_states"], list) and len(d["hidden_states"]) == 4
        assert all(tuple(h.shape) == (t, HIDDEN) and h.dtype == torch.bfloat16 for h in d["hidden_states"])
        assert lengths[str(i)] == t


def test_modelopt_marks_prenorm_when_no_final_norm(run, tiny, tmp_path):
    out = dump(run, tiny, rows(2, seed=6), tmp_path / "dump")
    convert(out, "modelopt", tmp_path / "mo")
    d = torch.load(tmp_path / "mo" / "data_0.pt")
    assert d["hidden_states_prenorm"] is True
    ref = hsx.read_sample(out / "hs_0.safetensors", torch=True)
    assert torch.equal(d["hidden_states"], ref["hidden_states"][:, 3])  # capture id N, pre-norm


def test_training_example_runs_from_the_stream(server, tmp_path):
    """client/python/examples/train_eagle3_head.py trains from a live server and its loss falls."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "client" / "python" / "examples" / "train_eagle3_head.py"
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in rows(6, seed=7, max_len=40)))
    proc = subprocess.run([sys.executable, str(example), "--server", server.address, "--input", str(inputs),
                           "--steps", "24", "--lr", "3e-3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    first, last = (float(x) for x in summary.split("loss ")[1].split(" -> "))
    assert last < first, proc.stdout
