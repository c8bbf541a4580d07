"""Shared by the service benchmarks: running the hsx tools, and the wide
one-layer models that take the engine out of the picture (a tiny model's
config with the hidden size and vocabulary of interest)."""

import json
import shutil
import subprocess

# The narrow attention of the wide models: one small head, so that the
# decoder layer costs little next to the streamed bytes.
NARROW_ATTENTION = {"num_hidden_layers": 1, "intermediate_size": 32, "num_attention_heads": 1,
                    "num_key_value_heads": 1, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 16, "v_head_dim": 16, "first_k_dense_replace": 1}


def run(cmd):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{proc.stderr}")
    return proc.stdout


def wide_model(bin_dir, work, **config):
    """Writes work/wide: the tiny preset's config with NARROW_ATTENTION and `config` applied."""
    tiny = work / "tiny_for_config"
    run([bin_dir / "hsx-make-model", "--preset", "tiny", "--out", tiny])
    wide = json.loads((tiny / "config.json").read_text())
    wide.update(NARROW_ATTENTION)
    wide.update(config)
    (work / "wide.json").write_text(json.dumps(wide))
    run([bin_dir / "hsx-make-model", "--config", work / "wide.json", "--out", work / "wide"])
    shutil.rmtree(tiny)
    return work / "wide"
