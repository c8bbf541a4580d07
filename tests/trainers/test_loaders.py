"""The trainers' own loaders on hsx output, in their own pinned environment
(scripts/trainers.sh): the data steps of docs/trainers.md run as written, then
speculators' offline checks + ArrowDataset/FileTransfer + CollateFn, SpecForge's
OfflineEagle3Dataset + DataCollatorWithPadding + TargetHead, and ModelOpt's
OfflineSupervisedDataset + EagleOfflineDataCollator read what they produced;
every tensor is compared with the hsx files.

Environment: HSX_BIN_DIR (hsx binaries), and this interpreter must have the
trainers and the hsx client installed. Fixtures: conftest.py; shared helpers:
pipeline.py."""

import json
import random
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline import BIN, HIDDEN, N, rows, run_steps, save_prepared_dataset


def _stored(path):
    """(capture ids, tensor names) of one hsx-dump file."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["capture_ids"]), set(f.keys())


# --------------------------------------------------------------------------- speculators


@pytest.fixture(scope="session")
def speculators_data(server, model, tmp_path_factory):
    work = tmp_path_factory.mktemp("speculators")
    data = work / "prepared"
    samples = rows(12, seed=1)
    random.Random(7).shuffle(samples)  # speculators' prepare-data shuffles the rows
    save_prepared_dataset(samples, data)
    proc = run_steps("speculators", {"DATA": data, "WORK": work, "HSX_SERVER": server, "MODEL": model})
    assert "checked for speculators; 0 errors" in proc.stdout, proc.stdout
    return data, samples


def test_speculators_offline_checks(speculators_data):
    from speculators.data_generation.offline import (check_hidden_states, find_corrupt_hidden_state_indices,
                                                     get_existing_hidden_state_indices)

    data, samples = speculators_data
    hs_dir = data / "hidden_states"
    assert get_existing_hidden_state_indices(hs_dir) == list(range(len(samples)))
    assert find_corrupt_hidden_state_indices(hs_dir, list(range(len(samples)))) == {}
    for i, row in enumerate(samples):
        check_hidden_states(load_file(hs_dir / f"hs_{i}.safetensors"), row["input_ids"])
    # --capture speculators: the three auxiliary layers and N, no final norm (docs/trainers.md)
    assert _stored(hs_dir / "hs_0.safetensors") == ([2, 4, 5, N], {"hidden_states", "token_ids"})


def test_speculators_arrow_dataset_and_file_transfer(speculators_data):
    from hs_connectors import FileTransfer
    from speculators.train.data import ArrowDataset, CollateFn

    data, samples = speculators_data
    dataset = ArrowDataset(max_len=64, datapath=data, transfer=FileTransfer(data / "hidden_states"),
                           on_missing="raise")
    assert len(dataset) == len(samples)
    items = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a token mismatch is only a warning in speculators
        for i, row in enumerate(samples):
            item = dataset[i]
            hs = load_file(data / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"]
            assert item["input_ids"].tolist() == row["input_ids"]
            assert item["loss_mask"].tolist() == row["loss_mask"]  # from the prepared dataset
            assert torch.equal(item["hidden_states"], hs[:, :3].flatten(1))  # capture ids 2, 4, 5
            assert torch.equal(item["verifier_last_hidden_states"], hs[:, 3])  # capture id N = 8
            items.append(item)
    # Packed along the sequence: document_ids says which sample each position holds.
    lengths = [len(r["input_ids"]) for r in samples[:2]]
    assert sum(lengths) < 64
    batch = CollateFn(max_len=64, hidden_size=HIDDEN, num_target_layers=3)(items[:2])
    assert batch["hidden_states"].shape == (1, 64, 3 * HIDDEN)
    assert torch.equal(batch["hidden_states"][0, :lengths[0]], items[0]["hidden_states"])
    assert torch.equal(batch["verifier_last_hidden_states"][0, lengths[0]:sum(lengths)],
                       items[1]["verifier_last_hidden_states"])
    expected_docs = [0] * lengths[0] + [1] * lengths[1] + [-1] * (64 - sum(lengths))
    assert batch["document_ids"][0].tolist() == expected_docs


def test_speculators_misses_a_row_order_mistake_that_hsx_verify_catches(speculators_data, server, tmp_path):
    """Rows exported in the wrong order: speculators only warns and skips; hsx-verify fails."""
    from speculators.train.data import ArrowDataset

    data, samples = speculators_data
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text("".join(json.dumps({"input_ids": r["input_ids"]}) + "\n" for r in reversed(samples)))
    bad = tmp_path / "prepared"
    shutil.copytree(data, bad, ignore=shutil.ignore_patterns("hidden_states"))
    subprocess.run([BIN / "hsx-dump", "--server", server, "--input", wrong, "--out", bad / "hidden_states",
                    "--capture", "eagle3"], check=True, capture_output=True)
    with pytest.warns(UserWarning, match="match"):
        item = ArrowDataset(max_len=64, datapath=bad, on_missing="raise")[0]
    assert not isinstance(item, dict)  # SampleUnavailable: silently skipped in training
    ok = tmp_path / "right.jsonl"
    ok.write_text("".join(json.dumps({"input_ids": r["input_ids"]}) + "\n" for r in samples))
    proc = subprocess.run([BIN / "hsx-verify", bad / "hidden_states", "--input", ok, "--for", "speculators"],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "token_ids differ from line 1 of the input" in proc.stdout


# --------------------------------------------------------------------------- SpecForge


def test_specforge_offline_dataset_collator_and_target_head(server, model, tmp_path):
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.modeling.target.target_head import TargetHead

    samples = rows(6, seed=2)
    (tmp_path / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    run_steps("specforge", {"WORK": tmp_path, "HSX_SERVER": server, "MODEL": model})
    files = list_local_files(str(tmp_path / "specforge-data"))
    assert len(files) == len(samples)
    # --capture specforge: three auxiliary layers and the post-norm state, not N (docs/trainers.md)
    assert _stored(tmp_path / "dump-specforge" / "hs_0.safetensors") == (
        [2, 4, 5], {"hidden_states", "token_ids", "loss_mask", "final_norm_hidden_states"})
    dataset = OfflineEagle3Dataset(files, max_len=64)
    items = []
    for path in files:
        i = int(Path(path).stem.split("_")[1])
        ref = load_file(tmp_path / "dump-specforge" / f"hs_{i}.safetensors")
        raw = torch.load(path, weights_only=True)
        item = OfflineEagle3Dataset.process_data(raw, 64)
        t = len(samples[i]["input_ids"])
        assert item["input_ids"][0].tolist() == samples[i]["input_ids"]
        assert item["loss_mask"][0].tolist() == samples[i]["loss_mask"][:-1] + [0]  # SpecForge zeroes the last
        assert torch.equal(item["target"][0], ref["final_norm_hidden_states"])
        assert torch.equal(item["hidden_state"][0], ref["hidden_states"][:, :3].flatten(1))
        assert item["hidden_state"].shape == (1, t, 3 * HIDDEN)
        items.append(item)
    assert len(dataset) == len(files) and dataset[0]["input_ids"].shape[0] == 1
    batch = DataCollatorWithPadding()(items[:3])
    longest = max(len(samples[i]["input_ids"]) for i in range(3))
    assert batch["hidden_state"].shape == (3, longest, 3 * HIDDEN) and batch["target"].shape == (3, longest, HIDDEN)
    # The target head: config through AutoConfig (model_type deepseek_v3), lm_head through the index.
    head = TargetHead(str(model))
    head.load_weights(str(model))
    lm_head = load_file(model / "model.safetensors")["lm_head.weight"]
    assert head.config.model_type == "deepseek_v3" and torch.equal(head.fc.weight.to(lm_head.dtype), lm_head)


# --------------------------------------------------------------------------- ModelOpt


def test_modelopt_offline_dataset_and_collator(server, model, tmp_path):
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    samples = rows(5, seed=3)
    (tmp_path / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    proc = run_steps("modelopt", {"WORK": tmp_path, "HSX_SERVER": server, "MODEL": model})
    assert "ModelOpt ignores loss_mask unless answer_only_loss" in proc.stdout
    files = sorted((tmp_path / "modelopt-data").glob("*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    assert [p.name for p in files] == [f"data_{i}.pt" for i in range(len(samples))]
    # --capture modelopt: three auxiliary layers and the post-norm state, not N (docs/trainers.md)
    assert _stored(tmp_path / "dump-modelopt" / "hs_0.safetensors") == (
        [2, 4, 5], {"hidden_states", "token_ids", "loss_mask", "final_norm_hidden_states"})
    masked = OfflineSupervisedDataset([str(p) for p in files], answer_only_loss=True)
    plain = OfflineSupervisedDataset([str(p) for p in files])
    for i, row in enumerate(samples):
        ref = load_file(tmp_path / "dump-modelopt" / f"hs_{i}.safetensors")
        item = masked[i]
        assert item["input_ids"].tolist() == row["input_ids"]
        assert item["loss_mask"].tolist() == row["loss_mask"]
        assert plain[i]["loss_mask"].tolist() == [1] * len(row["input_ids"])  # ignored without answer_only_loss
        assert torch.equal(item["base_model_hidden_states"], ref["final_norm_hidden_states"])
        assert torch.equal(item["aux_hidden_states"], ref["hidden_states"][:, :3].flatten(1))
        assert item["base_hidden_prenorm"] is False
    batch = EagleOfflineDataCollator(train_len=64)([masked[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 64)
    assert batch["base_model_outputs"]["aux_hidden_states"].shape == (3, 64, 3 * HIDDEN)


def test_verifier_config_loads_with_auto_config(model):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model))
    assert config.model_type == "deepseek_v3" and config.num_hidden_layers == N
