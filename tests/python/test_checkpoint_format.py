"""Cross-checks of the hsx checkpoint format against code we did not write.

* compressed-tensors (the library that defines the "pack-quantized" format)
  decompresses every routed-expert weight of a sharded tiny checkpoint; the
  result must equal `hsx-inspect --dequant` bit for bit.
* The BF16 (ignored) weights must come back unchanged.
* transformers' DeepseekV3Config must load the generated config.json, and the
  tensor names and shapes must be the ones transformers' DeepseekV3 expects.
* hsx-make-model must be byte-deterministic, and the CLIs' error paths must give
  a one-line error and a non-zero exit status.
"""

import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.pack_quantized import (
    PackedQuantizationCompressor,
    unpack_from_int32,
)
from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_quantizable_tensors
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from conftest import LAYOUTS

PROJS = ("gate_proj", "up_proj", "down_proj")
SHARD_SIZE = "200KB"  # tiny is ~4 MB: gives well over a dozen shards and an index


# --------------------------------------------------------------------------- helpers


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def text_config(cfg: dict) -> dict:
    return cfg["text_config"] if "text_config" in cfg else cfg


def prefix_for(layout: str) -> str:
    return "language_model." if layout == "k2.5" else ""


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def weight_map(model_dir: Path) -> dict:
    """tensor name -> shard file name, via the index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    return {k: "model.safetensors" for k in safetensors_header(model_dir / "model.safetensors")}


def load_checkpoint(model_dir: Path) -> dict:
    """All tensors, read with the safetensors package, resolved through the index.

    Also checks that every shard holds exactly the tensors the index assigns it.
    """
    wmap = weight_map(model_dir)
    by_file = {}
    for name, file in wmap.items():
        by_file.setdefault(file, set()).add(name)
    tensors = {}
    for file, names in sorted(by_file.items()):
        with safe_open(str(model_dir / file), framework="pt") as f:
            keys = set(f.keys())
            assert keys == names, (
                f"{file}: index and shard disagree; only in shard: {sorted(keys - names)[:5]}, "
                f"only in index: {sorted(names - keys)[:5]}"
            )
            for k in keys:
                tensors[k] = f.get_tensor(k)
    return tensors


def routed_expert_modules(tc: dict, prefix: str) -> list:
    first = tc.get("first_k_dense_replace", 0)
    freq = tc.get("moe_layer_freq", 1)
    return [
        f"{prefix}model.layers.{i}.mlp.experts.{j}.{p}"
        for i in range(tc["num_hidden_layers"])
        if i >= first and (i - first) % freq == 0
        for j in range(tc["n_routed_experts"])
        for p in PROJS
    ]


def hsx_dequant(run, model_dir: Path, name: str, out: Path) -> torch.Tensor:
    run("hsx-inspect", "--model", model_dir, "--dequant", name, "--out", out)
    d = load_file(str(out))
    assert len(d) == 1, f"{out}: expected one tensor, got {list(d)}"
    (key, value), = d.items()
    expected_key = name if name.endswith((".weight", ".e_score_correction_bias")) else f"{name}.weight"
    assert key == expected_key, f"--dequant {name} wrote tensor {key!r}"
    assert value.dtype == torch.float32
    return value


def describe_mismatch(ours: torch.Tensor, ref: torch.Tensor, packed, scale, group: int) -> str:
    bad = (ours != ref).nonzero()
    r, c = (int(x) for x in bad[0])
    word = int(packed[r, c // 8]) & 0xFFFFFFFF
    return (
        f"{bad.shape[0]} of {ours.numel()} elements differ; first at [{r}, {c}]: "
        f"hsx {ours[r, c].item()!r} vs compressed-tensors {ref[r, c].item()!r} "
        f"(packed word 0x{word:08x}, nibble {(word >> (4 * (c % 8))) & 0xF}, "
        f"scale {scale[r, c // group].float().item()!r})"
    )


@contextmanager
def captured_transformers_warnings():
    """Collects the records transformers logs (its root logger does not propagate)."""
    records = []

    class _Handler(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = _Handler(level=logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=LAYOUTS)
def sharded_tiny(request, make_model):
    layout = request.param
    model_dir = make_model(layout, seed=3, extra_args=["--shard_size", SHARD_SIZE])
    return layout, model_dir


@pytest.fixture(scope="module")
def ct_decompressed(sharded_tiny):
    """compressed-tensors' decompression of every quantized module of the checkpoint.

    Uses the quantization_config of the checkpoint's own config.json, the
    compressor class registered for its "format", and compressed-tensors'
    own name matching (targets / ignore) to decide which modules are quantized.
    """
    layout, model_dir = sharded_tiny
    cfg = read_config(model_dir)
    qcfg = QuantizationConfig.model_validate(cfg["quantization_config"])
    assert qcfg.format == "pack-quantized"
    assert list(qcfg.config_groups) == ["group_0"]
    scheme = qcfg.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qcfg.format)
    assert compressor is PackedQuantizationCompressor
    param_names = compressor.compression_param_names(scheme)
    assert param_names == ("weight_packed", "weight_scale", "weight_shape"), param_names

    tensors = load_checkpoint(model_dir)
    out = {}
    for module, _ in match_quantizable_tensors(
        tensors, ignore=qcfg.ignore, targets=scheme.targets, param_targets=[param_names[0]]
    ):
        state = {p: tensors[f"{module}.{p}"] for p in param_names}
        out[module] = compressor.decompress(state, scheme)["weight"]
    return qcfg, scheme, tensors, out


# --------------------------------------------------------------------------- a. INT4 experts


def test_sharded_layout_and_tensor_dtypes(sharded_tiny):
    layout, model_dir = sharded_tiny
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert len(shards) > 3, f"expected several shards with --shard_size {SHARD_SIZE}: {shards}"
    assert (model_dir / "model.safetensors.index.json").is_file()
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)

    prefix = prefix_for(layout)
    tensors = load_checkpoint(model_dir)
    assert all(k.startswith(prefix + "model.") or k == prefix + "lm_head.weight" for k in tensors)
    # total_size counts tensor bytes (HF convention).
    data_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == data_bytes

    shape_dtype = torch.int32 if layout == "k2.5" else torch.int64
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            assert t.dtype == torch.int32, name
        elif name.endswith(".weight_shape"):
            assert t.dtype == shape_dtype and t.shape == (2,), (name, t.dtype, t.shape)
        elif name.endswith(".e_score_correction_bias"):
            assert t.dtype == torch.float32, name
        else:  # weights, weight_scale, norms
            assert t.dtype == torch.bfloat16, (name, t.dtype)


def test_compressed_tensors_finds_exactly_the_routed_experts(sharded_tiny, ct_decompressed):
    layout, model_dir = sharded_tiny
    _, _, tensors, decompressed = ct_decompressed
    tc = text_config(read_config(model_dir))
    expected = routed_expert_modules(tc, prefix_for(layout))
    assert sorted(decompressed) == sorted(expected)
    inter, hidden = tc["moe_intermediate_size"], tc["hidden_size"]
    for module, w in decompressed.items():
        assert w.dtype == torch.bfloat16, f"{module}: compressed-tensors gave {w.dtype}"
        want = (hidden, inter) if module.endswith("down_proj") else (inter, hidden)
        assert tuple(w.shape) == want, (module, tuple(w.shape))
        assert tensors[f"{module}.weight_shape"].tolist() == list(want)
    # The comparison below only means something if the weights use many levels.
    some = expected[: 3 * tc["n_routed_experts"]]
    levels = torch.unique(
        torch.cat(
            [
                unpack_from_int32(
                    tensors[f"{m}.weight_packed"], 4, tensors[f"{m}.weight_shape"].tolist()
                ).flatten()
                for m in some
            ]
        )
    )
    assert len(levels) >= 14, f"suspiciously few INT4 levels used: {levels.tolist()}"


def test_whole_checkpoint_dequantizer_agrees(sharded_tiny, ct_decompressed):
    """compressed-tensors' model-free entry point (reads config.json itself)."""
    _, model_dir = sharded_tiny
    _, _, tensors, decompressed = ct_decompressed
    dq = CompressedTensorsDequantizer(str(model_dir), dtype=torch.bfloat16)
    # validate() also fails on any leftover qparam the config does not target.
    result = dq.validate(dict(tensors))
    for module, w in decompressed.items():
        assert torch.equal(result[f"{module}.weight"], w), module
    passthrough = [k for k in tensors if not k.rpartition(".")[2].startswith("weight_")]
    for k in passthrough:
        assert torch.equal(result[k], tensors[k]), k
    assert len(result) == len(passthrough) + len(decompressed)


def test_int4_experts_bit_exact_vs_compressed_tensors(sharded_tiny, ct_decompressed, run, tmp_path):
    layout, model_dir = sharded_tiny
    qcfg, scheme, tensors, decompressed = ct_decompressed
    group = scheme.weights.group_size
    modules = sorted(decompressed)
    assert len(modules) == 336  # tiny: 7 MoE layers x 16 experts x 3 projections

    t0 = time.perf_counter()
    def dequant(i):
        return hsx_dequant(run, model_dir, modules[i], tmp_path / f"w{i}.safetensors")

    with ThreadPoolExecutor(max_workers=4) as pool:
        ours = dict(zip(modules, pool.map(dequant, range(len(modules)))))
    elapsed = time.perf_counter() - t0
    print(f"\n[{layout}] hsx-inspect --dequant of all {len(modules)} expert weights: {elapsed:.2f} s")

    failures = []
    for m in modules:
        ref = decompressed[m].float()
        got = ours[m]
        if got.shape != ref.shape:
            failures.append(f"{m}: shape {tuple(got.shape)} vs {tuple(ref.shape)}")
        elif not torch.equal(got, ref):
            failures.append(
                f"{m}: "
                + describe_mismatch(
                    got, ref, tensors[f"{m}.weight_packed"], tensors[f"{m}.weight_scale"], group
                )
            )
        elif not torch.equal(got.bfloat16().float(), got):
            failures.append(f"{m}: values not exactly representable in bf16")
    assert not failures, f"{len(failures)} of {len(modules)} weights differ:\n" + "\n".join(
        failures[:10]
    )


# --------------------------------------------------------------------------- b. BF16 weights


def test_bf16_weights_unchanged(sharded_tiny, run, tmp_path):
    layout, model_dir = sharded_tiny
    p = prefix_for(layout)
    tensors = load_checkpoint(model_dir)
    linears = [
        "model.layers.0.self_attn.q_a_proj",
        "model.layers.0.self_attn.q_b_proj",
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        "model.layers.0.self_attn.kv_b_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.3.self_attn.o_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.shared_experts.up_proj",
        "model.layers.1.mlp.shared_experts.down_proj",
    ]
    other = [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.2.input_layernorm.weight",
        "model.layers.2.self_attn.kv_a_layernorm.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
    ]
    for i, name in enumerate(linears + other):
        full = p + name
        raw = tensors[full if full.endswith((".weight", ".e_score_correction_bias")) else full + ".weight"]
        got = hsx_dequant(run, model_dir, full, tmp_path / f"b{i}.safetensors")
        assert got.shape == raw.shape, full
        assert torch.equal(got, raw.float()), f"{full}: hsx-inspect differs from the raw tensor"
        assert raw.float().abs().max() > 0, f"{full} is all zeros"


# --------------------------------------------------------------------------- c. transformers config


CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "n_shared_experts", "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
    "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob",
    "max_position_embeddings", "rms_norm_eps", "hidden_act", "attention_bias",
    "tie_word_embeddings",
)


def load_hf_config(model_dir: Path, layout: str) -> DeepseekV3Config:
    if layout == "k2.5":
        return DeepseekV3Config.from_dict(read_config(model_dir)["text_config"])
    return DeepseekV3Config.from_pretrained(str(model_dir))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transformers_loads_config(layout, make_model):
    model_dir = make_model(layout, seed=0)
    tc = text_config(read_config(model_dir))
    with captured_transformers_warnings() as warnings:
        hf = load_hf_config(model_dir, layout)
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    rope_warnings = [w for w in warnings if "rope" in w.lower() or "yarn" in w.lower()]
    assert not rope_warnings, rope_warnings

    for field in CONFIG_FIELDS:
        assert getattr(hf, field) == tc[field], (field, getattr(hf, field), tc[field])
    assert hf.qk_head_dim == tc["qk_nope_head_dim"] + tc["qk_rope_head_dim"]

    rs = tc["rope_scaling"]
    rp = hf.rope_parameters
    assert rp["rope_type"] == "yarn" == rs["type"]
    assert rp["rope_theta"] == tc["rope_theta"]
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim"):
        assert rp[key] == rs[key], (key, rp[key], rs[key])
    assert inv_freq.shape == (tc["qk_rope_head_dim"] // 2,)
    assert torch.isfinite(inv_freq).all()
    assert attention_factor == 1.0  # mscale == mscale_all_dim
    assert tc["max_position_embeddings"] / rs["original_max_position_embeddings"] == rs["factor"]


def expected_hf_names(hf: DeepseekV3Config, prefix: str) -> dict:
    """name -> shape of every tensor transformers' DeepseekV3 would load, with the
    fused expert tensors split back into per-expert Linear weights."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(hf)
    out = {}
    for name, t in model.state_dict().items():
        if ".mlp.experts.gate_up_proj" in name:
            e, two_i, h = t.shape
            base = name.rsplit(".", 1)[0]
            for j in range(e):
                out[f"{prefix}{base}.{j}.gate_proj.weight"] = (two_i // 2, h)
                out[f"{prefix}{base}.{j}.up_proj.weight"] = (two_i // 2, h)
        elif ".mlp.experts.down_proj" in name:
            e, h, i = t.shape
            base = name.rsplit(".", 1)[0]
            for j in range(e):
                out[f"{prefix}{base}.{j}.down_proj.weight"] = (h, i)
        else:
            out[prefix + name] = tuple(t.shape)
    return out


def checkpoint_shapes(tensors: dict) -> dict:
    """name -> logical shape, with INT4 triples folded back to `<module>.weight`."""
    out = {}
    for name, t in tensors.items():
        module, _, param = name.rpartition(".")
        if param == "weight_shape":
            out[f"{module}.weight"] = tuple(t.tolist())
        elif param not in ("weight_packed", "weight_scale"):
            out[name] = tuple(t.shape)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensor_names_match_transformers_model(layout, make_model):
    model_dir = make_model(layout, seed=0)
    hf = load_hf_config(model_dir, layout)
    expected = expected_hf_names(hf, prefix_for(layout))
    ours = checkpoint_shapes(load_checkpoint(model_dir))
    assert sorted(set(ours) - set(expected)) == [], "tensors transformers would not load"
    assert sorted(set(expected) - set(ours)) == [], "tensors transformers needs but we lack"
    diff = {k: (ours[k], expected[k]) for k in ours if ours[k] != expected[k]}
    assert not diff, diff


@pytest.mark.parametrize("layout", LAYOUTS)
def test_q_lora_rank_null(layout, make_model, run, tmp_path):
    base = read_config(make_model(layout, seed=0))
    text_config(base)["q_lora_rank"] = None
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(base, indent=2))
    model_dir = make_model(None, seed=1, preset=None, extra_args=["--config", cfg_file])

    written = read_config(model_dir)
    assert ("text_config" in written) == (layout == "k2.5")
    assert "q_lora_rank" in text_config(written) and text_config(written)["q_lora_rank"] is None
    hf = load_hf_config(model_dir, layout)
    assert hf.q_lora_rank is None

    p = prefix_for(layout)
    tensors = load_checkpoint(model_dir)
    assert not [k for k in tensors if ".q_a_proj" in k or ".q_b_proj" in k or "q_a_layernorm" in k]
    tc = text_config(written)
    q_shape = (tc["num_attention_heads"] * (tc["qk_nope_head_dim"] + tc["qk_rope_head_dim"]),
               tc["hidden_size"])
    for i in range(tc["num_hidden_layers"]):
        t = tensors[f"{p}model.layers.{i}.self_attn.q_proj.weight"]
        assert tuple(t.shape) == q_shape and t.dtype == torch.bfloat16

    # Names and shapes agree with transformers' q_proj variant of the model.
    ours = checkpoint_shapes(tensors)
    assert ours == expected_hf_names(hf, p)
    got = hsx_dequant(run, model_dir, f"{p}model.layers.1.self_attn.q_proj", tmp_path / "q.safetensors")
    assert torch.equal(got, tensors[f"{p}model.layers.1.self_attn.q_proj.weight"].float())


# --------------------------------------------------------------------------- d. determinism


def file_hashes(model_dir: Path) -> dict:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(model_dir.iterdir())
        if p.is_file()
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_make_model_is_byte_deterministic(layout, make_model):
    args = ["--shard_size", "1MB"]
    a = make_model(layout, seed=11, extra_args=args + ["--threads", "1"], fresh=True)
    b = make_model(layout, seed=11, extra_args=args + ["--threads", "2"], fresh=True)
    c = make_model(layout, seed=12, extra_args=args, fresh=True)
    ha, hb, hc = file_hashes(a), file_hashes(b), file_hashes(c)
    assert len(ha) > 2, ha
    assert ha == hb
    assert ha["config.json"] == hc["config.json"]
    assert ha.keys() == hc.keys()
    assert [k for k in ha if k.endswith(".safetensors") and ha[k] == hc[k]] == [], (
        "a different seed should change every shard"
    )


# --------------------------------------------------------------------------- e. error paths


def assert_one_line_error(proc, *needles):
    assert proc.returncode > 0, f"exit status {proc.returncode} (signal or success?)"
    err = proc.stderr.strip()
    lines = err.splitlines()
    assert len(lines) == 1, f"expected a one-line error, got:\n{proc.stderr}"
    assert "error" in lines[0].lower(), lines[0]
    for n in needles:
        assert str(n) in lines[0], f"{n!r} not in error message: {lines[0]}"
    return lines[0]


def test_error_unknown_preset(run, tmp_path):
    out = tmp_path / "m"
    proc = run("hsx-make-model", "--preset", "no-such-preset", "--out", out, expect_ok=False)
    assert_one_line_error(proc, "no-such-preset")
    assert not out.exists() or not any(out.iterdir())


def test_error_out_dir_not_empty(run, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    proc = run("hsx-make-model", "--preset", "tiny", "--out", out, expect_ok=False)
    assert_one_line_error(proc, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("cut", ["header", "data"])
def test_error_truncated_shard(cut, run, make_model, tmp_path):
    import shutil

    src = make_model("k2", seed=0, extra_args=["--shard_size", SHARD_SIZE])
    model_dir = tmp_path / "m"
    shutil.copytree(src, model_dir)
    shard = sorted(model_dir.glob("model-*.safetensors"))[2]
    size = shard.stat().st_size
    header_len = int.from_bytes(shard.read_bytes()[:8], "little")
    new_size = header_len // 2 if cut == "header" else 8 + header_len + (size - 8 - header_len) // 2
    with open(shard, "r+b") as f:
        f.truncate(new_size)
    in_shard = sorted(k for k, v in weight_map(model_dir).items() if v == shard.name)[0]
    out = tmp_path / "w.safetensors"
    for args in (["--json"], [], ["--dequant", in_shard, "--out", out]):
        proc = run("hsx-inspect", "--model", model_dir, *args, expect_ok=False)
        assert_one_line_error(proc, shard.name)
    assert not out.exists()


def test_error_unknown_dequant_name(run, make_model, tmp_path):
    model_dir = make_model("k2", seed=0)
    out = tmp_path / "w.safetensors"
    for name in ("model.layers.1.mlp.experts.999.up_proj", "no.such.weight"):
        proc = run("hsx-inspect", "--model", model_dir, "--dequant", name, "--out", out,
                   expect_ok=False)
        assert_one_line_error(proc, name)
        assert not out.exists()


# ---------------------------------------------------------------------------
# The released configs (tests/fixtures, typed in; README there names the
# sources): hsx's reading of every architecture field equals transformers'.

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RELEASED = {"kimi-k2-instruct": "flat", "kimi-k2.5": "nested_k25"}


def hsx_reads_config(run, path: Path) -> dict:
    return json.loads(run("hsx-inspect", "--config", path).stdout)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_config_read_by_hsx_equals_transformers(name, run, tmp_path):
    raw = json.loads((FIXTURES / name / "config.json").read_text())
    if "quantization_config" in raw and raw["quantization_config"].get("quant_method") == "fp8":
        # hsx refuses the FP8 checkpoint by name; its BF16 conversion drops the block.
        refused = run("hsx-inspect", "--config", FIXTURES / name / "config.json", expect_ok=False)
        assert "'quant_method' is \"fp8\"; hsx supports only \"compressed-tensors\"" in refused.stderr
        del raw["quantization_config"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    ours = hsx_reads_config(run, path)
    assert ours["layout"] == RELEASED[name]
    tc = raw.get("text_config", raw)
    with captured_transformers_warnings() as warnings:
        hf = DeepseekV3Config.from_dict(tc)
    assert not [w for w in warnings if "rope" in w.lower() or "yarn" in w.lower()], warnings
    for field in CONFIG_FIELDS:
        assert ours[field] == getattr(hf, field), (field, ours[field], getattr(hf, field))
    for field in ("moe_intermediate_size", "intermediate_size", "scoring_func", "topk_method",
                  "routed_scaling_factor", "rope_theta"):
        value = hf.rope_parameters["rope_theta"] if field == "rope_theta" else getattr(hf, field)
        assert ours[field] == value, (field, ours[field], value)
    rp = hf.rope_parameters
    assert rp["rope_type"] == ours["rope_scaling"]["type"] == "yarn"
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim"):
        assert ours["rope_scaling"][key] == rp[key], (key, ours["rope_scaling"][key], rp[key])
    # The two differ exactly where the released files differ (model-spec.md §1).
    expected = {"kimi-k2-instruct": (1e-6, 32.0, 1.0), "kimi-k2.5": (1e-5, 64.0, 32.0)}[name]
    assert (ours["rms_norm_eps"], ours["rope_scaling"]["factor"], ours["rope_scaling"]["beta_fast"]) == expected
