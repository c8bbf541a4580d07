"""Shared by the hsx.prepare tests: small tokenizers built at test time, the fixture conversations,
and a runner for `python -m hsx.prepare`.

The tokenizers are byte-level BPE models trained here (tokenizers library) on the fixture texts,
with no pre-tokenizer splitting, so merges cross the places where an assistant span begins or
ends; the chat templates' markers are special tokens. Saved with transformers'
PreTrainedTokenizerFast and the template set, they are model directories hsx.prepare loads.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat-templates"
KIMI_SPECIALS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                 "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|media_start|>", "<|media_content|>",
                 "<|media_pad|>", "<|media_end|>", "<think>", "</think>"]
CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
TEMPLATE_SPECIALS = {"kimi-k2-instruct": KIMI_SPECIALS, "kimi-k2-thinking": KIMI_SPECIALS,
                     "chatml-generation": CHATML_SPECIALS}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def _call(call_id, city):
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


# name -> one input line (as a dict): multi-turn, system prompt, tool calls and results, thinking, an empty
# assistant turn, non-ASCII text, and the ShareGPT and prompt/response layouts.
CASES = {
    "multi_turn": {"id": "multi", "messages": [
        {"role": "user", "content": "Hello there, how are you?"},
        {"role": "assistant", "content": "Fine, thanks. And you?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the tokenizer split? It had too many merges."}]},
    "system_prompt": {"id": 7, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."}]},
    "tool_calls": {"id": "tools", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Oslo and Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("functions.get_weather:0", "Oslo"),
                                                              _call("functions.get_weather:1", "Paris")]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "{\"temp\": -3}"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "{\"temp\": 11}"},
        {"role": "assistant", "content": "Oslo is at -3 C, Paris at 11 C."}]},
    "thinking": {"id": "think", "messages": [
        {"role": "user", "content": "What is 17 * 3?"},
        {"role": "assistant", "reasoning_content": "17 * 3 = 51.", "content": "51"},
        {"role": "user", "content": "And 51 + 9?"},
        {"role": "assistant", "reasoning_content": "51 + 9 = 60.", "content": "60"}]},
    "empty_assistant": {"messages": [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Now say hi."},
        {"role": "assistant", "content": "hi"}]},
    "non_ascii": {"id": "ünï", "messages": [
        {"role": "user", "content": "Wie spät ist es? 今何時ですか？ 🕰️"},
        {"role": "assistant", "content": "Es ist drei Uhr — 三時です。 ✅ naïve café"}]},
    "sharegpt": {"id": "sg", "conversations": [
        {"from": "system", "value": "Be kind."},
        {"from": "human", "value": "Hi!"},
        {"from": "gpt", "value": "Hello, friend."},
        {"from": "human", "value": "Bye."},
        {"from": "gpt", "value": "Goodbye!"}]},
    "plain": {"prompt": "Translate 'cat' to French.", "response": "chat", "system": "You translate."},
}


def corpus_texts():
    """Texts to train the fixture tokenizers on: every string in CASES, repeated."""
    texts = []

    def walk(value):
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
    walk(CASES)
    texts += ["assistant\nHello", "user\nHi", "system\nYou", "## Return of functions.get_weather:0\n"]
    # Newline-led texts, so that merges cross the newline that ends a ChatML header and begins a span.
    texts += [f"\n{text[:6]}" for text in texts] * 8
    return texts * 4


def build_tokenizer(specials, template_text, vocab_size=420):
    """A PreTrainedTokenizerFast (byte-level BPE, no pre-tokenizer split) with `template_text`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = template_text
    return fast


def model_dir(root: Path, template_name: str) -> Path:
    """A model directory (tokenizer files and chat template) for one fixture template."""
    out = root / template_name
    if not (out / "tokenizer_config.json").exists():
        text = (TEMPLATES / f"{template_name}.jinja").read_text(encoding="utf-8")
        build_tokenizer(TEMPLATE_SPECIALS[template_name], text).save_pretrained(str(out))
    return out


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
    return path


def read_jsonl(path: Path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


class Result:
    def __init__(self, returncode, stderr):
        self.returncode, self.stderr = returncode, stderr


def prepare(*args, expect_ok=True, timeout=120, in_process=True):
    """Runs hsx.prepare with `args` (no progress bar): in this process by default (its CLI's main, stderr
    captured), or as `python -m hsx.prepare`. Returns an object with returncode and stderr."""
    argv = [*map(str, args), "--no-progress"]
    if in_process:
        import contextlib
        import io

        from hsx.prepare.cli import main

        err, environ = io.StringIO(), dict(os.environ)
        with contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse's usage errors
                code = exit_.code
            finally:  # hsx.prepare sets HF_HUB_OFFLINE and friends: keep them out of other tests
                os.environ.clear()
                os.environ.update(environ)
        proc = Result(code, err.getvalue())
    else:
        cmd = [sys.executable, "-m", "hsx.prepare", *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    if expect_ok is True:
        assert proc.returncode == 0, f"hsx.prepare {argv} failed ({proc.returncode}):\n{proc.stderr}"
    elif expect_ok is False:
        assert proc.returncode != 0, f"hsx.prepare {argv} unexpectedly succeeded:\n{proc.stderr}"
    return proc
