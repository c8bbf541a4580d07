"""python -m hsx.prepare as a tool: bad input is an error naming FILE:LINE with nothing half-written
and a rerun that continues; --max-tokens never loses a sample silently; the frequency file's
contract; sample ids; --shard partitions lines exactly; a run killed with SIGKILL and rerun gives
byte-identical files."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from prepare_helpers import CASES, model_dir, prepare, read_jsonl, write_jsonl


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A template that renders every field of every fixture case (K2-Instruct drops reasoning and tool
    calls, so some cases would give other rows than one a line: test_prepare_turns.py covers those)."""
    return model_dir(tmp_path_factory.mktemp("prepare-cli-model"), "chatml-generation")


@pytest.fixture(scope="module")
def raising_model(tmp_path_factory):
    """A model whose template raises on a user message containing "boom"."""
    out = model_dir(tmp_path_factory.mktemp("prepare-raising-model"), "kimi-k2-instruct")
    template = ("{% for m in messages %}{% if 'boom' in m['content'] %}{{ raise_exception('no boom here') }}"
                "{% endif %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    (out / "chat_template.jinja").write_text(template)
    return out


def _outputs(out):
    names = [out, f"{out}.report.jsonl", f"{out}.freq.json"]
    return {os.path.basename(str(n)): open(n, "rb").read() for n in names}


GOOD = CASES["multi_turn"]
# (what is wrong, the bad line, the message hsx.prepare must give after FILE:LINE:)
BAD = [
    ("malformed JSON", '{"messages": [', "not valid JSON"),
    ("not an object", "[1, 2]", "not a JSON object (a list)"),
    ("unknown role", {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
     'message 0: unknown role "narrator"'),
    ("unknown ShareGPT speaker", {"conversations": [{"from": "bot", "value": "x"}]},
     'message 0: unknown role "bot" (ShareGPT "from" must be one of assistant, function, gpt, human'),
    ("missing content", {"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]},
     'message 0 (role user): no "content" field'),
    ("missing value", {"conversations": [{"from": "human"}]}, 'message 0 (from human): no "value" field'),
    ("no layout", {"text": "hello"}, 'no "conversations" (ShareGPT), "messages" (OpenAI)'),
    ("bad id", {"id": [1], "prompt": "a", "response": "b"}, '"id" must be a string or an integer'),
]


@pytest.mark.parametrize("what,line,message", BAD, ids=[b[0] for b in BAD])
def test_bad_line_is_an_error_naming_file_and_line(model, tmp_path, what, line, message):
    source = write_jsonl(tmp_path / "chats.jsonl", [GOOD, GOOD, line, GOOD])
    out = tmp_path / "out.jsonl"
    proc = prepare("--model", model, "--input", source, "--output", out, expect_ok=False)
    assert proc.returncode == 1
    assert f"hsx.prepare: error: {source}:3: {message}" in proc.stderr, proc.stderr
    assert not out.exists() and not (tmp_path / "out.jsonl.freq.json").exists()


def test_template_that_raises_is_an_error_naming_file_and_line(raising_model, tmp_path):
    bad = {"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "y"}]}
    source = write_jsonl(tmp_path / "chats.jsonl", [GOOD, bad])
    proc = prepare("--model", raising_model, "--input", source, "--output", tmp_path / "o.jsonl", expect_ok=False)
    assert f"{source}:2: the chat template raised: TemplateError: no boom here" in proc.stderr, proc.stderr


def test_rerun_after_fixing_a_bad_line_continues_and_equals_a_clean_run(model, tmp_path):
    rows = [GOOD, CASES["thinking"], GOOD, CASES["non_ascii"]]
    source = write_jsonl(tmp_path / "chats.jsonl", rows[:2] + ['{"messages": oops'] + rows[3:])
    out = tmp_path / "out.jsonl"
    prepare("--model", model, "--input", source, "--output", out, "--checkpoint-every", "1", expect_ok=False)
    assert not out.exists()
    state = json.loads((tmp_path / "out.jsonl.prepare-state.json").read_text())
    assert state["input_line"] == 2 and state["stats"]["written"] == 2
    write_jsonl(source, rows)  # the bad line fixed; the first two lines unchanged
    prepare("--model", model, "--input", source, "--output", out, "--checkpoint-every", "1")
    clean = write_jsonl(tmp_path / "clean.jsonl", rows)
    prepare("--model", model, "--input", clean, "--output", tmp_path / "clean-out.jsonl", "--checkpoint-every", "1")
    assert out.read_bytes() == (tmp_path / "clean-out.jsonl").read_bytes()
    assert not (tmp_path / "out.jsonl.prepare-state.json").exists() and not (tmp_path / "out.jsonl.partial").exists()


def test_no_assistant_turn_is_skipped_and_counted_or_an_error_under_strict(model, tmp_path):
    lonely = {"id": "lonely", "messages": [{"role": "user", "content": "anyone?"}]}
    source = write_jsonl(tmp_path / "chats.jsonl", [GOOD, lonely, GOOD])
    proc = prepare("--model", model, "--input", source, "--output", tmp_path / "out.jsonl")
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 2
    assert read_jsonl(tmp_path / "out.jsonl.report.jsonl") == [
        {"line": 2, "id": "lonely", "action": "skipped", "reason": "no assistant turn",
         "detail": "the conversation has no assistant message"}]
    assert "wrote 2 samples" in proc.stderr and "1 skipped (no assistant turn)" in proc.stderr
    proc = prepare("--model", model, "--input", source, "--output", tmp_path / "s.jsonl", "--strict", expect_ok=False)
    assert f"{source}:2: the conversation has no assistant message (--strict)" in proc.stderr


def test_existing_output_and_changed_settings_are_refused(model, tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", [GOOD, '{"bad', GOOD])
    out = tmp_path / "out.jsonl"
    prepare("--model", model, "--input", source, "--output", out, expect_ok=False)
    proc = prepare("--model", model, "--input", source, "--output", out, "--max-tokens", "9", expect_ok=False)
    assert "an interrupted run with other settings (max_tokens) is pending" in proc.stderr
    write_jsonl(source, [CASES["plain"], '{"bad', GOOD])  # the line already read has changed
    proc = prepare("--model", model, "--input", source, "--output", out, expect_ok=False)
    assert "are not those the interrupted run read" in proc.stderr, proc.stderr
    done = tmp_path / "done.jsonl"
    done.write_text("")
    proc = prepare("--model", model, "--input", source, "--output", done, expect_ok=False)
    assert f"{done}: exists" in proc.stderr


def _lengths(model, tmp_path):
    source = write_jsonl(tmp_path / "all.jsonl", CASES.values())
    prepare("--model", model, "--input", source, "--output", tmp_path / "all-out.jsonl")
    return source, [len(r["input_ids"]) for r in read_jsonl(tmp_path / "all-out.jsonl")]


def test_max_tokens_truncates_drops_or_stops_and_lists_every_sample(model, tmp_path):
    source, lengths = _lengths(model, tmp_path)
    limit = sorted(lengths)[len(lengths) // 2]
    over = [i + 1 for i, n in enumerate(lengths) if n > limit]
    assert over
    out = tmp_path / "trunc.jsonl"
    proc = prepare("--model", model, "--input", source, "--output", out, "--max-tokens", limit)
    rows, report = read_jsonl(out), read_jsonl(f"{out}.report.jsonl")
    assert all(len(r["input_ids"]) <= limit for r in rows)
    assert sorted(e["line"] for e in report) == over
    truncated = [e for e in report if e["action"] == "truncated"]
    assert all(e["tokens"] == lengths[e["line"] - 1] and e["kept"] == limit for e in truncated)
    assert len(rows) == len(lengths) - (len(report) - len(truncated))
    assert f"{len(truncated)} truncated, {len(report) - len(truncated)} dropped" in proc.stderr
    out = tmp_path / "drop.jsonl"
    proc = prepare("--model", model, "--input", source, "--output", out, "--max-tokens", limit, "--on-long", "drop")
    assert len(read_jsonl(out)) == len(lengths) - len(over)
    assert [(e["line"], e["action"]) for e in read_jsonl(f"{out}.report.jsonl")] == [(n, "dropped") for n in over]
    assert f"0 truncated, {len(over)} dropped" in proc.stderr
    proc = prepare("--model", model, "--input", source, "--output", tmp_path / "e.jsonl", "--max-tokens", limit,
                   "--on-long", "error", expect_ok=False)
    assert f"{source}:{over[0]}: {lengths[over[0] - 1]} tokens, over --max-tokens {limit}" in proc.stderr


@pytest.mark.parametrize("scope", ["assistant", "all"])
def test_frequency_file_contract(model, tmp_path, scope):
    from transformers import AutoTokenizer

    source = write_jsonl(tmp_path / "chats.jsonl", CASES.values())
    out = tmp_path / "out.jsonl"
    prepare("--model", model, "--input", source, "--output", out, *(["--count-all-tokens"] if scope == "all" else []))
    freq = json.loads((tmp_path / "out.jsonl.freq.json").read_text())
    assert list(freq) == ["format", "vocab_size", "scope", "samples", "tokens", "counts"]
    assert freq["format"] == "hsx-token-frequencies/1" and freq["scope"] == scope
    assert freq["vocab_size"] == len(AutoTokenizer.from_pretrained(str(model)))
    expected = {}
    rows = read_jsonl(out)
    for row in rows:
        for token, bit in zip(row["input_ids"], row["loss_mask"]):
            if bit or scope == "all":
                expected[token] = expected.get(token, 0) + 1
    assert freq["counts"] == sorted([t, n] for t, n in expected.items())
    assert all(n > 0 for _, n in freq["counts"])
    assert freq["samples"] == len(rows) and freq["tokens"] == sum(expected.values())


@pytest.mark.parametrize("config,expected", [
    ({"vocab_size": 2048}, 2048),                     # a checkpoint's flat config (padded embeddings)
    ({"text_config": {"vocab_size": 4096}}, 4096),    # a nested one (K2.5)
    ({"vocab_size": 100}, "vocab_size 100 is smaller than the tokenizer's"),
    ({"vocab_size": "big"}, "no positive integer vocab_size"),
    ({"hidden_size": 8}, "no positive integer vocab_size"),
    ({"vocab_size": 32, "text_config": {"vocab_size": 4096}}, 4096),  # the language model's, as the server reads it
    ({"vocab_size": 4096, "text_config": {"hidden_size": 8}}, "no positive integer text_config.vocab_size"),
], ids=["flat", "nested", "smaller", "not-int", "missing", "nested-wins", "nested-missing"])
def test_frequency_vocab_size_is_the_models_not_the_tokenizers(model, tmp_path, config, expected):
    """The trainers check a mapping against the model's vocabulary (config.json), which may be larger
    than the tokenizer: the frequency file says the model's size, and a config that cannot be right is
    an error naming config.json, with nothing written."""
    import shutil

    directory = tmp_path / "model"
    shutil.copytree(model, directory)
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    source = write_jsonl(tmp_path / "chats.jsonl", [CASES["multi_turn"]])
    out = tmp_path / "out.jsonl"
    if isinstance(expected, int):
        prepare("--model", directory, "--input", source, "--output", out)
        assert json.loads((tmp_path / "out.jsonl.freq.json").read_text())["vocab_size"] == expected
    else:
        proc = prepare("--model", directory, "--input", source, "--output", out, expect_ok=False)
        assert f"{directory / 'config.json'}: " in proc.stderr and expected in proc.stderr, proc.stderr
        assert list(tmp_path.glob("out.jsonl*")) == []


def test_sample_ids_come_from_the_line_or_its_canonical_json(model, tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", [CASES["system_prompt"], CASES["empty_assistant"],
                                                    CASES["non_ascii"]])
    prepare("--model", model, "--input", source, "--output", tmp_path / "out.jsonl")
    ids = [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")]
    canonical = json.dumps(CASES["empty_assistant"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert ids == [7, "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()[:16], "ünï"]


def test_shards_partition_the_lines_exactly(model, tmp_path):
    rows = [dict(case, id=f"{name}-{i}") for i in range(3) for name, case in CASES.items()]
    lines = [json.dumps(r) for r in rows]
    lines[4] = "   "  # a blank line belongs to no sample but keeps its number
    source = write_jsonl(tmp_path / "chats.jsonl", lines)
    prepare("--model", model, "--input", source, "--output", tmp_path / "all.jsonl")
    whole = {r["id"]: r for r in read_jsonl(tmp_path / "all.jsonl")}
    seen = []
    for index in range(3):
        prepare("--model", model, "--input", source, "--output", tmp_path / f"s{index}.jsonl", "--shard", f"{index}/3")
        shard = read_jsonl(tmp_path / f"s{index}.jsonl")
        assert [r["id"] for r in shard] == [rows[n]["id"] for n in range(index, len(rows), 3) if n != 4]
        assert all(whole[r["id"]] == r for r in shard)
        seen += [r["id"] for r in shard]
    assert sorted(seen) == sorted(whole) and len(seen) == len(set(seen)) == len(rows) - 1
    proc = prepare("--model", model, "--input", source, "--output", tmp_path / "x.jsonl", "--shard", "3/3",
                   expect_ok=False)
    assert proc.returncode == 2 and "--shard '3/3': needs N >= 1 and 0 <= I < N" in proc.stderr


def _kill_after(cmd, state, line):
    """Starts cmd, SIGKILLs it once its journal has passed `line` and its output has grown past
    what the journal records (lines the rerun must cut away); True if it was killed."""
    child = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    partial = f"{cmd[cmd.index('--output') + 1]}.partial"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        try:
            journal = json.loads(state.read_text() or "{}") if state.exists() else {}
        except ValueError:  # read while being replaced
            journal = {}
        if (journal.get("input_line", 0) >= line and os.path.exists(partial)
                and os.path.getsize(partial) > journal["output_bytes"]):
            child.send_signal(signal.SIGKILL)
            child.wait()
            return child.returncode == -signal.SIGKILL
        time.sleep(0.005)
    child.wait()
    return False


def test_sigkill_then_rerun_gives_byte_identical_files(model, tmp_path):
    rows = [dict(case, id=f"{name}-{i}") for i in range(300) for name, case in CASES.items()]
    source = write_jsonl(tmp_path / "chats.jsonl", rows)
    reference = tmp_path / "reference.jsonl"
    args = ["--input", source, "--max-tokens", "60", "--checkpoint-every", "200", "--no-progress"]
    prepare("--model", model, *args[:-1], "--output", reference)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "hsx.prepare", "--model", str(model), *map(str, args), "--output", str(out)]
    state, torn = tmp_path / "out.jsonl.prepare-state.json", []
    for line in (200, 1000):  # killed twice: early, then during the resumed run
        assert _kill_after(cmd, state, line), "the run ended before it could be killed"
        journal = json.loads(state.read_text())
        torn.append(os.path.getsize(f"{out}.partial") - journal["output_bytes"])
    assert not out.exists()
    assert max(torn) > 0, f"no kill left unjournaled bytes to cut ({torn}): the test would not test resume"
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    assert list(_outputs(out).values()) == list(_outputs(reference).values())
    assert read_jsonl(f"{out}.report.jsonl"), "the run should have truncated some samples"
    assert not state.exists() and not os.path.exists(f"{out}.partial")


def test_custom_tokenizer_code_runs_only_with_trust_remote_code(model, tmp_path):
    custom = tmp_path / "custom"
    custom.mkdir()
    for f in model.iterdir():
        (custom / f.name).write_bytes(f.read_bytes())
    config = json.loads((custom / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_toy.ToyTokenizer"]}
    (custom / "tokenizer_config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (custom / "tokenization_toy.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class ToyTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    source = write_jsonl(tmp_path / "chats.jsonl", [GOOD])
    proc = prepare("--model", custom, "--input", source, "--output", tmp_path / "o.jsonl", expect_ok=False)
    assert (f"{custom}: the tokenizer is custom code (tokenization_toy.py); pass --trust-remote-code"
            in proc.stderr), proc.stderr
    assert not marker.exists()
    prepare("--model", custom, "--input", source, "--output", tmp_path / "o.jsonl", "--trust-remote-code")
    assert marker.exists()
    prepare("--model", model, "--input", source, "--output", tmp_path / "plain.jsonl")
    assert (tmp_path / "o.jsonl").read_bytes() == (tmp_path / "plain.jsonl").read_bytes()


def test_help_explains_every_flag():
    from hsx.prepare.cli import parser

    text = parser().format_help()
    flags = [a.option_strings[-1] for a in parser()._actions if a.option_strings]
    assert len(flags) == 18
    for action in parser()._actions:
        assert action.help and len(action.help) > 15, action.option_strings
    assert all(flag in text for flag in flags)
