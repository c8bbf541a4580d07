"""The draft vocabulary and one training step of each trainer, on the CPU, on
hsx output: the data steps and the vocab step of docs/trainers.md run as
written (hsx-dump from hsx-server, hsx-verify, hsx.convert, python -m
hsx.vocab), then each trainer loads the vocab mapping with its own loading code
and runs one optimizer step of its own EAGLE-3 draft model with its own loss:

  speculators  its whole `speculators train` entry point (speculators_cpu_step.py:
               two CPU stand-ins for the accelerator, nothing else replaced)
  SpecForge    its own builders (build_eagle3_draft, build_eagle3_model, the step
               strategy), offline normalizer and collator, and BF16Optimizer; its
               trainer needs torch.distributed + FSDP and sglang, so the step is
               called directly, its Triton loss kernel is replaced by SpecForge's
               own reference implementation of the same loss (core/loss.py), and
               torch.compile is off
  ModelOpt     FakeBaseModel (offline training), mtsp.convert to EAGLE-3,
               load_draft_vocab_cache, its offline dataset and collator, and one
               transformers.Trainer step (what ModelOpt's example trains with) on the CPU

Each asserts that the trainer's d2t/t2d are hsx's intent (the top-N ids of the
frequency file, ties to the lower id, ascending; d2t as offsets), the loss is
finite and every trainable parameter changed.

End to end: each pipeline starts from conversations (pipeline.conversations:
every layout, tool calls, thinking, non-ASCII), which docs/trainers.md's
"prepare" block renders with python -m hsx.prepare and the tokenizer and chat
template in the model directory into the token JSONL and the frequency file
that the data and vocab blocks then use."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import HIDDEN, VOCAB, conversations, intended_draft_ids, read_jsonl, run_steps, write_jsonl

DRAFT_VOCAB = 64
STEP_SCRIPT = Path(__file__).with_name("speculators_cpu_step.py")


@pytest.fixture
def tokens(model, tmp_path):
    """(token JSONL, frequency file): docs/trainers.md's prepare block on pipeline.conversations,
    rendered with the model directory's tokenizer and Kimi-K2-Thinking's chat template: conversations
    with reasoning are written one row per assistant turn (the template empties finished turns'
    reasoning), every other one as one row, and nothing is skipped."""
    chats = conversations()
    run_steps("prepare", {"MODEL": model, "CHATS": write_jsonl(tmp_path / "chats.jsonl", chats), "WORK": tmp_path})
    jsonl, freq = tmp_path / "tokens.jsonl", tmp_path / "tokens.jsonl.freq.json"
    lines, report = read_jsonl(jsonl), read_jsonl(tmp_path / "tokens.jsonl.report.jsonl")
    assert {entry["action"] for entry in report} <= {"per-turn"}, report
    assert len(lines) == len(chats) + sum(entry["rows"] - 1 for entry in report) and report
    assert all(len(line["input_ids"]) == len(line["loss_mask"]) and 0 < sum(line["loss_mask"]) < len(line["loss_mask"])
               and max(line["input_ids"]) < VOCAB for line in lines)
    counted = json.loads(freq.read_text())
    assert counted["tokens"] == sum(sum(line["loss_mask"]) for line in lines)
    return jsonl, freq


def assert_mapping_is_intended(d2t, t2d_ids, t2d_size, freq):
    ids = intended_draft_ids(freq, DRAFT_VOCAB)
    assert len(ids) == DRAFT_VOCAB and t2d_size == VOCAB
    assert list(d2t) == [t - i for i, t in enumerate(ids)]  # offsets: draft i is target i + d2t[i]
    assert list(t2d_ids) == ids


# --------------------------------------------------------------------------- speculators


def speculators_one_step(server, model, tokens_jsonl, freq, work):
    """hsx output in speculators' layout, the vocab step, then `speculators train` for one step."""
    data = work / "prepared"  # speculators' prepared dataset, from the token JSONL
    env = {"DATA": data, "WORK": work, "HSX_SERVER": server, "MODEL": model, "FREQ": freq,
           "DRAFT_VOCAB": DRAFT_VOCAB}
    assert Path(tokens_jsonl) == work / "tokens.jsonl"  # the blocks read WORK/tokens.jsonl
    run_steps("speculators-data", env)
    run_steps("speculators", env)
    run_steps("speculators-vocab", env)
    result = work / "step.json"
    # The documented command plus what a CPU run needs: one step, a one-layer draft, no worker
    # processes, the eager loss, sdpa attention, an explicit mask token (no tokenizer here).
    flags = ["--verifier-name-or-path", model, "--data-path", data, "--speculator-type", "eagle3",
             "--on-missing", "raise", "--draft-vocab-size", DRAFT_VOCAB, "--num-layers", "1", "--max-steps", "1",
             "--epochs", "1", "--num-workers", "0", "--total-seq-len", "512", "--loss-implementation", "eager",
             "--draft-attn-impl", "sdpa", "--mask-token-id", "0", "--save-path", work / "out",
             "--log-dir", work / "logs"]
    proc = subprocess.run([sys.executable, STEP_SCRIPT, result, *map(str, flags)], capture_output=True,
                          text=True, timeout=300, cwd=work)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(result.read_text())


def test_speculators_one_training_step_with_the_hsx_vocab(server, model, tokens, tmp_path):
    tokens_jsonl, freq = tokens
    step = speculators_one_step(server, model, tokens_jsonl, freq, tmp_path)
    assert step["d2t"] is not None, "speculators found no vocab mapping in DATA (so it trained on the full vocabulary)"
    assert_mapping_is_intended(step["d2t"], step["t2d_ids"], step["t2d_size"], freq)
    assert len(step["losses"]) == 1 and math.isfinite(step["losses"][0]) and step["losses"][0] > 0
    assert step["unchanged"] == [] and "fc.weight" in step["changed"]


def test_speculators_own_loader_reads_the_vocab_files(tokens, tmp_path):
    """speculators' _load_mappings (used by `speculators train`) and the draft's own checks."""
    from speculators.train.cli import _load_mappings

    _, freq = tokens
    subprocess.run([sys.executable, "-m", "hsx.vocab", "--frequencies", freq, "--draft-vocab-size",
                    str(DRAFT_VOCAB), "--format", "speculators", "--out", tmp_path], check=True, capture_output=True)
    d2t, t2d, size = _load_mappings(tmp_path / f"d2t-{DRAFT_VOCAB}.npy", tmp_path / f"t2d-{DRAFT_VOCAB}.npy",
                                    DRAFT_VOCAB)
    assert size == DRAFT_VOCAB and d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert_mapping_is_intended(d2t.tolist(), t2d.nonzero().flatten().tolist(), t2d.shape[0], freq)
    with pytest.raises(ValueError, match="requires 32"):
        _load_mappings(tmp_path / f"d2t-{DRAFT_VOCAB}.npy", tmp_path / f"t2d-{DRAFT_VOCAB}.npy", 32)


# --------------------------------------------------------------------------- SpecForge


def specforge_parts(model, work):
    """SpecForge's own builders, from a config as its training assembles them (offline mode)."""
    from transformers import LlamaConfig
    from specforge.algorithms.eagle3.providers import build_step, step_options
    from specforge.algorithms.model_providers import build_eagle3_draft, build_eagle3_model
    from specforge.config.schema import Config

    cfg = Config.model_validate({
        "model": {"target_model_path": str(model), "vocab_mapping_path": str(work / "vocab_mapping.pt"),
                  "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(work / "specforge-data"), "max_length": 64},
        "training": {"attention_backend": "sdpa", "ttt_length": 3, "learning_rate": 1e-2, "warmup_ratio": 0.0}})
    draft_config = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], hidden_size=HIDDEN, intermediate_size=256,
                               num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1, vocab_size=VOCAB,
                               draft_vocab_size=DRAFT_VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    draft = build_eagle3_draft(cfg, draft_config)  # loads model.vocab_mapping_path
    parts = build_eagle3_model(cfg, draft, draft_config, None, None)
    return cfg, draft, parts, build_step(parts.model, target_head=parts.target_head, **step_options(cfg))


def specforge_one_step(server, model, tokens_jsonl, freq, work, monkeypatch):
    import specforge.algorithms.eagle3.model as eagle3_model
    import specforge.core.loss as specforge_loss
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
    from specforge.data.preprocessing import list_local_files
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch

    env = {"WORK": work, "HSX_SERVER": server, "MODEL": model, "FREQ": freq, "DRAFT_VOCAB": DRAFT_VOCAB}
    assert Path(tokens_jsonl) == work / "tokens.jsonl"  # the blocks read WORK/tokens.jsonl
    run_steps("specforge", env)
    run_steps("specforge-vocab", env)
    # SpecForge's loss is a Triton kernel (GPU only): its reference implementation of the same loss
    # (core/loss.py) stands in. torch.compile is off for the step (compiling SpecForge's functions
    # takes ~17 s on 2 cores; the step itself 0.2 s).
    reference = specforge_loss._compute_loss
    monkeypatch.setattr(eagle3_model, "LogSoftmaxLoss", type("CpuLoss", (), {"apply": staticmethod(reference)}))
    cfg, draft, parts, strategy = specforge_parts(model, work)
    normalize, collate = build_offline_normalizer(cfg.data.max_length), build_offline_collator()
    files = list_local_files(cfg.data.hidden_states_path)
    batch = collate([normalize(torch.load(f, weights_only=True)) for f in files])
    train_batch = TrainBatch(sample_ids=[str(f) for f in files], strategy="eagle3", tensors=batch,
                             metadata={"target_repr": "hidden_state"})
    trained = strategy.trainable_module()
    optimizer = BF16Optimizer(trained, lr=cfg.training.learning_rate, max_grad_norm=cfg.training.max_grad_norm,
                              warmup_ratio=cfg.training.warmup_ratio, total_steps=10)
    before = {n: p.detach().clone() for n, p in trained.named_parameters() if p.requires_grad}
    # torch's own patch: monkeypatch's undo deletes a key of torch's config module (pytest 9 reads
    # the old value from the module's __dict__, finds none, and deletes), breaking later tests.
    with torch._dynamo.config.patch(disable=True):
        out = strategy.forward_loss(train_batch)
        out.loss.backward()
        optimizer.step()
    unchanged = [n for n, p in trained.named_parameters() if n in before and torch.equal(before[n], p)]
    return draft, float(out.loss.detach()), sorted(before), unchanged


def test_specforge_one_training_step_with_the_hsx_vocab(server, model, tokens, tmp_path, monkeypatch):
    tokens_jsonl, freq = tokens
    draft, loss, trainable, unchanged = specforge_one_step(server, model, tokens_jsonl, freq, tmp_path, monkeypatch)
    assert draft.vocab_mapping_loaded and draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool
    assert_mapping_is_intended(draft.d2t.tolist(), draft.t2d.nonzero().flatten().tolist(), draft.t2d.shape[0], freq)
    assert math.isfinite(loss) and loss > 0
    assert "draft_model.fc.weight" in trainable and unchanged == []


# --------------------------------------------------------------------------- ModelOpt


def modelopt_model(model, d2t_path):
    """The offline EAGLE-3 model as ModelOpt builds it: FakeBaseModel, mtsp.convert, the d2t cache."""
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from modelopt.torch.speculative.plugins.hf_eagle import HFEagleModel
    from modelopt.torch.speculative.utils import load_vlm_or_llm

    base = load_vlm_or_llm(str(model), use_fake_base=True, use_offline_training=True)
    config = json.loads(json.dumps(EAGLE3_DEFAULT_CFG["config"]))
    config.update({"eagle_offline": True, "eagle_use_torch_compile": False})
    config["eagle_architecture_config"].update({
        "hidden_size": HIDDEN, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "num_hidden_layers": 1,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32})
    torch.manual_seed(0)
    mtsp.convert(base, [("eagle", config)])
    HFEagleModel.load_draft_vocab_cache(base, str(d2t_path))
    return base


def modelopt_one_step(server, model, tokens_jsonl, freq, work):
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
    from transformers import Trainer, TrainingArguments

    env = {"WORK": work, "HSX_SERVER": server, "MODEL": model, "FREQ": freq, "DRAFT_VOCAB": DRAFT_VOCAB}
    assert Path(tokens_jsonl) == work / "tokens.jsonl"  # the blocks read WORK/tokens.jsonl
    run_steps("modelopt", env)
    run_steps("modelopt-vocab", env)
    eagle = modelopt_model(model, work / "d2t.pt")
    files = sorted(str(p) for p in (work / "modelopt-data").glob("*.pt"))
    dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
    args = TrainingArguments(output_dir=str(work / "out"), max_steps=1, per_device_train_batch_size=len(files),
                             learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                             remove_unused_columns=False, dataloader_drop_last=False, bf16=False)
    trainer = Trainer(model=eagle, args=args, train_dataset=dataset, data_collator=EagleOfflineDataCollator(64))
    before = {n: p.detach().clone() for n, p in eagle.named_parameters() if p.requires_grad}
    trainer.train()
    unchanged = [n for n, p in eagle.named_parameters() if n in before and torch.equal(before[n], p)]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return eagle, losses, sorted(before), unchanged


def test_modelopt_one_training_step_with_the_hsx_vocab(server, model, tokens, tmp_path):
    tokens_jsonl, freq = tokens
    eagle, losses, trainable, unchanged = modelopt_one_step(server, model, tokens_jsonl, freq, tmp_path)
    d2t = eagle.eagle_module.d2t
    assert d2t.dtype == torch.int64
    target_ids = (torch.arange(DRAFT_VOCAB) + d2t).tolist()  # ModelOpt's own reading (_map_logits_to_draft_vocab)
    assert_mapping_is_intended(d2t.tolist(), target_ids, VOCAB, freq)
    assert len(losses) == 1 and math.isfinite(losses[0]) and losses[0] > 0
    assert "eagle_module.fc.weight" in trainable and unchanged == []


def test_modelopt_refuses_a_d2t_of_another_size(model, tokens, tmp_path):
    """ModelOpt's loader checks shape and dtype: a mapping for another draft size is refused."""
    _, freq = tokens
    subprocess.run([sys.executable, "-m", "hsx.vocab", "--frequencies", freq, "--draft-vocab-size", "32",
                    "--format", "modelopt", "--out", tmp_path / "d2t.pt"], check=True, capture_output=True)
    with pytest.raises(ValueError, match="Draft vocab cache mismatch"):
        modelopt_model(model, tmp_path / "d2t.pt")
