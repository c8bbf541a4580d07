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
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from pipeline import (BIN, DOCS, HIDDEN, N, VOCAB, doc_block, read_jsonl, rows, run_steps, save_prepared_dataset,
                      write_jsonl)
from hsx_server import HsxServer

RUNNER = Path(__file__).with_name("speculators_online_run.py")
STEPS = 10
SAMPLE_SUFFIXES = (".safetensors", ".pt", ".ckpt")


def doc_python(name, **variables):
    """Runs the python block after <!-- run: NAME --> in docs/trainers.md with `variables` as its
    globals; returns them as the block left them."""
    text = DOCS.read_text()
    match = re.search(r"```python\n(.*?)```", text[text.index(f"<!-- run: {name} -->"):], re.S)
    exec(compile(match.group(1), f"docs/trainers.md:{name}", "exec"), variables)
    return variables


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolate_files(monkeypatch, root):
    """Makes `root` the working directory and the temporary directory of this in-process run,
    so that sample_files(root) sees any file it writes (relative, or under tempfile's)."""
    tmp = Path(root) / "tmp"
    tmp.mkdir(exist_ok=True)
    monkeypatch.chdir(root)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))


def sample_files(root, allowed=()):
    """Files under root that could hold samples, but those under the `allowed` dirs
    (a trainer's own checkpoint directory)."""
    return [p for p in Path(root).rglob("*") if p.suffix in SAMPLE_SUFFIXES
            and not any(Path(a) in p.parents for a in allowed)]


# --------------------------------------------------------------------------- speculators



def cpu_flags(work):
    """What a CPU run of `speculators train` adds (as in test_train_step.py), for STEPS steps."""
    return ["--num-layers", "1", "--max-steps", str(STEPS), "--epochs", "1", "--num-workers", "0",
            "--total-seq-len", "48", "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
            "--mask-token-id", "0", "--save-path", str(work / "out"), "--log-dir", str(work / "logs")]


def speculators_losses(proc, work):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads((work / "result.json").read_text())["losses"]


def speculators_online(model, data, work, server):
    """docs/trainers.md's speculators-online block as written, its entry point swapped for
    speculators_online_run.py (the same entry point plus the CPU stand-ins)."""
    entry = "python -m hsx.integrations.speculators"
    block = doc_block("speculators-online")
    assert entry in block
    script = block.replace(entry, f'python "{RUNNER}" "{work / "result.json"}"')
    env = {**os.environ, "DATA": str(data), "MODEL": str(model), "HSX_SERVER": server,
           "TRAIN_FLAGS": " ".join(cpu_flags(work)),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True, text=True,
                          timeout=300, cwd=work)
    return speculators_losses(proc, work)


def speculators_from_files(model, data, work):
    """The same `speculators train` on DATA/hidden_states (its default file backend)."""
    flags = ["--verifier-name-or-path", str(model), "--data-path", str(data), "--speculator-type", "eagle3",
             "--on-missing", "raise", *cpu_flags(work)]
    proc = subprocess.run([sys.executable, RUNNER, work / "result.json", *flags], capture_output=True, text=True,
                          timeout=300, cwd=work)
    return speculators_losses(proc, work)


@pytest.fixture(scope="module")
def speculators_rows():
    return rows(28, seed=31, max_len=40)


def test_speculators_trains_online_with_the_losses_of_the_file_run(server, model, speculators_rows, tmp_path):
    online, offline = tmp_path / "online", tmp_path / "offline"
    online.mkdir(), offline.mkdir()
    data = save_prepared_dataset(speculators_rows, online / "prepared")
    losses = speculators_online(model, data, online, server)
    assert sample_files(online, allowed=[online / "out"]) == []
    assert not (data / "hidden_states").exists()
    # The same run on hsx-dump's files (docs/trainers.md's speculators block), file backend.
    data_files = save_prepared_dataset(speculators_rows, offline / "prepared")
    run_steps("speculators", {"DATA": data_files, "WORK": offline, "HSX_SERVER": server, "MODEL": model})
    file_losses = speculators_from_files(model, data_files, offline)
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
    with pytest.raises(ModelMismatch, match=r"capture ids \[9\] are not layers"):
        HsxBackend.from_train_args(Namespace(**{**vars(args), "verifier_name_or_path": str(model),
                                                "target_layer_ids": [2, 9]}), "unused")
    with pytest.raises(ValueError, match="needs --hsx-server"):
        HsxBackend.from_train_args(Namespace(**{**vars(args), "hsx_server": None}), "unused")


# --------------------------------------------------------------------------- ModelOpt


def recording_losses(model):
    """Every training forward's loss, appended as the Trainer calls the model."""
    losses, forward = [], model.forward

    def record(*args, **kwargs):
        out = forward(*args, **kwargs)
        losses.append(float(out.loss.detach()))
        return out

    model.forward = record
    return losses


def modelopt_train(model, d2t, dataset, work):
    """STEPS steps of transformers.Trainer (what ModelOpt's example trains with) on ModelOpt's
    offline EAGLE-3 model, as test_train_step.py builds it; the loss of each step."""
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator
    from transformers import Trainer, TrainingArguments

    from test_train_step import modelopt_model

    eagle = modelopt_model(model, d2t)
    losses = recording_losses(eagle)
    args = TrainingArguments(output_dir=str(work / "out"), max_steps=STEPS, per_device_train_batch_size=2,
                             learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no", seed=7,
                             remove_unused_columns=False, bf16=False, disable_tqdm=True)
    Trainer(model=eagle, args=args, train_dataset=dataset, data_collator=EagleOfflineDataCollator(64)).train()
    return losses


@pytest.fixture(scope="module")
def modelopt_tokens(tmp_path_factory):
    """A token JSONL (python -m hsx.prepare's shape), its frequency file and ModelOpt's d2t."""
    from pipeline import write_token_frequencies
    from test_train_step import DRAFT_VOCAB

    work = tmp_path_factory.mktemp("modelopt-tokens")
    jsonl = write_jsonl(work / "tokens.jsonl", rows(24, seed=41, max_len=40))
    freq = write_token_frequencies(jsonl, work / "tokens.freq.json")
    run_steps("modelopt-vocab", {"WORK": work, "FREQ": freq, "DRAFT_VOCAB": DRAFT_VOCAB})
    return jsonl, work / "d2t.pt"


def modelopt_online(server, model, entries, **config):
    from hsx.integrations.modelopt import HsxEagleStreamingDataset, HsxStreamingConfig

    return HsxEagleStreamingDataset(entries, config=HsxStreamingConfig(
        servers=server, model=str(model), answer_only_loss=True, **config))


def test_modelopt_trains_online_with_the_losses_of_the_file_run(server, model, modelopt_tokens, tmp_path,
                                                                monkeypatch):
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset

    jsonl, d2t = modelopt_tokens
    online = tmp_path / "online"
    online.mkdir()
    isolate_files(monkeypatch, online)
    dataset = doc_python("modelopt-online", ROWS=read_jsonl(jsonl), MODEL=str(model), HSX_SERVER=server)["train_dataset"]
    losses = modelopt_train(model, d2t, dataset, online)
    assert sample_files(online) == [] and sample_files(jsonl.parent) == [d2t]
    # The same run on hsx-dump's files: docs/trainers.md's modelopt block, ModelOpt's offline dataset.
    offline = tmp_path / "offline"
    offline.mkdir()
    (offline / "tokens.jsonl").write_text(jsonl.read_text())
    run_steps("modelopt", {"WORK": offline, "HSX_SERVER": server, "MODEL": model})
    files = [str(offline / "modelopt-data" / f"data_{i}.pt") for i in range(len(read_jsonl(jsonl)))]
    file_losses = modelopt_train(model, d2t, OfflineSupervisedDataset(files, answer_only_loss=True), offline)
    assert len(losses) == STEPS and all(0 < x < 100 for x in losses)
    assert losses == file_losses  # bitwise: the same batches of the same bytes


def test_modelopt_items_are_its_offline_items(server, model, modelopt_tokens, tmp_path):
    """Item by item, the streamed dict is the one OfflineSupervisedDataset gives from hsx.convert's file."""
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset

    jsonl, _ = modelopt_tokens
    lines = read_jsonl(jsonl)[:4]
    write_jsonl(tmp_path / "tokens.jsonl", lines)
    run_steps("modelopt", {"WORK": tmp_path, "HSX_SERVER": server, "MODEL": model})
    offline = OfflineSupervisedDataset([str(tmp_path / "modelopt-data" / f"data_{i}.pt") for i in range(4)],
                                       answer_only_loss=True)
    online = modelopt_online(server, model, lines)
    for i in range(4):
        a, b = online[i], offline[i]
        assert a.keys() == b.keys() and a["base_hidden_prenorm"] is b["base_hidden_prenorm"] is False
        for key in a:
            if key != "base_hidden_prenorm":
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_modelopt_dataset_fails_at_start_on_a_model_of_another_size(server, model, tmp_path):
    from hsx.preflight import ModelMismatch

    other = tmp_path / "base"
    other.mkdir()
    config = json.loads((Path(model) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * HIDDEN, "vocab_size": 4096}))
    dataset = modelopt_online(server, other, rows(3, seed=1))
    with pytest.raises(ModelMismatch, match=f"with hidden_size {HIDDEN}, but the base model's config"):
        dataset[0]  # not taken for a transient miss and resampled


def test_modelopt_dataset_fails_at_start_on_a_wrong_address(model):
    from hsx.preflight import ServerUnreachable

    dataset = modelopt_online(f"127.0.0.1:{free_port()}", model, rows(3, seed=1), connect_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(ServerUnreachable, match="did not answer within 1 s"):
        dataset[0]
    assert time.monotonic() - start < 10  # one preflight, not 16 resampled fetches with retries


def test_modelopt_dataset_fails_at_start_on_a_refused_token(model, tmp_path):
    from hsx import ServerError

    (tmp_path / "token").write_text("the-token\n")
    proc = HsxServer(BIN, model, "--auth-token-file", tmp_path / "token", metrics=False).start(wait_serving=False)
    try:
        proc.wait_ready()
        with pytest.raises(ServerError, match=f"PERMISSION_DENIED: hsx-server {proc.address} refused the token"):
            modelopt_online(proc.address, model, rows(3, seed=1), token="another-token")[0]
        assert modelopt_online(proc.address, model, rows(3, seed=1), token="the-token")[0]["input_ids"].shape[0] > 0
    finally:
        proc.stop()


# --------------------------------------------------------------------------- SpecForge


def specforge_train(loader, parts_dir, model, monkeypatch):
    """SpecForge's EAGLE-3 step (its builders, strategy and BF16Optimizer, as
    test_train_step.py assembles them, the loss and torch.compile swapped the same way)
    over the batches of a FeatureDataLoader, for STEPS steps; the loss of each."""
    import specforge.algorithms.eagle3.model as eagle3_model
    import specforge.core.loss as specforge_loss
    from specforge.optimizer import BF16Optimizer

    from test_train_step import specforge_parts

    monkeypatch.setattr(eagle3_model, "LogSoftmaxLoss",
                        type("CpuLoss", (), {"apply": staticmethod(specforge_loss._compute_loss)}))
    cfg, _, _, strategy = specforge_parts(model, parts_dir)
    trained = strategy.trainable_module()
    optimizer = BF16Optimizer(trained, lr=1e-3, max_grad_norm=cfg.training.max_grad_norm,
                              warmup_ratio=0.0, total_steps=STEPS)
    losses = []
    # torch's own patch, not monkeypatch: pytest's undo deletes a torch config key it patched.
    with torch._dynamo.config.patch(disable=True):
        for batch in loader:
            out = strategy.forward_loss(batch)
            out.loss.backward()
            optimizer.step()
            losses.append(float(out.loss.detach()))
            if len(losses) == STEPS:
                break
    return losses


def specforge_loader(store, refs):
    """SpecForge's own loader: store + refs, its offline normalizer and collator, batches of 2."""
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
    from specforge.runtime.data_plane import FeatureDataLoader

    return FeatureDataLoader(store, refs=refs, batch_size=2, collate_fn=build_offline_collator(),
                             per_sample_transform=build_offline_normalizer(64), strategy="eagle3")


@pytest.fixture(scope="module")
def specforge_tokens(tmp_path_factory):
    """A token JSONL, its frequency file and SpecForge's vocab mapping (the parts' directory)."""
    from pipeline import write_token_frequencies
    from test_train_step import DRAFT_VOCAB

    work = tmp_path_factory.mktemp("specforge-tokens")
    jsonl = write_jsonl(work / "tokens.jsonl", rows(22, seed=51, max_len=40))
    freq = write_token_frequencies(jsonl, work / "tokens.freq.json")
    run_steps("specforge-vocab", {"WORK": work, "FREQ": freq, "DRAFT_VOCAB": DRAFT_VOCAB})
    return jsonl, work


def test_specforge_trains_online_with_the_losses_of_the_file_run(server, model, specforge_tokens, tmp_path,
                                                                 monkeypatch):
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    jsonl, parts = specforge_tokens
    lines = read_jsonl(jsonl)
    isolate_files(monkeypatch, tmp_path)
    loader = doc_python("specforge-online", ROWS=lines, MODEL=str(model), HSX_SERVER=server, MAX_LEN=64, TTT_LENGTH=3,
                        BATCH=2)["loader"]
    losses = specforge_train(loader, parts, model, monkeypatch)
    assert sample_files(tmp_path) == [] and sample_files(parts) == [parts / "vocab_mapping.pt"]
    # The same run on hsx-dump's files: docs/trainers.md's specforge block, SpecForge's offline
    # reader (file:// refs, in sample order) and its LocalFeatureStore.
    (tmp_path / "tokens.jsonl").write_text(jsonl.read_text())
    run_steps("specforge", {"WORK": tmp_path, "HSX_SERVER": server, "MODEL": model})
    file_refs = OfflineManifestReader(str(tmp_path / "specforge-data"), ttt_length=3, max_len=64).read()
    file_refs.sort(key=lambda ref: int(Path(ref.feature_store_uri).stem.split("_")[1]))
    file_losses = specforge_train(specforge_loader(LocalFeatureStore(), file_refs), parts, model, monkeypatch)
    # SpecForge's loss is 0 for a batch in which the target model (random, tiny) predicts no token
    # of the 64-id draft vocabulary at any position: 7 of these 10 batches.
    assert len(losses) == STEPS and all(0 <= x < 100 for x in losses) and sum(x > 0 for x in losses) >= 2
    assert losses == file_losses  # bitwise: the same batches of the same bytes


def test_specforge_store_gives_the_offline_files_tensors(server, model, specforge_tokens, tmp_path):
    """store.get(ref) is, tensor for tensor, LocalFeatureStore.get of hsx.convert's .ckpt."""
    from hsx.integrations.specforge import HsxFeatureStore
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    lines = read_jsonl(specforge_tokens[0])[:3]
    write_jsonl(tmp_path / "tokens.jsonl", lines)
    run_steps("specforge", {"WORK": tmp_path, "HSX_SERVER": server, "MODEL": model})
    file_refs = OfflineManifestReader(str(tmp_path / "specforge-data")).read()
    by_index = {int(Path(r.feature_store_uri).stem.split("_")[1]): r for r in file_refs}
    store, local = HsxFeatureStore([server], target_model=model), LocalFeatureStore()
    for ref in store.refs(lines, max_len=64, ttt_length=3):
        got, _ = store.get(ref)
        want, handle = local.get(by_index[ref.metadata["file_index"]])
        local.release(handle)
        assert got.keys() == want.keys()
        for key in got:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_specforge_refs_share_the_rows_over_ranks(model):
    from hsx.integrations.specforge import HsxFeatureStore

    store = HsxFeatureStore("unused:1", target_model=model)
    lines = rows(9, seed=2)
    shares = [store.refs(lines, max_len=64, ttt_length=3, seed=3, epoch=1, rank=r, world_size=2) for r in range(2)]
    indices = [ref.metadata["file_index"] for part in shares for ref in part]
    assert sorted(indices) == list(range(9)) and len(shares[0]) == 5


def test_specforge_store_fails_at_start_on_a_target_of_another_vocabulary(server, model, tmp_path):
    from hsx.integrations.specforge import HsxFeatureStore
    from hsx.preflight import ModelMismatch

    other = tmp_path / "target"
    other.mkdir()
    config = json.loads((Path(model) / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 2 * VOCAB}))
    store = HsxFeatureStore([server], target_model=other)
    with pytest.raises(ModelMismatch, match=f"with vocab_size {VOCAB}, but the target model's config"):
        store.get(store.refs(rows(2, seed=1), max_len=64, ttt_length=3)[0])


def test_modelopt_items_without_the_final_norm_are_its_prenorm_offline_items(server, model, modelopt_tokens, tmp_path):
    """final_norm=False: the target is capture id N, marked pre-norm, as hsx.convert writes it from a
    dump without --final-norm (ModelOpt re-applies the norm)."""
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset

    from pipeline import BIN

    lines = read_jsonl(modelopt_tokens[0])[:3]
    write_jsonl(tmp_path / "rows.jsonl", lines)
    subprocess.run([BIN / "hsx-dump", "--server", server, "--input", tmp_path / "rows.jsonl", "--out",
                    tmp_path / "dump", "--capture", "eagle3"], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "hsx.convert", tmp_path / "dump", "--to", "modelopt", tmp_path / "data"],
                   check=True, capture_output=True)
    offline = OfflineSupervisedDataset([str(tmp_path / "data" / f"data_{i}.pt") for i in range(3)],
                                       answer_only_loss=True)
    online = modelopt_online(server, model, lines, final_norm=False)
    for i in range(3):
        a, b = online[i], offline[i]
        assert a.keys() == b.keys() and a["base_hidden_prenorm"] is b["base_hidden_prenorm"] is True
        for key in a:
            if key != "base_hidden_prenorm":
                assert torch.equal(a[key], b[key]), key
