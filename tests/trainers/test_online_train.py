"""Online training: each trainer's own training loop runs >= 10 steps on the CPU
with its samples streamed from hsx-server (the `server` fixture, the tiny model)
through hsx.integrations, and no hidden-state file is written anywhere; the losses
equal, bitwise, those of the same run (same batches, same seed) on hsx-dump's
files, read by the trainer's own offline loader.

  speculators  `speculators train` (speculators_online_run.py: its entry point with
               the CPU stand-ins of speculators_cpu_step.py) with
               --hidden-states-backend hsx, against the file backend on
               DATA/hidden_states
  ModelOpt     transformers.Trainer on its EAGLE-3 offline model (as in
               test_train_step.py) over hsx.integrations.modelopt's
               StreamingDataset, against OfflineSupervisedDataset on hsx.convert's files
  SpecForge    its EAGLE-3 step (as in test_train_step.py) over batches of
               hsx.integrations.specforge's dataset and its own collator, against its
               offline normalizer on hsx.convert's .ckpt files

Plus: a model that does not match the trainer's configuration, a wrong address and
a refused token each fail at start with a clear error (hsx.preflight)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import HIDDEN, N, VOCAB, read_jsonl, rows, run_steps, write_jsonl

RUNNER = Path(__file__).with_name("speculators_online_run.py")
STEPS = 10
SAMPLE_SUFFIXES = (".safetensors", ".pt", ".ckpt")


def sample_files(root, allowed=()):
    """Files under root that could hold samples, but those under the `allowed` dirs
    (a trainer's own checkpoint directory)."""
    return [p for p in Path(root).rglob("*") if p.suffix in SAMPLE_SUFFIXES
            and not any(Path(a) in p.parents for a in allowed)]


# --------------------------------------------------------------------------- speculators


def prepared(lines, path):
    """What `speculators prepare-data` saves: input_ids, loss_mask, seq_len, torch format."""
    from datasets import Dataset

    data = Dataset.from_dict({"input_ids": [r["input_ids"] for r in lines],
                              "loss_mask": [r["loss_mask"] for r in lines],
                              "seq_len": [len(r["input_ids"]) for r in lines]})
    data.set_format(type="torch")
    data.save_to_disk(str(path))
    return path


def speculators_train(model, data, work, *backend):
    """`speculators train` for STEPS steps on the CPU; the loss of every training forward."""
    flags = ["--verifier-name-or-path", model, "--data-path", data, "--speculator-type", "eagle3",
             "--on-missing", "raise", "--num-layers", "1", "--max-steps", STEPS, "--epochs", "1",
             "--num-workers", "0", "--total-seq-len", "48", "--loss-implementation", "eager",
             "--draft-attn-impl", "sdpa", "--mask-token-id", "0", "--save-path", work / "out",
             "--log-dir", work / "logs", *backend]
    proc = subprocess.run([sys.executable, RUNNER, work / "result.json", *map(str, flags)], capture_output=True,
                          text=True, timeout=300, cwd=work)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads((work / "result.json").read_text())["losses"], proc


@pytest.fixture(scope="module")
def speculators_rows():
    return rows(28, seed=31, max_len=40)


def test_speculators_trains_online_with_the_losses_of_the_file_run(server, model, speculators_rows, tmp_path):
    online, offline = tmp_path / "online", tmp_path / "offline"
    online.mkdir(), offline.mkdir()
    data = prepared(speculators_rows, online / "prepared")
    losses, _ = speculators_train(model, data, online, "--hidden-states-backend", "hsx", "--hsx-server", server)
    assert sample_files(online, allowed=[online / "out"]) == []
    assert not (data / "hidden_states").exists()
    # The same run on hsx-dump's files (docs/trainers.md's speculators block), file backend.
    data_files = prepared(speculators_rows, offline / "prepared")
    run_steps("speculators", {"DATA": data_files, "WORK": offline, "HSX_SERVER": server, "MODEL": model})
    file_losses, _ = speculators_train(model, data_files, offline)
    assert len(losses) >= STEPS and all(0 < x < 100 for x in losses)
    assert losses == file_losses  # bitwise: the same batches of the same bytes


def test_speculators_backend_refuses_a_verifier_the_server_does_not_serve(server, model, tmp_path):
    """What speculators' main calls before its loaders (HiddenStatesBackend.from_train_args), with
    a verifier config of 12 layers (the server's model has 8): a clear error, no training."""
    from argparse import Namespace

    from hsx.integrations.speculators import HsxBackend
    from hsx.preflight import ModelMismatch

    other = tmp_path / "verifier"
    other.mkdir()
    config = json.loads((Path(model) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 12}))
    args = Namespace(hsx_server=server, hsx_token_file=None, hsx_connect_timeout=5.0, hsx_retries=1,
                     verifier_name_or_path=str(other), target_layer_ids=None)
    with pytest.raises(ModelMismatch, match=rf"with num_layers {N}, but the verifier's config \({other}\) "
                                            "has num_layers 12: a different model"):
        HsxBackend.from_train_args(args, str(tmp_path))
    transfer = HsxBackend.from_train_args(Namespace(**{**vars(args), "verifier_name_or_path": str(model)}), "unused")
    assert transfer.capture == [2, 4, 5, N]  # speculators' default target layers 2, N/2, N-3, then N
