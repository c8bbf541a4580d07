"""hsx.prepare never writes a turn without what the model wrote in it: in every --rows mode, on every
fixture template, the text decoded from each assistant message's masked tokens holds the message's
content, reasoning and tool calls, or the turn is in the report with its reason. Per-turn rows are,
token for token, transformers' rendering of the prompt with the generation prompt followed by the
completion; on the Kimi templates the completion is the text the model produced (hand-checked)."""

import json

import pytest
from prepare_helpers import CASES, TEMPLATE_SPECIALS, model_dir, prepare, read_jsonl, write_jsonl

from hsx.prepare import Masker, RowMaker, parse_line


def _call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# More conversations than CASES: reasoning on a tool-calling turn and on the answer after it (K2-Thinking
# renders the chain's reasoning only while it is open), reasoning before a tool call that ends the
# conversation, and tool-call ids that do not carry the function's name (Kimi renders ids, not names).
EXTRA = {
    "chain": {"id": "chain", "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
         "tool_calls": [_call("functions.get_weather:0", "get_weather", "{\"city\": \"Oslo\"}")]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "-3"},
        {"role": "assistant", "content": "It is -3 C.", "reasoning_content": "Tool says -3."}]},
    "open_chain": {"id": "open", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Call the tool for Paris.",
         "tool_calls": [_call("functions.get_weather:0", "get_weather", "{\"city\": \"Paris\"}")]}]},
    "opaque_call_id": {"id": "opaque", "messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None,
         "tool_calls": [_call("call_9f2", "get_weather", "{\"city\": \"Rome\"}")]},
        {"role": "tool", "tool_call_id": "call_9f2", "content": "20"},
        {"role": "assistant", "content": "20 C in Rome."}]},
}
ALL = {**CASES, **EXTRA}
MODES = ("auto", "packed", "per-turn")

KIMI_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
# What Kimi-K2-Thinking writes after each generation boundary, read off the template by hand: its
# open-chain branch, `<think>{{rc}}</think>{{content}}` then the tool calls and `<|im_end|>`.
KIMI_THINKING_COMPLETIONS = {
    ("thinking", 1): "<think>17 * 3 = 51.</think>51<|im_end|>",
    ("thinking", 3): "<think>51 + 9 = 60.</think>60<|im_end|>",
    ("chain", 1): ("<think>I should call the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>"
                   "functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Oslo\"}<|tool_call_end|>"
                   "<|tool_calls_section_end|><|im_end|>"),
    ("chain", 3): "<think>Tool says -3.</think>It is -3 C.<|im_end|>",
    ("open_chain", 1): ("<think>Call the tool for Paris.</think>Let me check.<|tool_calls_section_begin|>"
                        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}"
                        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"),
}
# ... and the prompts those turns follow: an earlier finished turn has lost its reasoning (the model
# sees `<think></think>51` at inference), an open chain keeps it.
KIMI_THINKING_PROMPTS = {
    ("thinking", 3): (KIMI_SYSTEM + "<|im_user|>user<|im_middle|>What is 17 * 3?<|im_end|>"
                      "<|im_assistant|>assistant<|im_middle|><think></think>51<|im_end|>"
                      "<|im_user|>user<|im_middle|>And 51 + 9?<|im_end|><|im_assistant|>assistant<|im_middle|>"),
    ("chain", 3): (KIMI_SYSTEM + "<|im_user|>user<|im_middle|>Weather in Oslo?<|im_end|>"
                   "<|im_assistant|>assistant<|im_middle|>" + KIMI_THINKING_COMPLETIONS[("chain", 1)]
                   + "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n-3<|im_end|>"
                   "<|im_assistant|>assistant<|im_middle|>"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare-turn-models")
    return {name: model_dir(root, name) for name in TEMPLATE_SPECIALS}


@pytest.fixture(scope="module")
def tokenizers(models):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(str(path)) for name, path in models.items()}


def _fields(message):
    """What an assistant message holds, read here without hsx: (name, text) pairs; a template may write
    a call's arguments (a JSON string) as they are or JSON-quoted, as ChatML templates do (`| tojson`)."""
    content = message.get("content")
    parts = [("content", content)] if isinstance(content, str) else [
        (f"content[{i}]", p["text"]) for i, p in enumerate(content or []) if "text" in p]
    if message.get("reasoning_content"):
        parts.append(("reasoning_content", message["reasoning_content"]))
    for i, call in enumerate(message.get("tool_calls") or []):
        arguments = call["function"]["arguments"]
        parts += [(f"tool_calls[{i}].name", call["function"]["name"]),
                  (f"tool_calls[{i}].arguments", (arguments, json.dumps(arguments)[1:-1]))]
    return [(name, text if isinstance(text, tuple) else (text.strip(),)) for name, text in parts
            if text and text[0].strip()]


def _runs(mask):
    """The [start, end) runs of 1s in a mask."""
    runs, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _masked_turns(row, conversation, tokenizer):
    """{message index: decoded masked text} of one written row."""
    decoded = [tokenizer.decode(row["input_ids"][a:b]) for a, b in _runs(row["loss_mask"])]
    sid = str(row["id"])
    if "#turn" in sid:
        assert len(decoded) == 1, sid
        return {int(sid.rsplit("#turn", 1)[1]): decoded[0]}
    assistants = [k for k, m in enumerate(conversation.messages) if m["role"] == "assistant"]
    assert len(decoded) == len(assistants), (sid, decoded)
    return dict(zip(assistants, decoded))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("template", sorted(TEMPLATE_SPECIALS))
def test_every_masked_turn_holds_what_the_message_holds_or_is_reported(models, tokenizers, tmp_path, template,
                                                                         mode):
    names = sorted(ALL)
    source = write_jsonl(tmp_path / "chats.jsonl", [ALL[n] for n in names])
    out = tmp_path / "out.jsonl"
    prepare("--model", models[template], "--input", source, "--output", out, "--rows", mode)
    conversations = {str(parse_line(json.dumps(ALL[n])).sample_id): (line, parse_line(json.dumps(ALL[n])))
                     for line, n in enumerate(names, 1)}
    covered = set()
    for row in read_jsonl(out):
        line, conversation = conversations[str(row["id"]).rsplit("#turn", 1)[0]]
        for k, text in _masked_turns(row, conversation, tokenizers[template]).items():
            message = conversation.messages[k]
            for name, forms in _fields(message):
                assert any(form in text for form in forms), (template, mode, row["id"], k, name, text)
            if message.get("reasoning_content"):
                assert "<think></think>" not in text, (template, mode, row["id"], k, text)
            covered.add((line, k))
    skipped = {(e["line"], str(e["id"])) for e in read_jsonl(f"{out}.report.jsonl") if e["action"] == "skipped"}
    for sid, (line, conversation) in conversations.items():
        for k, message in enumerate(conversation.messages):
            if message["role"] == "assistant" and (line, k) not in covered:
                assert (line, sid) in skipped or (line, f"{sid}#turn{k}") in skipped, (template, mode, sid, k)


def test_kimi_thinking_writes_what_the_model_produced_and_says_why(models, tmp_path):
    """On K2-Thinking a conversation with reasoning is never packed (its template empties finished
    turns' reasoning): auto writes per-turn rows and reports why; packed skips it, naming the field."""
    source = write_jsonl(tmp_path / "chats.jsonl", [CASES["multi_turn"], CASES["thinking"]])
    out = tmp_path / "auto.jsonl"
    proc = prepare("--model", models["kimi-k2-thinking"], "--input", source, "--output", out)
    assert [r["id"] for r in read_jsonl(out)] == ["multi", "think#turn1", "think#turn3"]
    (entry,) = read_jsonl(f"{out}.report.jsonl")
    assert (entry["action"], entry["reason"], entry["rows"]) == ("per-turn", "template drops reasoning_content", 2)
    assert "message 1 (assistant): reasoning_content not in the tokens masked for it" in entry["detail"]
    assert "'<think></think>51<|im_end|>'" in entry["detail"]
    assert "1 written per turn (template drops reasoning_content)" in proc.stderr
    out = tmp_path / "packed.jsonl"
    proc = prepare("--model", models["kimi-k2-thinking"], "--input", source, "--output", out, "--rows", "packed")
    assert [r["id"] for r in read_jsonl(out)] == ["multi"]
    assert "1 skipped (template drops reasoning_content)" in proc.stderr
    proc = prepare("--model", models["kimi-k2-thinking"], "--input", source, "--output", tmp_path / "s.jsonl",
                   "--rows", "packed", "--strict", expect_ok=False)
    assert f"{source}:2: message 1 (assistant): reasoning_content not in the tokens masked for it" in proc.stderr


def test_kimi_tool_call_ids_without_the_name_are_reported(models, tmp_path):
    """Kimi's templates render a call's id, never its name; the model writes ids
    `functions.NAME:INDEX`, so data with other ids would teach it calls without names."""
    source = write_jsonl(tmp_path / "chats.jsonl", [EXTRA["opaque_call_id"]])
    out = tmp_path / "out.jsonl"
    prepare("--model", models["kimi-k2-thinking"], "--input", source, "--output", out)
    assert [r["id"] for r in read_jsonl(out)] == ["opaque#turn3"]
    skips = [e for e in read_jsonl(f"{out}.report.jsonl") if e["action"] == "skipped"]
    assert [(e["id"], e["reason"]) for e in skips] == [("opaque#turn1", "template drops tool_calls")]
    assert "tool_calls[0].function.name" in skips[0]["detail"]


def _expected_completion(tokenizer, template, name, conversation, k):
    """The hand-checked text for K2-Thinking's turns with reasoning; elsewhere what transformers'
    rendering adds for message k after its generation prompt (those templates drop nothing there)."""
    if (template == "kimi-k2-thinking" and (name, k) in KIMI_THINKING_COMPLETIONS):
        return KIMI_THINKING_COMPLETIONS[(name, k)]
    assert not (template == "kimi-k2-thinking" and conversation.messages[k].get("reasoning_content")), (name, k)
    messages, tools = conversation.messages, conversation.tools
    head = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages[:k + 1], tools=tools, tokenize=False)
    assert full.startswith(head)
    return full[len(head):]


@pytest.mark.parametrize("template", sorted(TEMPLATE_SPECIALS))
def test_per_turn_rows_are_the_generation_prompt_then_the_completion(tokenizers, template):
    tokenizer = tokenizers[template]
    maker = RowMaker(Masker(tokenizer), "per-turn")
    written, seen = 0, set()
    for name, case in sorted(ALL.items()):
        conversation = parse_line(json.dumps(case))
        for row in maker(conversation).rows:
            k = int(str(row.sample_id).rsplit("#turn", 1)[1])
            prompt = tokenizer.apply_chat_template(conversation.messages[:k], tools=conversation.tools,
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
            completion = tokenizer.encode(_expected_completion(tokenizer, template, name, conversation, k),
                                          add_special_tokens=False)
            assert row.input_ids == prompt + completion, (name, k)
            assert row.loss_mask == [0] * len(prompt) + [1] * len(completion), (name, k)
            if template == "kimi-k2-thinking" and (name, k) in KIMI_THINKING_PROMPTS:
                assert tokenizer.decode(prompt) == KIMI_THINKING_PROMPTS[(name, k)]
            written += 1
            seen.add((name, k))
    assert written >= 10
    if template == "kimi-k2-thinking":  # every hand-checked turn is written, none skipped
        assert set(KIMI_THINKING_COMPLETIONS) <= seen, set(KIMI_THINKING_COMPLETIONS) - seen


def test_media_parts_are_skipped_or_an_error_under_strict(models, tmp_path):
    image = {"id": "img", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "A cat."}]}
    untyped = {"id": "img2", "messages": [{"role": "user", "content": [{"image": "cat.png"}]},
                                          {"role": "assistant", "content": "A cat."}]}
    source = write_jsonl(tmp_path / "chats.jsonl", [CASES["multi_turn"], image, untyped])
    out = tmp_path / "out.jsonl"
    proc = prepare("--model", models["kimi-k2-thinking"], "--input", source, "--output", out)
    assert [r["id"] for r in read_jsonl(out)] == ["multi"]
    assert [(e["line"], e["id"], e["reason"]) for e in read_jsonl(f"{out}.report.jsonl")] == [
        (2, "img", "media content"), (3, "img2", "media content")]
    assert "message 0 (role user): content[1] is a media part (image_url)" in read_jsonl(f"{out}.report.jsonl")[0]["detail"]
    assert "2 skipped (media content)" in proc.stderr
    proc = prepare("--model", models["kimi-k2-thinking"], "--input", source, "--output", tmp_path / "s.jsonl",
                   "--strict", expect_ok=False)
    assert f"{source}:2: message 0 (role user): content[1] is a media part (image_url)" in proc.stderr
