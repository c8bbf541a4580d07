"""hsx.prepare's masks: equal to transformers' {% generation %} masks on a tagged template, and on
the real Kimi K2 templates exactly the tokens each assistant message adds (never a header, a user
or tool turn); conversations a template renders differently once later turns follow are skipped
and reported, never masked by guesswork."""

import json

import pytest
from prepare_helpers import CASES, TEMPLATE_SPECIALS, model_dir, prepare, read_jsonl, write_jsonl

from hsx.prepare import Masker, NotPrefixStable, parse_line
from hsx.prepare.masking import SpanSplitsToken, overlap_mask


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare-models")
    return {name: model_dir(root, name) for name in TEMPLATE_SPECIALS}


@pytest.fixture(scope="module")
def tokenizers(models):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(str(path)) for name, path in models.items()}


def _transformers_mask(tokenizer, conversation):
    out = tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_mask_equals_transformers_generation_mask(tokenizers, case):
    tokenizer = tokenizers["chatml-generation"]
    conversation = parse_line(json.dumps(CASES[case]))
    ids, mask = Masker(tokenizer)(conversation)
    expected_ids, expected_mask = _transformers_mask(tokenizer, conversation)
    assert ids == expected_ids
    assert mask == expected_mask
    assert 0 < sum(mask) < len(mask)


def test_cli_output_equals_transformers_for_every_fixture(models, tokenizers, tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", CASES.values())
    prepare("--model", models["chatml-generation"], "--input", source, "--output", tmp_path / "out.jsonl",
            in_process=False)
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert len(rows) == len(CASES)
    for row, case in zip(rows, CASES.values()):
        ids, mask = _transformers_mask(tokenizers["chatml-generation"], parse_line(json.dumps(case)))
        assert (row["input_ids"], row["loss_mask"]) == (ids, mask)


def test_fixture_tokenizer_has_tokens_across_span_boundaries(tokenizers):
    """The equality above is only a test of the overlap rule if some token straddles a boundary."""
    tokenizer, straddling = tokenizers["chatml-generation"], 0
    for case in CASES.values():
        conversation = parse_line(json.dumps(case))
        text, spans = Masker(tokenizer).spans(conversation.messages, conversation.tools)
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        straddling += sum(1 for a, b in offsets for s in spans for x in s if a < x < b)
    assert straddling >= 2


def _loop_mask(offsets, spans):
    """transformers' loop, as written in apply_chat_template (5.24)."""
    mask, index = [0] * len(offsets), 0
    for token, (start, end) in enumerate(offsets):
        while index < len(spans) and start >= spans[index][1]:
            index += 1
        if index == len(spans):
            break
        if end > spans[index][0]:
            mask[token] = 1
    return mask


def test_overlap_mask_equals_the_transformers_loop_on_random_offsets():
    import random

    rng = random.Random(1)
    for _ in range(2000):
        cuts = sorted(rng.sample(range(1, 60), rng.randint(0, 8)))
        spans = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
        offsets, pos = [], 0
        for _ in range(rng.randint(0, 30)):
            start = max(0, pos - rng.choice((0, 0, 0, 2)))  # sometimes overlapping, sometimes zero-width
            end = start + rng.choice((0, 1, 2, 3, 5))
            offsets.append((start, end))
            pos = end
        assert overlap_mask(offsets, spans) == _loop_mask(offsets, spans), (offsets, spans)


def _assistant_turn_mask(tokenizer, ids):
    """Independent of hsx: 1 strictly after each <|im_assistant|>...<|im_middle|> header up to and
    including the turn's <|im_end|>; 0 everywhere else."""
    opener, middle, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_assistant|>", "<|im_middle|>",
                                                                        "<|im_end|>"))
    mask, state = [0] * len(ids), "out"
    for i, token in enumerate(ids):
        if state == "out" and token == opener:
            state = "header"
        elif state == "header" and token == middle:
            state = "body"
        elif state == "body":
            mask[i] = 1
            if token == end:
                state = "out"
    return mask


@pytest.mark.parametrize("template", ["kimi-k2-instruct", "kimi-k2-thinking"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kimi_mask_is_exactly_the_assistant_turns(tokenizers, template, case):
    tokenizer = tokenizers[template]
    conversation = parse_line(json.dumps(CASES[case]))
    ids, mask = Masker(tokenizer)(conversation)
    assert ids == tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=True,
                                                return_dict=False)
    expected = _assistant_turn_mask(tokenizer, ids)
    assert sum(expected) > 0
    assert mask == expected, [tokenizer.convert_ids_to_tokens(t) for t, m in zip(ids, mask) if m]


def test_kimi_thinking_tool_chain_with_reasoning_is_written_per_turn_or_reported_never_guessed(models, tmp_path):
    """K2-Thinking keeps a tool-calling turn's reasoning only while no final answer follows, so the
    prefix rule has no single rendering of that turn. --rows auto writes it one row per turn and lists
    why; --rows packed skips it and lists it (an error under --strict), naming the message."""
    chain = {"id": "chain", "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "-3"},
        {"role": "assistant", "content": "It is -3 C."}]}
    source = write_jsonl(tmp_path / "chats.jsonl", [CASES["multi_turn"], chain])
    proc = prepare("--model", models["kimi-k2-thinking"], "--input", source, "--output", tmp_path / "auto.jsonl")
    assert [r["id"] for r in read_jsonl(tmp_path / "auto.jsonl")] == ["multi", "chain#turn1", "chain#turn3"]
    (entry,) = read_jsonl(tmp_path / "auto.jsonl.report.jsonl")
    assert (entry["line"], entry["action"], entry["reason"], entry["rows"]) == (2, "per-turn",
                                                                                "template not prefix-stable", 2)
    assert "1 written per turn (template not prefix-stable)" in proc.stderr
    proc = prepare("--model", models["kimi-k2-thinking"], "--input", source, "--output", tmp_path / "out.jsonl",
                   "--rows", "packed")
    assert [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")] == ["multi"]
    (entry,) = read_jsonl(tmp_path / "out.jsonl.report.jsonl")
    assert entry["line"] == 2 and entry["action"] == "skipped" and entry["reason"] == "template not prefix-stable"
    assert "message 1 (assistant)" in entry["detail"]
    assert "1 skipped (template not prefix-stable)" in proc.stderr
    proc = prepare("--model", models["kimi-k2-thinking"], "--input", source, "--output", tmp_path / "strict.jsonl",
                   "--rows", "packed", "--strict", expect_ok=False)
    assert f"{source}:2: message 1 (assistant)" in proc.stderr


class _Slow:
    """A tokenizer without character offsets (as a tiktoken-based remote-code one): hsx.prepare must
    find each span boundary between two tokens by encoding the text before it."""

    is_fast = False

    def __init__(self, fast):
        self.fast = fast

    def apply_chat_template(self, *args, **kwargs):
        return self.fast.apply_chat_template(*args, **kwargs)

    def encode(self, text, add_special_tokens=False):
        return self.fast.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids):
        return self.fast.decode(ids)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tokenizer_without_offsets_gives_the_same_masks(tokenizers, case):
    conversation = parse_line(json.dumps(CASES[case]))
    fast = tokenizers["kimi-k2-thinking"]
    assert Masker(_Slow(fast))(conversation) == Masker(fast)(conversation)


def test_tokenizer_without_offsets_refuses_a_boundary_inside_a_token(tokenizers):
    conversation = parse_line(json.dumps(CASES["multi_turn"]))  # its ChatML rendering has a straddling token
    with pytest.raises(SpanSplitsToken, match="falls inside a token"):
        Masker(_Slow(tokenizers["chatml-generation"]))(conversation)


def test_assistant_first_conversation_is_not_prefix_stable(tokenizers):
    conversation = parse_line(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}))
    with pytest.raises(NotPrefixStable, match="message 0"):
        Masker(tokenizers["kimi-k2-instruct"])(conversation)
