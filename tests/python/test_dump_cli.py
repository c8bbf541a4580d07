"""hsx-dump (in-process mode): output layout, dtypes and metadata, and one
precise error per class of bad input with nothing written."""

import json
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dump_helpers import write_jsonl

N_LAYERS = 8  # the tiny preset
HIDDEN = 128
VOCAB = 2048






def sample_rows(lengths, seed=0, with_mask=False):
    rng = random.Random(seed)
    rows = []
    for i, n in enumerate(lengths):
        row = {"input_ids": [rng.randrange(VOCAB) for _ in range(n)], "id": f"s{i}"}
        if with_mask:
            row["loss_mask"] = [rng.randrange(2) for _ in range(n)]
        rows.append(row)
    return rows


def test_default_output_is_eagle3_per_sample(run, tiny, tmp_path):
    rows = sample_rows([512, 259, 1, 33], with_mask=True)
    inputs = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, "--max-batch-tokens", "1000")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"hs_{i}.safetensors" for i in range(4)] + ["manifest.jsonl", "status"])
    for i, row in enumerate(rows):
        path = out / f"hs_{i}.safetensors"
        data = load_file(str(path))
        ids = row["input_ids"]
        assert data["hidden_states"].shape == (len(ids), 4, HIDDEN)  # {2, 4, 5, 8}
        assert data["hidden_states"].dtype == torch.bfloat16
        assert data["token_ids"].dtype == torch.int64 and data["token_ids"].tolist() == ids
        assert data["loss_mask"].tolist() == row["loss_mask"]
        assert "final_norm_hidden_states" not in data
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        assert json.loads(meta["capture_ids"]) == [2, 4, 5, 8]
        assert meta["sample_id"] == row["id"] and meta["sample_index"] == str(i)
        assert meta["last_layer_state"] == "pre-norm"
        assert "residual stream entering decoder layer k" in meta["layer_convention"]


def test_output_dtypes_are_roundings_of_fp32(run, tiny, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows([7, 20]))
    outs = {}
    for dtype in ("fp32", "bf16", "fp16"):
        outs[dtype] = tmp_path / dtype
        run("hsx-dump", "--model", tiny, "--input", inputs, "--out", outs[dtype], "--dtype", dtype,
            "--precision", "fp32", "--capture", "0,3,8", "--final-norm")
    for i in range(2):
        ref = load_file(str(outs["fp32"] / f"hs_{i}.safetensors"))
        for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            got = load_file(str(outs[dtype] / f"hs_{i}.safetensors"))
            for key in ("hidden_states", "final_norm_hidden_states"):
                assert got[key].dtype == torch_dtype
                assert torch.equal(got[key], ref[key].to(torch_dtype)), (dtype, key)
        assert ref["final_norm_hidden_states"].shape == (ref["token_ids"].numel(), HIDDEN)


BAD_INPUTS = [
    # (rows, extra flags, expected line, message fragment)
    ([{"input_ids": [1, 2]}, {"input_ids": [3, VOCAB]}], [], 2, f"input_ids[1] = {VOCAB} is outside the vocabulary"),
    ([{"input_ids": [1, -4]}], [], 1, "input_ids[1] = -4 is outside the vocabulary"),
    ([{"input_ids": [1]}, {"input_ids": [2]}, {"input_ids": []}], [], 3, "'input_ids' is empty"),
    ([{"input_ids": [1] * 9}], ["--max-tokens-per-sample", "8"], 1, "sample has 9 tokens, over the maximum of 8"),
    ([{"input_ids": [1]}, '{"input_ids": [1, 2'], [], 2, "not valid JSON"),
    ([{"input_ids": [1, 2], "loss_mask": [1]}], [], 1, "'loss_mask' must be a list as long as 'input_ids'"),
    ([{"input_ids": [1, 2.5]}], [], 1, "input_ids[1] = 2.5 is not an integer"),
]


@pytest.mark.parametrize("rows,flags,line,message", BAD_INPUTS)
def test_bad_input_names_the_line_and_writes_nothing(run, tiny, tmp_path, rows, flags, line, message):
    inputs = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, *flags, expect_ok=False)
    assert proc.returncode == 1
    assert f"{inputs}:{line}: " in proc.stderr and message in proc.stderr, proc.stderr
    assert not out.exists() or not any(out.iterdir())


def test_capture_id_above_n_is_rejected(run, tiny, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows([3]))
    out = tmp_path / "out"
    proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out, "--capture", "2,9",
               expect_ok=False)
    assert f"capture id 9 is outside 0..{N_LAYERS}" in proc.stderr, proc.stderr
    assert not out.exists() or not any(out.iterdir())


def test_rerun_never_rewrites_a_finished_sample(run, tiny, tmp_path):
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows([3]))
    out = tmp_path / "out"
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    before = (out / "hs_0.safetensors").stat()
    proc = run("hsx-dump", "--model", tiny, "--input", inputs, "--out", out)
    assert "skipped 1 already done" in proc.stdout, proc.stdout
    after = (out / "hs_0.safetensors").stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_capture_subset_equals_the_same_columns_of_all(run, tiny, tmp_path):
    """Ids below N stop the forward early; each must still be the state it names."""
    inputs = write_jsonl(tmp_path / "in.jsonl", sample_rows([9, 30]))
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", tmp_path / "all", "--capture", "all")
    run("hsx-dump", "--model", tiny, "--input", inputs, "--out", tmp_path / "sub", "--capture", "3,1")
    for i in range(2):
        every = load_file(str(tmp_path / "all" / f"hs_{i}.safetensors"))["hidden_states"]
        subset = load_file(str(tmp_path / "sub" / f"hs_{i}.safetensors"))["hidden_states"]
        assert torch.equal(subset, every[:, [1, 3]])
