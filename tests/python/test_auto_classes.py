"""Generated checkpoints load in transformers' Auto classes without remote code
(the default layout, model_type deepseek_v3), always carry an index, and
hsx-inspect says which layout a checkpoint has."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from hf_oracle import load_reference


@pytest.fixture(scope="module")
def default_model(make_model):
    return make_model(None, seed=0)  # no --layout: the default


def test_default_config_is_deepseek_v3_with_an_index(default_model):
    config = json.loads((default_model / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "auto_map" not in config
    index = json.loads((default_model / "model.safetensors.index.json").read_text())
    tensors = load_file(default_model / "model.safetensors")
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == {"model.safetensors"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_auto_config_and_auto_model_load_without_remote_code(default_model):
    config = AutoConfig.from_pretrained(default_model)
    assert type(config).__name__ == "DeepseekV3Config" and config.num_hidden_layers == 8
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    tensors = load_file(default_model / "model.safetensors")
    assert torch.equal(model.get_input_embeddings().weight, tensors["model.embed_tokens.weight"].float())
    assert torch.equal(model.get_output_embeddings().weight, tensors["lm_head.weight"].float())
    # The whole model, INT4 experts included, computes what the oracle's hand-built reference does:
    # exactly up to the first MoE layer; after it within bf16 rounding, as transformers keeps the
    # decompressed experts in bf16 even with dtype=float32 (measured max |diff| 0.013 at |x| <= 4).
    reference = load_reference(default_model, torch.float32)
    ids = torch.tensor([[5, 17, 300, 1999, 42, 7]])
    with torch.no_grad():
        got = model(ids, output_hidden_states=True).hidden_states
        want = reference(ids, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 9
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    for k, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=0.02, atol=0.05, msg=f"hidden state {k}")


def test_kimi_layout_is_still_selectable_and_needs_remote_code(make_model):
    model = make_model("k2", seed=0)
    assert json.loads((model / "config.json").read_text())["model_type"] == "kimi_k2"
    with pytest.raises(ValueError, match="kimi_k2"):
        AutoConfig.from_pretrained(model)


@pytest.mark.parametrize("layout, name, loads", [(None, "deepseek_v3", True), ("k2", "k2", False),
                                                 ("k2.5", "k2.5", False)])
def test_inspect_reports_the_layout(make_model, run, layout, name, loads):
    report = json.loads(run("hsx-inspect", "--model", make_model(layout, seed=0), "--json").stdout)
    assert report["architecture"]["layout"] == name
    assert report["architecture"]["transformers"].startswith("Auto classes load it") == loads


def test_bad_layout_is_an_error(run, tmp_path):
    proc = run("hsx-make-model", "--preset", "tiny", "--layout", "kimi", "--out", tmp_path / "m", expect_ok=False)
    assert "--layout 'kimi': expected one of deepseek_v3, k2, k2.5" in proc.stderr
    assert not (tmp_path / "m").exists()
