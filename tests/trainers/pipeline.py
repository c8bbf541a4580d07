"""What the trainers' tests share besides fixtures: the tiny model's sizes, the
docs/trainers.md blocks run as written (`doc_block`, `run_steps`), the
conversations the pipeline starts from and the tokenizer the tiny model is given
(`conversations`, `add_tokenizer`: python -m hsx.prepare renders them), generated
token rows and a token-frequency file for the loader tests, and hsx's intended
draft vocabulary computed from a frequency file independently of hsx.vocab
(`intended_draft_ids`)."""

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The hsx.prepare tests' fixture tokenizers (byte-level BPE trained at test time, the chat templates
# under tests/fixtures/chat-templates) and conversations (every layout, tool calls, thinking, non-ASCII).
sys.path.insert(0, str(REPO / "tests" / "python"))
import prepare_helpers  # noqa: E402
DOCS = REPO / "docs" / "trainers.md"
BIN = Path(os.environ.get("HSX_BIN_DIR", REPO / "build" / "bin")).resolve()
N, HIDDEN, VOCAB = 8, 128, 2048
AUX = [2, 4, 5]


def doc_block(name):
    """The bash block after <!-- run: NAME --> in docs/trainers.md."""
    text = DOCS.read_text()
    start = text.index(f"<!-- run: {name} -->")
    match = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    return match.group(1)


def run_steps(name, env_vars):
    """Runs docs/trainers.md's block `name` with bash -euo pipefail, this interpreter first on PATH."""
    env = {**os.environ, **{k: str(v) for k, v in env_vars.items()},
           "PATH": f"{Path(sys.executable).parent}:{BIN}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", doc_block(name)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"docs/trainers.md block {name!r} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def add_tokenizer(model_dir, template="kimi-k2-thinking"):
    """Gives the generated checkpoint what a real one ships beside its weights: a tokenizer and
    its chat template (Kimi-K2-Thinking's by default), so that python -m hsx.prepare --model
    MODEL renders conversations into ids the tiny model accepts (the tokenizer's ids < VOCAB)."""
    text = (prepare_helpers.TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    tokenizer = prepare_helpers.build_tokenizer(prepare_helpers.TEMPLATE_SPECIALS[template], text)
    assert len(tokenizer) <= VOCAB, f"the fixture tokenizer has {len(tokenizer)} ids, the model {VOCAB}"
    tokenizer.save_pretrained(str(model_dir))


def conversations(extra=6, seed=5):
    """Chat lines in every layout hsx.prepare reads: the hsx.prepare tests' cases (multi-turn, system
    prompt, tool calls and results, thinking, an empty assistant turn, non-ASCII, ShareGPT,
    prompt/response) and `extra` generated multi-turn chats, so that token counts differ."""
    rng = random.Random(seed)
    words = "the cat sat on a mat and then it ran to Paris for some tea with Oslo friends".split()

    def say(n):
        return " ".join(rng.choice(words) for _ in range(n))
    lines = [dict(case) for case in prepare_helpers.CASES.values()]
    for i in range(extra):
        turns = []
        for _ in range(rng.randrange(1, 4)):
            turns += [{"role": "user", "content": say(rng.randrange(3, 12))},
                      {"role": "assistant", "content": say(rng.randrange(3, 30))}]
        lines.append({"id": f"generated-{i}", "messages": turns})
    return lines


def rows(count, seed, max_len=50):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randrange(2, max_len)
        out.append({"input_ids": [rng.randrange(VOCAB) for _ in range(n)],
                    "loss_mask": [0] * (n // 3) + [1] * (n - n // 3)})
    return out


def write_jsonl(path, lines):
    Path(path).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def save_prepared_dataset(lines, path):
    """What `speculators prepare-data` saves (speculators.data_generation.preprocessing):
    input_ids, loss_mask and seq_len per row, in the given order, torch format."""
    from datasets import Dataset

    data = Dataset.from_dict({"input_ids": [r["input_ids"] for r in lines],
                              "loss_mask": [r["loss_mask"] for r in lines],
                              "seq_len": [len(r["input_ids"]) for r in lines]})
    data.set_format(type="torch")
    data.save_to_disk(str(path))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_token_frequencies(tokens_jsonl, out, vocab_size=VOCAB):
    """The token-frequency file (hsx-token-frequencies/1, scope "assistant": tokens whose loss_mask
    is 1) of a token JSONL of generated rows, as python -m hsx.prepare writes OUTPUT.freq.json; for
    the tests that start from `rows` rather than conversations."""
    counts, samples = Counter(), 0
    for line in read_jsonl(tokens_jsonl):
        samples += 1
        counts.update(t for t, m in zip(line["input_ids"], line["loss_mask"]) if m)
    Path(out).write_text(json.dumps({
        "format": "hsx-token-frequencies/1", "vocab_size": vocab_size, "scope": "assistant",
        "samples": samples, "tokens": sum(counts.values()),
        "counts": [[t, counts[t]] for t in sorted(counts)]}))
    return out


def intended_draft_ids(freq_path, draft_vocab_size):
    """hsx's intent for a draft vocabulary, from the frequency file alone: the most frequent
    ids, ties to the lower id, then the lowest unseen ids; ascending."""
    data = json.loads(Path(freq_path).read_text())
    ranked = [t for t, _ in sorted(data["counts"], key=lambda pair: (-pair[1], pair[0]))]
    ids, seen = ranked[:draft_vocab_size], set(ranked)
    ids += [t for t in range(data["vocab_size"]) if t not in seen][:draft_vocab_size - len(ids)]
    return sorted(ids)
