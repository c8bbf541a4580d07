"""The reference: Hugging Face transformers' DeepseekV3 on an hsx checkpoint.

Routed experts are decompressed by the compressed-tensors package (not by our
code), every other weight is read with the safetensors package, and the forward
pass is transformers' own. Agreement with hsx therefore checks both the INT4
format and the model math against implementations we did not write.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_quantizable_tensors
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM


def read_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def tensor_prefix(config: dict) -> str:
    return "language_model." if "text_config" in config else ""


def read_tensors(model_dir: Path) -> dict:
    """Every tensor of the checkpoint, resolved through the index when there is one."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    tensors = {}
    for file in files:
        with safe_open(str(model_dir / file), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def decompress_quantized(config: dict, tensors: dict) -> dict:
    """module name -> bf16 weight, decompressed by compressed-tensors."""
    qcfg = QuantizationConfig.model_validate(config["quantization_config"])
    scheme = qcfg.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qcfg.format)
    names = compressor.compression_param_names(scheme)
    out = {}
    for module, _ in match_quantizable_tensors(
            tensors, ignore=qcfg.ignore, targets=scheme.targets, param_targets=[names[0]]):
        state = {p: tensors[f"{module}.{p}"] for p in names}
        out[module] = compressor.decompress(state, scheme)["weight"]
    return out


def load_reference(model_dir: Path, dtype: torch.dtype, config_edits: dict = None) -> DeepseekV3ForCausalLM:
    """transformers' DeepseekV3ForCausalLM holding the checkpoint's weights, in `dtype`
    (router weight, correction bias and rotary frequencies stay float32, as
    from_pretrained keeps them). `config_edits` (text-config fields; "rope_X"
    edits rope_scaling's X) make a deliberately wrong reference for the guard
    tests."""
    config = read_config(model_dir)
    prefix = tensor_prefix(config)
    tc = json.loads(json.dumps(text_config(config)))
    for key, value in (config_edits or {}).items():
        if key.startswith("rope_"):
            tc["rope_scaling"][key[len("rope_"):]] = value
        else:
            tc[key] = value
    hf_config = DeepseekV3Config.from_dict(tc)
    hf_config._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hf_config)
    tensors = read_tensors(model_dir)
    weights = {name: t for name, t in tensors.items()}
    for module, w in decompress_quantized(config, tensors).items():
        weights[f"{module}.weight"] = w
    state = {}
    for name, param in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = prefix + name.rsplit(".", 1)[0]
            state[name] = torch.stack([
                torch.cat([weights[f"{base}.{e}.gate_proj.weight"], weights[f"{base}.{e}.up_proj.weight"]])
                for e in range(param.shape[0])])
        elif name.endswith("mlp.experts.down_proj"):
            base = prefix + name.rsplit(".", 1)[0]
            state[name] = torch.stack([weights[f"{base}.{e}.down_proj.weight"]
                                       for e in range(param.shape[0])])
        else:
            state[name] = weights[prefix + name]
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.clone()
    model = model.to(dtype)
    # from_pretrained(torch_dtype=...) keeps the rotary frequencies in float32;
    # a plain .to(dtype) would round them to the activation dtype.
    rotary.inv_freq = inv_freq
    rotary.original_inv_freq = inv_freq.clone()
    for layer in model.model.layers:  # _keep_in_fp32_modules_strict
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.weight.data = gate.weight.data.to(torch.float32)
            gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.to(torch.float32)
    return model.eval()


def _as_exact_float32(t: torch.Tensor) -> torch.Tensor:
    """t as float32, checked to hold bfloat16 values: then every product of two
    elements is exact in float32, and an add after it is the fused multiply-add."""
    f = t.to(torch.float32)
    if not torch.equal(f, f.to(torch.bfloat16).to(torch.float32)):
        raise AssertionError("k-ordered GEMM: an operand holds values that are not bfloat16")
    return f


def _k_ordered(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N]: each element summed over k = 0, 1, ... in
    float32 from 0, then rounded once to out_dtype."""
    a, b = _as_exact_float32(a), _as_exact_float32(b)
    acc = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=torch.float32)
    for k in range(a.shape[-1]):
        acc += a[..., k, None] * b[..., k, None, :]
    return acc.to(out_dtype)


def _grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype):
    """torch._grouped_mm's 2D x 3D case: rows offs[i-1]:offs[i] of a times b[i]."""
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=out_dtype)
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = _k_ordered(a[start:end], b[i], out_dtype)
        start = end
    return out


class KOrderedGemm(TorchDispatchMode):
    """Computes the reference's matrix products (mm, addmm without bias, bmm,
    _grouped_mm) as a GEMM with float32 accumulation defines them: each
    element is the sum over k in ascending order, in float32, rounded once
    to the output dtype. The operands must hold bfloat16 values (checked),
    which makes every product exact, so the result does not depend on how the
    sum is fused or vectorised.

    Why: torch's own bfloat16 GEMM sums in an order chosen by oneDNN for the
    host CPU (AMX tiles sum pairs of products, AVX-512 does not), so its last
    bit differs between machines, and a bit-identity test against it would pass
    on one CPU and fail on another. hsx's CPU GEMM sums in this order (see
    kernels/cpu/gemm.h); everything else (where the rounding happens, the
    attention, the routing, the norms) is still transformers' own code."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten.mm.default:
            a, b = args
            return _k_ordered(a, b, a.dtype)
        if func is aten.bmm.default:
            a, b = args
            return _k_ordered(a, b, a.dtype)
        if func is aten._grouped_mm.default:
            a, b, offs = args[:3]
            assert a.dim() == 2 and b.dim() == 3 and len(args) == 3 and not kwargs, (args, kwargs)
            return _grouped(a, b, offs, a.dtype)
        if func in (aten.addmm.default, aten.baddbmm.default, aten.matmul.default,
                    aten.linear.default, aten.dot.default, aten.mv.default):
            raise AssertionError(f"k-ordered GEMM: {func} is not handled")
        return func(*args, **kwargs)


@torch.no_grad()
def reference_states(model: DeepseekV3ForCausalLM, input_ids: list) -> tuple:
    """(R, final) for one sample: R[k] = residual stream entering layer k for
    k = 0..N (R[N]: the last layer's raw output), final = post-final-norm state;
    each [T, H] float32."""
    captured = {}
    last = model.model.layers[-1]
    handle = last.register_forward_hook(lambda m, args, out: captured.__setitem__(
        "last", out[0] if isinstance(out, tuple) else out))
    try:
        if model.dtype == torch.bfloat16:
            with KOrderedGemm():
                out = model.model(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
        else:
            out = model.model(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        handle.remove()
    n = len(model.model.layers)
    hs = out.hidden_states
    assert len(hs) == n + 1, len(hs)
    states = [hs[k][0].float() for k in range(n)] + [captured["last"][0].float()]
    return states, out.last_hidden_state[0].float()


# --------------------------------------------------------------------------
# Deliberately wrong references: the guard tests show that each of these
# defects, were hsx to have it, would fail the oracle's tolerance.

def move_rmsnorm_rounding(model: DeepseekV3ForCausalLM) -> DeepseekV3ForCausalLM:
    """Every RMSNorm rounds to the activation dtype once, after the weight
    multiply, instead of before it (transformers: weight * bf16(x / rms))."""
    for module in model.modules():
        if type(module).__name__ == "DeepseekV3RMSNorm":
            def forward(hidden, m=module):
                x = hidden.float()
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
                return (m.weight.float() * x).to(hidden.dtype)
            module.forward = forward
    return model


def round_per_rank_before_reduce(model: DeepseekV3ForCausalLM, tp: int) -> DeepseekV3ForCausalLM:
    """Row-parallel Linears (o_proj, the dense and shared-expert down_proj) as a
    tensor-parallel engine that rounds each rank's partial sum to the activation
    dtype before the all-reduce would compute them (hsx rounds once, after)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(("o_proj", "down_proj")):
            def forward(x, m=module):
                step = x.shape[-1] // tp
                parts = [F.linear(x[..., r * step:(r + 1) * step], m.weight[:, r * step:(r + 1) * step])
                         for r in range(tp)]
                return sum(p.float() for p in parts).to(x.dtype)
            module.forward = forward
    return model
