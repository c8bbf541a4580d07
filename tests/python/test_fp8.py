"""--dtype fp8 (e4m3 with a float32 scale per token per layer) end to end: hsx-server
streams it, hsx-dump (remote and in-process, byte-identical files) writes it, hsx-verify
accepts it; its bytes equal ml_dtypes' e4m3 rounding of the fp32 states under the
documented scale rule (an implementation other than ours); hsx.Client (both receive
paths), hsx.OnlineDataset and hsx.read_sample give the same dequantized values, and with
dequantize=False the same e4m3 values and scales (read_sample's of hsx-dump's file, byte for
byte); a file with a corrupted scale or payload is refused by hsx-verify and by read_sample;
the engine's device path (the rows encoded in the capture copy, as on CUDA) sends the same
bytes."""

import json
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
import torch

import hsx
from dump_helpers import RECEIVE_PATHS
from hsx_server import HsxServer

VOCAB = 2048
HIDDEN = 128
CAPTURE = "1,4,8"


def rows(count, seed):
    rng = np.random.default_rng(seed)
    return [{"id": f"f{i}", "input_ids": [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(3, 40)))]}
            for i in range(count)]


@pytest.fixture(scope="module")
def server(bin_dir, tiny):
    with HsxServer(bin_dir, tiny) as srv:
        yield srv


@pytest.fixture(scope="module")
def dumps(run, tiny, server, tmp_path_factory):
    """The same samples dumped in fp8 remotely and in process, and in fp32 in process."""
    base = tmp_path_factory.mktemp("fp8")
    samples = rows(5, seed=1)
    inputs = base / "in.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in samples))
    common = ("--input", inputs, "--capture", CAPTURE, "--final-norm")
    run("hsx-dump", "--server", server.address, "--out", base / "remote", "--dtype", "fp8", *common)
    run("hsx-dump", "--model", tiny, "--out", base / "local", "--dtype", "fp8", *common)
    run("hsx-dump", "--model", tiny, "--out", base / "fp32", "--dtype", "fp32", *common)
    return samples, inputs, base


def quantize(x):
    """The documented rule with numpy and ml_dtypes: per row scale = max(amax / 448,
    FLT_MIN), 1 for zeros; values (x / scale) rounded to e4m3 by ml_dtypes."""
    amax = np.abs(x).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, np.maximum(amax / np.float32(448), np.finfo(np.float32).tiny), 1).astype(np.float32)
    return (x / scale).astype(ml_dtypes.float8_e4m3fn), scale


def test_dump_remote_and_local_are_identical_and_verify(run, dumps):
    samples, inputs, base = dumps
    for i in range(len(samples)):
        name = f"hs_{i}.safetensors"
        assert (base / "remote" / name).read_bytes() == (base / "local" / name).read_bytes(), name
    for out in ("remote", "local"):
        run("hsx-verify", base / out, "--input", inputs)
    journal = [json.loads(line) for line in (base / "remote" / "manifest.jsonl").read_text().splitlines()]
    assert {e["dtype"] for e in journal} == {"fp8"}


def test_a_server_whose_copies_land_later_encodes_on_the_device_path(run, bin_dir, tiny, dumps):
    """Where the backend's copies do not land on return (CUDA), the engine copies an fp8 sample
    out encoded (Backend::CopyToHostFp8) and the streaming threads only check and hash it. Here
    that path runs on the CPU: with the testing flag --inject-device-loss-after-batches (armed
    far beyond this test) rank 0's backend is a ForwardingBackend, whose copies do not land on
    return. Its files are byte-identical to the CPU sink path's and verify."""
    samples, inputs, base = dumps
    with HsxServer(bin_dir, tiny, "--inject-device-loss-after-batches", "1000000") as srv:
        run("hsx-dump", "--server", srv.address, "--out", base / "device", "--dtype", "fp8", "--input", inputs,
            "--capture", CAPTURE, "--final-norm")
    for i in range(len(samples)):
        name = f"hs_{i}.safetensors"
        assert (base / "device" / name).read_bytes() == (base / "remote" / name).read_bytes(), name
    run("hsx-verify", base / "device", "--input", inputs)


def test_file_layout_and_values_match_an_independent_quantizer(dumps):
    samples, _, base = dumps
    for i, row in enumerate(samples):
        raw = hsx.read_sample(base / "remote" / f"hs_{i}.safetensors", dequantize=False)
        ref = hsx.read_sample(base / "fp32" / f"hs_{i}.safetensors")
        t = len(row["input_ids"])
        assert raw.metadata["dtype"] == "fp8"
        assert raw["hidden_states"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
        assert raw["hidden_states"].shape == (t, 3, HIDDEN)
        assert raw["hidden_states_scales"].dtype == np.float32 and raw["hidden_states_scales"].shape == (t, 3, 1)
        assert raw["final_norm_hidden_states_scales"].shape == (t, 1)
        for key in ("hidden_states", "final_norm_hidden_states"):
            values, scales = quantize(np.asarray(ref[key]))
            np.testing.assert_array_equal(raw[key + "_scales"], scales)
            assert raw[key].tobytes() == values.tobytes(), (i, key)
        # read_sample's default: dequantized to bf16 (e4m3 * scale in float32, then rounded)
        deq = hsx.read_sample(base / "remote" / f"hs_{i}.safetensors")
        assert "hidden_states_scales" not in deq and deq["hidden_states"].dtype == ml_dtypes.bfloat16
        want = (raw["hidden_states"].astype(np.float32) * raw["hidden_states_scales"]).astype(ml_dtypes.bfloat16)
        assert deq["hidden_states"].tobytes() == want.tobytes()


@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_client_gives_what_read_sample_gives(dumps, server, native):
    samples, _, base = dumps
    client = hsx.Client(server.address, native=native)
    got = dict(client.extract_many(samples, concurrency=2, capture=[1, 4, 8], final_norm=True, dtype="fp8"))
    for i, sample in got.items():
        ref = hsx.read_sample(base / "remote" / f"hs_{i}.safetensors")
        for key in ("hidden_states", "final_norm_hidden_states", "token_ids"):
            assert sample[key].dtype == ref[key].dtype and sample[key].tobytes() == ref[key].tobytes(), (i, key)
    client.close()


def test_online_dataset_yields_dequantized_fp8(dumps, server):
    samples, _, base = dumps
    dataset = hsx.OnlineDataset(samples, server.address, concurrency=2, capture=[1, 4, 8], dtype="fp8",
                                final_norm=True, ordered=True)
    seen = 0
    for item in dataset:
        ref = hsx.read_sample(base / "remote" / f"hs_{item.index}.safetensors", torch=True)
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], ref["hidden_states"])
        assert torch.equal(item["final_norm_hidden_states"], ref["final_norm_hidden_states"])
        seen += 1
    assert seen == len(samples)


RAW_KEYS = {"hidden_states", "hidden_states_scales", "final_norm_hidden_states", "final_norm_hidden_states_scales",
            "token_ids"}


def as_numpy(value):
    """A tensor's array (torch: its bytes viewed as numpy, float8 through uint8)."""
    if isinstance(value, torch.Tensor):
        return value.view(torch.uint8).numpy() if value.dtype == torch.float8_e4m3fn else value.numpy()
    return value


@pytest.mark.parametrize("use_torch", [False, True], ids=["numpy", "torch"])
@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_client_raw_gives_what_read_sample_raw_gives(dumps, server, native, use_torch):
    """dequantize=False: each sample is exactly read_sample(hsx-dump's file, dequantize=False):
    the same tensors (final norm and both scales included), dtypes and bytes, contiguous."""
    samples, _, base = dumps
    with hsx.Client(server.address, native=native) as client:
        got = dict(client.extract_many(samples, concurrency=2, capture=[1, 4, 8], final_norm=True, dtype="fp8",
                                       torch=use_torch, dequantize=False))
    assert sorted(got) == list(range(len(samples)))
    for i, sample in got.items():
        ref = hsx.read_sample(base / "remote" / f"hs_{i}.safetensors", torch=use_torch, dequantize=False)
        assert set(sample) == set(ref) == RAW_KEYS, i
        for key in RAW_KEYS:
            assert sample[key].dtype == ref[key].dtype and sample[key].shape == ref[key].shape, (i, key)
            if use_torch:
                assert sample[key].is_contiguous(), (i, key)
            else:
                assert sample[key].flags.c_contiguous, (i, key)
            assert as_numpy(sample[key]).tobytes() == as_numpy(ref[key]).tobytes(), (i, key)
        if use_torch:
            assert sample["hidden_states"].dtype == torch.float8_e4m3fn
            assert sample["hidden_states_scales"].dtype == torch.float32
        else:
            assert sample["hidden_states"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
            assert sample["final_norm_hidden_states_scales"].dtype == np.float32


@pytest.mark.parametrize("native", RECEIVE_PATHS)
def test_dequantizing_the_raw_sample_gives_the_default_sample(dumps, server, native):
    """hsx.fp8.dequantize of a dequantize=False sample is the default (dequantized) sample, bit
    for bit, on both receive paths (the native one dequantizes in C++)."""
    samples, _, _ = dumps
    options = dict(capture=[1, 4, 8], final_norm=True, dtype="fp8")
    with hsx.Client(server.address, native=native) as client:
        raw = dict(client.extract_many(samples, concurrency=2, dequantize=False, **options))
        default = dict(client.extract_many(samples, concurrency=2, **options))
    for i, sample in raw.items():
        assert "hidden_states_scales" not in default[i]
        for key, scales in hsx.fp8.SCALES.items():
            want = default[i][key]
            got = hsx.fp8.dequantize(sample[key], sample[scales])
            assert got.dtype == want.dtype == ml_dtypes.bfloat16 and got.tobytes() == want.tobytes(), (i, key)


def test_online_dataset_yields_fp8_as_received(dumps, server):
    """OnlineDataset(dequantize=False): torch float8_e4m3fn states and float32 scales, what
    read_sample(torch=True, dequantize=False) gives for the same sample."""
    samples, _, base = dumps
    dataset = hsx.OnlineDataset(samples, server.address, concurrency=2, capture=[1, 4, 8], dtype="fp8",
                                final_norm=True, ordered=True, dequantize=False)
    seen = []
    for item in dataset:
        ref = hsx.read_sample(base / "remote" / f"hs_{item.index}.safetensors", torch=True, dequantize=False)
        assert set(item) == set(ref) == RAW_KEYS
        assert item["hidden_states"].dtype == torch.float8_e4m3fn
        assert item["final_norm_hidden_states_scales"].dtype == torch.float32
        for key in RAW_KEYS:
            assert item[key].dtype == ref[key].dtype and as_numpy(item[key]).tobytes() == as_numpy(ref[key]).tobytes()
        seen.append(item.index)
    assert seen == list(range(len(samples)))


def corrupt(path, name, offset, raw):
    """Writes `raw` at byte `offset` of tensor `name` in a safetensors file (the checksum left stale)."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    begin = json.loads(data[8:8 + length])[name]["data_offsets"][0]
    at = 8 + length + begin + offset
    data[at:at + len(raw)] = raw
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("what,name,offset,raw,message", [
    ("nan scale", "hidden_states_scales", 4 * (2 * 3 + 1), struct.pack("<f", float("nan")),
     "scale (nan) of hidden_states capture id 4 row 2 is not finite and positive"),
    ("inf scale", "hidden_states_scales", 4 * (0 * 3 + 2), struct.pack("<f", float("inf")),
     "scale (inf) of hidden_states capture id 8 row 0 is not finite and positive"),
    ("zero scale", "hidden_states_scales", 0, struct.pack("<f", 0.0),
     "scale (0) of hidden_states capture id 1 row 0 is not finite and positive"),
    ("negative scale", "final_norm_hidden_states_scales", 4, struct.pack("<f", -1.5),
     "scale (-1.5) of final_norm_hidden_states row 1 is not finite and positive"),
    ("nan payload", "hidden_states", (1 * 3 + 1) * HIDDEN + 7, b"\x7f",
     "non-finite value (nan) in hidden_states capture id 4 row 1 column 7"),
])
def test_corrupted_files_are_refused_by_both_readers(run, dumps, tmp_path, what, name, offset, raw, message):
    samples, inputs, base = dumps
    out = tmp_path / "out"
    shutil.copytree(base / "remote", out)  # the files, the journal and the status/ directory
    i = next(i for i, r in enumerate(samples) if len(r["input_ids"]) >= 3)
    corrupt(out / f"hs_{i}.safetensors", name, offset, raw)
    proc = run("hsx-verify", out, "--input", inputs, expect_ok=False)
    assert message in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert f"hs_{i}.safetensors" in proc.stdout + proc.stderr
    with pytest.raises(ValueError, match=f"hs_{i}.safetensors: " + message.replace("(", r"\(").replace(")", r"\)")):
        hsx.read_sample(out / f"hs_{i}.safetensors")


def test_converters_read_fp8_dumps_dequantized(dumps, tmp_path):
    """python -m hsx.convert reads samples through read_sample, which dequantizes fp8: the
    converted tensors are read_sample's bf16 values."""
    from hsx.convert import convert

    samples, _, base = dumps
    assert convert(base / "remote", "modelopt", tmp_path / "mo") == len(samples)
    for i in range(len(samples)):
        d = torch.load(tmp_path / "mo" / f"data_{i}.pt")
        ref = hsx.read_sample(base / "remote" / f"hs_{i}.safetensors", torch=True)
        assert d["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(d["hidden_states"], ref["final_norm_hidden_states"])
        assert torch.equal(d["aux_hidden_states"], ref["hidden_states"][:, :2].flatten(1))  # capture ids 1, 4


def test_raw_fp8_as_torch(dumps):
    """read_sample(dequantize=False, torch=True): torch.float8_e4m3fn values and float32 scales whose
    product is what the default gives."""
    _, _, base = dumps
    raw = hsx.read_sample(base / "remote" / "hs_0.safetensors", torch=True, dequantize=False)
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn
    deq = hsx.read_sample(base / "remote" / "hs_0.safetensors", torch=True)
    product = (raw["hidden_states"].float() * raw["hidden_states_scales"]).bfloat16()
    assert torch.equal(product, deq["hidden_states"])


def test_summary_mode_reports_the_dequantized_values(dumps, server):
    """summary=True with DTYPE_FP8_E4M3: each tensor's statistics are those of the values the
    bytes carry (e4m3 x scale), and the trailer's checksums those of the rows as sent."""
    import grpc
    import xxhash
    from hsx.v1 import hsx_pb2, hsx_pb2_grpc

    samples, _, base = dumps
    raw = hsx.read_sample(base / "remote" / "hs_0.safetensors", dequantize=False)
    values = raw["hidden_states"].astype(np.float32) * raw["hidden_states_scales"]
    with grpc.insecure_channel(server.address) as channel:
        stub = hsx_pb2_grpc.HiddenStatesStub(channel)
        parts = list(stub.Extract(hsx_pb2.ExtractRequest(
            sample_id="sum", token_ids=samples[0]["input_ids"], capture_ids=[1, 4, 8], dtype=hsx_pb2.DTYPE_FP8_E4M3,
            summary=True, checksum=hsx_pb2.CHECKSUM_XXH64), timeout=60))
    summary, trailer = parts[1].summary, parts[2].trailer
    for l, stats in enumerate(summary.tensors):
        v = values[:, l].astype(np.float64)
        assert stats.capture_id == [1, 4, 8][l]
        assert stats.min == v.min() and stats.max == v.max()
        assert abs(stats.mean - v.mean()) <= 1e-6 * np.abs(v).max()
        np.testing.assert_array_equal(np.array(stats.first_values, np.float32), values[0, l, :8])
        rows = np.concatenate([raw["hidden_states_scales"][:, l].view(np.uint8),
                               raw["hidden_states"][:, l].view(np.uint8)], axis=1)  # scale, then values, per row
        assert trailer.checksums[l].xxh64 == xxhash.xxh64(rows.tobytes()).intdigest()
