"""hsx's fp8 files (hsx-dump --dtype fp8) read by speculators' own fp8 reader: the
FP8Transfer of hs_connectors 0.9.0 (installed with speculators 0.9.0), under its
ArrowDataset and speculators' check_hidden_states. Its layout (hidden_states F8_E4M3
[T, L, H] with hidden_states_scales F32; value = e4m3 * scale, broadcast) reads
hsx's scale per token per layer [T, L, 1] unchanged; the values it gives must be
hsx's own dequantization (hsx.read_sample) up to its bf16 product, and the fp32
states up to fp8's rounding.

Environment: HSX_BIN_DIR (hsx binaries); this interpreter has the trainers and the
hsx client (scripts/trainers.sh). Fixtures: conftest.py."""

import json
import random
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import hsx
from pipeline import BIN, HIDDEN, rows, save_prepared_dataset


@pytest.fixture(scope="module")
def fp8_data(server, tmp_path_factory):
    work = tmp_path_factory.mktemp("fp8")
    data = work / "prepared"
    samples = rows(6, seed=4)
    save_prepared_dataset(samples, data)
    inputs = work / "in.jsonl"
    inputs.write_text("".join(json.dumps(r) + "\n" for r in samples))
    for dtype, out in (("fp8", data / "hidden_states"), ("fp32", work / "fp32")):
        subprocess.run([BIN / "hsx-dump", "--server", server, "--input", inputs, "--out", out, "--dtype", dtype],
                       check=True, capture_output=True)
    return data, work / "fp32", samples


def test_speculators_fp8_transfer_reads_hsx_fp8_files(fp8_data):
    from hs_connectors import FP8Transfer
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset

    data, fp32, samples = fp8_data
    transfer = FP8Transfer(data / "hidden_states")
    dataset = ArrowDataset(max_len=64, datapath=data, transfer=transfer, on_missing="raise")
    for i, row in enumerate(random.Random(0).sample(range(len(samples)), len(samples))):
        loaded = transfer.get_cached(row)
        assert "hidden_states_scales" not in loaded  # consumed by the reader
        hs = loaded["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (len(samples[row]["input_ids"]), 4, HIDDEN)
        check_hidden_states(loaded, samples[row]["input_ids"])
        ours = hsx.read_sample(data / "hidden_states" / f"hs_{row}.safetensors", torch=True)["hidden_states"]
        # FP8Transfer multiplies in bf16 with the scale rounded to bf16: two bf16 roundings.
        torch.testing.assert_close(hs.float(), ours.float(), rtol=2 ** -7, atol=0)
        ref = load_file(fp32 / f"hs_{row}.safetensors")["hidden_states"]
        amax = ref.abs().amax(dim=-1, keepdim=True)
        assert ((hs.float() - ref).abs() <= amax / 16 + 1e-30).all()  # e4m3: 3 mantissa bits, per-row scale
        item = dataset[row]
        assert torch.equal(item["hidden_states"], hs[:, :3].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], hs[:, 3])
