"""Regeneration with vLLM or SGLang: `python -m hsx.prepare requests` writes each engine's batch requests
(prompt ids = the template's generation prompt, ids ID#turnK, sampling where the engine reads it);
stand-in engines answer them in each engine's documented output format; `... responses` turns the
answers into rows holding exactly the prompt ids and the generated ids, accounts for every request
(truncated, failed, unanswered) and refuses lines that are not the engine's format with FILE:LINE;
a chat completion without ids is rendered through the template; the whole chain ends in hsx-dump and
hsx-verify on the tiny model. The request and answer lines are also checked with the engines' own
classes where those import (HSX_ENGINE_PYTHONPATH)."""

import copy
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

import engine_standins as standin
from hsx.prepare.chats import parse_line
from prepare_helpers import CASES, model_dir, prepare, read_jsonl, write_jsonl

TEMPLATES = ("kimi-k2-thinking", "kimi-k2-instruct", "chatml-generation")
# Beside the fixture cases: one waiting for its answer (regenerated as turn 1), one with no turn at all.
EXTRA = [{"id": "open", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]},
         {"id": "none", "messages": [{"role": "system", "content": "Nothing to answer."}]}]
LINES = [*CASES.values(), *EXTRA]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("regenerate-models")
    return {name: model_dir(root, name) for name in TEMPLATES}


@pytest.fixture(scope="module")
def tokenizers(models):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(str(path)) for name, path in models.items()}


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("regenerate-chats") / "chats.jsonl", LINES)


def requests(model, chats, out, engine, *more, expect_ok=True):
    return prepare("requests", "--model", model, "--input", chats, "--output", out, "--engine", engine,
                   "--max-new-tokens", 64, *more, expect_ok=expect_ok)


def responses(model, reqs, outputs, out, engine, *more, expect_ok=True):
    return prepare("responses", "--engine", engine, "--requests", reqs, "--input", outputs, "--output", out,
                   "--model", model, *more, expect_ok=expect_ok)


def _conversations():
    """sample id -> the checked conversation, as hsx.prepare reads each line."""
    return {c.sample_id: c for c in (parse_line(json.dumps(line)) for line in LINES)}


def _expected_turns(conversation, last=False):
    roles = [m["role"] for m in conversation.messages]
    ks = [k for k, role in enumerate(roles) if role == "assistant"]
    if roles[-1] in ("user", "tool"):
        ks.append(len(roles))
    return ks[-1:] if last else ks


def _prompt_ids(line, engine):
    return line["body"]["prompt"] if engine == "vllm" else line["input_ids"]


def _custom_id(line, engine):
    return line["custom_id"] if engine == "vllm" else line["rid"]


# -- requests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_request_prompts_are_the_templates_generation_prompt(models, tokenizers, chats, tmp_path, template, engine):
    out = tmp_path / "requests.jsonl"
    requests(models[template], chats, out, engine)
    conversations, tokenizer = _conversations(), tokenizers[template]
    wanted = [f"{sid}#turn{k}" for sid, c in conversations.items() for k in _expected_turns(c)]
    lines = read_jsonl(out)
    report = read_jsonl(f"{out}.report.jsonl")
    assert [r["id"] for r in report] == ["none"] and report[0]["reason"] == "no turn to regenerate"
    assert [_custom_id(line, engine) for line in lines] == wanted
    for line in lines:
        sid, k = _custom_id(line, engine).rsplit("#turn", 1)
        conversation = conversations[int(sid) if sid.isdigit() else sid]
        expected = tokenizer.apply_chat_template(conversation.messages[:int(k)], tools=conversation.tools,
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
        assert _prompt_ids(line, engine) == list(expected), _custom_id(line, engine)
    assert not (tmp_path / "requests.jsonl.freq.json").exists()  # requests carry no row frequencies


def test_turns_last_keeps_the_last_turn_of_each_conversation(models, chats, tmp_path):
    out = tmp_path / "requests.jsonl"
    requests(models["chatml-generation"], chats, out, "vllm", "--turns", "last")
    wanted = [f"{sid}#turn{_expected_turns(c, last=True)[0]}" for sid, c in _conversations().items() if sid != "none"]
    assert [line["custom_id"] for line in read_jsonl(out)] == wanted


SAMPLING = ["--max-new-tokens", 77, "--temperature", 0.7, "--top-p", 0.9, "--top-k", 20, "--seed", 5,
            "--stop", "STOP", "--stop", "END", "--stop-token-id", 3]


def test_sampling_flags_land_where_each_engine_reads_them(models, chats, tmp_path):
    model = models["chatml-generation"]
    prepare("requests", "--model", model, "--input", chats, "--output", tmp_path / "v.jsonl", "--engine", "vllm",
            *SAMPLING, "--served-model-name", "target")
    prepare("requests", "--model", model, "--input", chats, "--output", tmp_path / "s.jsonl", "--engine", "sglang",
            *SAMPLING)
    line = read_jsonl(tmp_path / "v.jsonl")[0]
    assert line["method"] == "POST" and line["url"] == "/v1/completions"
    body = line["body"]
    assert {k: v for k, v in body.items() if k != "prompt"} == {
        "model": "target", "max_tokens": 77, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 5,
        "stop": ["STOP", "END"], "stop_token_ids": [3], "return_token_ids": True}
    line = read_jsonl(tmp_path / "s.jsonl")[0]
    assert sorted(line) == ["input_ids", "rid", "sampling_params"]
    assert line["sampling_params"] == {"max_new_tokens": 77, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                                       "sampling_seed": 5, "stop": ["STOP", "END"], "stop_token_ids": [3]}
    # The defaults: greedy, everything else left to the engine.
    requests(model, chats, tmp_path / "d.jsonl", "sglang")
    assert read_jsonl(tmp_path / "d.jsonl")[0]["sampling_params"] == {"max_new_tokens": 64, "temperature": 0.0}
    requests(model, chats, tmp_path / "c.jsonl", "vllm", "--endpoint", "chat-completions", "--template-arg", "x=1")
    body = read_jsonl(tmp_path / "c.jsonl")[0]["body"]
    assert body["messages"] == CASES["multi_turn"]["messages"][:1] and body["chat_template_kwargs"] == {"x": 1}
    assert body["return_token_ids"] is True and body["max_tokens"] == 64 and "prompt" not in body


def test_max_new_tokens_is_required_and_sglang_has_no_endpoint(models, chats, tmp_path):
    model = models["chatml-generation"]
    proc = prepare("requests", "--model", model, "--input", chats, "--output", tmp_path / "r.jsonl", "--engine",
                   "vllm", expect_ok=False)
    assert proc.returncode == 2 and "--max-new-tokens" in proc.stderr
    proc = requests(model, chats, tmp_path / "r.jsonl", "sglang", "--endpoint", "chat-completions", expect_ok=False)
    assert "--endpoint and --served-model-name are for --engine vllm" in proc.stderr


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_bad_chat_line_is_an_error_naming_file_and_line(models, tmp_path, engine):
    chats = write_jsonl(tmp_path / "chats.jsonl", [CASES["multi_turn"], '{"messages": ['])
    proc = requests(models["chatml-generation"], chats, tmp_path / "r.jsonl", engine, expect_ok=False)
    assert f"{chats}:2: not valid JSON" in proc.stderr and not (tmp_path / "r.jsonl").exists()


# -- responses from a stand-in engine ----------------------------------------------------------------


def _round_trip(models, tokenizers, chats, tmp_path, engine, template, *more, length=()):
    reqs, outputs, out = tmp_path / "requests.jsonl", tmp_path / "outputs.jsonl", tmp_path / "rows.jsonl"
    requests(models[template], chats, reqs, engine)
    getattr(standin, engine)(reqs, outputs, tokenizers[template], length=length)
    proc = responses(models[template], reqs, outputs, out, engine, *more)
    return reqs, out, proc


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("template", ["kimi-k2-thinking", "chatml-generation"])
def test_rows_are_exactly_the_prompt_ids_then_the_generated_ids(models, tokenizers, chats, tmp_path, engine,
                                                                template):
    tokenizer = tokenizers[template]
    reqs, out, proc = _round_trip(models, tokenizers, chats, tmp_path, engine, template)
    answer = standin.generated(tokenizer)
    sent = {_custom_id(line, engine): _prompt_ids(line, engine) for line in read_jsonl(reqs)}
    rows = read_jsonl(out)
    assert [row["id"] for row in rows] == list(sent)
    for row in rows:
        prompt = sent[row["id"]]
        assert row["input_ids"] == prompt + answer
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(answer)
        masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert tokenizer.decode(masked) == standin.ANSWER + standin.END
    freq = json.loads(Path(f"{out}.freq.json").read_text())
    assert freq["samples"] == len(rows) and freq["tokens"] == len(rows) * len(answer)
    assert read_jsonl(f"{out}.report.jsonl") == []
    assert f"wrote {len(rows)} samples" in proc.stderr and "0 generations truncated by the engine" in proc.stderr


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("flag", ["keep", "drop"])
def test_truncated_generations_are_counted_and_kept_or_dropped(models, tokenizers, chats, tmp_path, engine, flag):
    cut = {"multi#turn1", "7#turn2"}
    reqs, out, proc = _round_trip(models, tokenizers, chats, tmp_path, engine, "chatml-generation",
                                  "--on-truncated", flag, length=cut)
    rows = {row["id"]: row for row in read_jsonl(out)}
    report = read_jsonl(f"{out}.report.jsonl")
    assert sorted(r["id"] for r in report) == sorted(cut)
    assert {r["action"] for r in report} == {"kept" if flag == "keep" else "skipped"}
    assert {r["reason"] for r in report} == {"generation truncated (finish_reason length)"}
    done = "kept" if flag == "keep" else "dropped"
    assert f"2 generations truncated by the engine (finish_reason length; {done})" in proc.stderr
    if flag == "keep":
        assert all(sum(rows[cid]["loss_mask"]) == 3 for cid in cut)
    else:
        assert not cut & set(rows)
    assert len(rows) + (0 if flag == "keep" else 2) == len(read_jsonl(reqs))


def _bad_outputs(tmp_path, lines, change):
    """The stand-in's outputs with line 2 replaced by change(a copy of line 2) (text, or an object)."""
    changed = change(copy.deepcopy(lines[1]))
    lines = [*lines[:1], changed if isinstance(changed, str) else json.dumps(changed), *lines[2:]]
    return write_jsonl(tmp_path / "bad-outputs.jsonl", lines)


def _drop(key):
    def change(line):
        del line[key]
        return line
    return change


def _unknown(engine):
    def change(line):
        if engine == "vllm":
            line["custom_id"] = "nobody#turn9"
        else:
            line["meta_info"]["id"] = "nobody#turn9"
        return line
    return change


def _other_prompt(engine):
    def change(line):
        if engine == "vllm":
            line["response"]["body"]["choices"][0]["prompt_token_ids"][3] += 1
        else:
            line["prompt_token_ids"] = [1, 2, 3]
        return line
    return change


BAD = {  # what is wrong -> (vLLM's change, SGLang's change, the message after OUTPUTS:2:)
    "not JSON": (lambda line: '{"custom_id": ', lambda line: '{"text": ', "not valid JSON"),
    "not an object": (lambda line: "[1]", lambda line: "[1]", "not a JSON object (a list)"),
    "missing field": (_drop("response"), _drop("output_ids"), "no "),
    "unknown id": (_unknown("vllm"), _unknown("sglang"), "answers 'nobody#turn9', which is not a request of"),
    "other prompt ids": (_other_prompt("vllm"), _other_prompt("sglang"), "the engine's prompt ids differ from "
                         "the request ("),
}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("what", list(BAD))
def test_a_line_not_in_the_engines_format_is_an_error_naming_file_and_line(models, tokenizers, chats, tmp_path,
                                                                           engine, what):
    template = "chatml-generation"
    reqs, good = tmp_path / "requests.jsonl", tmp_path / "outputs.jsonl"
    requests(models[template], chats, reqs, engine)
    getattr(standin, engine)(reqs, good, tokenizers[template])
    change = BAD[what][0 if engine == "vllm" else 1]
    outputs = _bad_outputs(tmp_path, read_jsonl(good), change)
    proc = responses(models[template], reqs, outputs, tmp_path / "rows.jsonl", engine, expect_ok=False)
    assert proc.returncode == 1 and f"{outputs}:2: " in proc.stderr and BAD[what][2] in proc.stderr, proc.stderr
    if what == "other prompt ids":
        assert f"the request ({reqs}:2)" in proc.stderr  # both files, both lines
    assert not (tmp_path / "rows.jsonl").exists()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_errors_and_unanswered_requests_are_reported_and_counted(models, tokenizers, chats, tmp_path, engine):
    template = "chatml-generation"
    reqs, good = tmp_path / "requests.jsonl", tmp_path / "outputs.jsonl"
    requests(models[template], chats, reqs, engine)
    getattr(standin, engine)(reqs, good, tokenizers[template])
    lines = read_jsonl(good)
    failed, unanswered = _custom_id_of(lines[1], engine), _custom_id_of(lines[2], engine)
    if engine == "vllm":
        lines[1] = {**lines[1], "response": {"status_code": 400, "request_id": "x", "body": None},
                    "error": "prompt too long"}
    else:
        lines[1] = {"error": {"message": "prompt too long"}, "meta_info": {"id": failed}}
    outputs = write_jsonl(tmp_path / "some.jsonl", [lines[0], lines[1], *lines[3:]])
    out = tmp_path / "rows.jsonl"
    proc = responses(models[template], reqs, outputs, out, engine)
    report = {r["id"]: r for r in read_jsonl(f"{out}.report.jsonl")}
    assert report[failed]["reason"] == "engine error" and "prompt too long" in report[failed]["detail"]
    assert report[unanswered]["reason"] == "no response" and f"{reqs}:3" in report[unanswered]["detail"]
    assert "1 skipped (engine error)" in proc.stderr and "1 skipped (no response)" in proc.stderr
    assert len(read_jsonl(out)) == len(lines) - 2
    strict = responses(models[template], reqs, outputs, tmp_path / "strict.jsonl", engine, "--strict",
                       expect_ok=False)
    assert f"{outputs}:2: " in strict.stderr and "(--strict)" in strict.stderr
    twice = write_jsonl(tmp_path / "twice.jsonl", [lines[0], lines[0]])
    proc = responses(models[template], reqs, twice, tmp_path / "t.jsonl", engine, expect_ok=False)
    assert f"{twice}:2: a second answer to" in proc.stderr and "(the first is line 1)" in proc.stderr
    doubled = write_jsonl(tmp_path / "doubled.jsonl", [*read_jsonl(reqs), read_jsonl(reqs)[0]])
    proc = responses(models[template], doubled, good, tmp_path / "d.jsonl", engine, expect_ok=False)
    assert f"{doubled}:{len(lines) + 1}: the id " in proc.stderr
    assert "again (first at line 1)" in proc.stderr, proc.stderr


def _custom_id_of(line, engine):
    return line["custom_id"] if engine == "vllm" else line["meta_info"]["id"]


def test_rerun_after_fixing_a_bad_output_line_equals_a_clean_run(models, tokenizers, chats, tmp_path):
    template = "chatml-generation"
    reqs, good = tmp_path / "requests.jsonl", tmp_path / "outputs.jsonl"
    requests(models[template], chats, reqs, "vllm")
    standin.vllm(reqs, good, tokenizers[template])
    clean = tmp_path / "clean.jsonl"
    responses(models[template], reqs, good, clean, "vllm", "--checkpoint-every", 1)
    lines = good.read_text().splitlines(keepends=True)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(lines[:4]) + "{oops\n" + "".join(lines[5:]))
    out = tmp_path / "rows.jsonl"
    proc = responses(models[template], reqs, broken, out, "vllm", "--checkpoint-every", 1, expect_ok=False)
    assert f"{broken}:5: not valid JSON" in proc.stderr and Path(f"{out}.prepare-state.json").exists()
    broken.write_text("".join(lines))
    responses(models[template], reqs, broken, out, "vllm", "--checkpoint-every", 1)
    for suffix in ("", ".report.jsonl", ".freq.json"):
        assert Path(f"{out}{suffix}").read_bytes() == Path(f"{clean}{suffix}").read_bytes()


# -- chat completions: the engine renders, hsx checks; without ids, hsx renders ----------------------


def _chat_requests(models, chats, tmp_path, template):
    reqs = tmp_path / "requests.jsonl"
    requests(models[template], chats, reqs, "vllm", "--endpoint", "chat-completions")
    return reqs


def test_chat_completion_with_ids_is_checked_against_the_templates_prompt(models, tokenizers, chats, tmp_path):
    template = "kimi-k2-thinking"
    tokenizer = tokenizers[template]
    reqs = _chat_requests(models, chats, tmp_path, template)

    def prompt(request):
        return list(tokenizer.apply_chat_template(request["body"]["messages"], tools=request["body"].get("tools"),
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
    outputs = standin.vllm(reqs, tmp_path / "outputs.jsonl", tokenizer, chat_prompt=prompt)
    out = tmp_path / "rows.jsonl"
    responses(models[template], reqs, outputs, out, "vllm")
    answer = standin.generated(tokenizer)
    for request, row in zip(read_jsonl(reqs), read_jsonl(out)):
        assert row["id"] == request["custom_id"] and row["input_ids"] == prompt(request) + answer
    # An engine that rendered the messages another way: an error naming both files and lines.
    bad = standin.vllm(reqs, tmp_path / "bad.jsonl", tokenizer, chat_prompt=lambda r: prompt(r)[1:])
    proc = responses(models[template], reqs, bad, tmp_path / "bad-rows.jsonl", "vllm", expect_ok=False)
    assert f"{bad}:1: the engine's prompt ids differ from the template's rendering of the messages of the " \
           f"request ({reqs}:1)" in proc.stderr, proc.stderr


def test_text_only_chat_completion_is_rendered_through_the_template(models, tokenizers, chats, tmp_path):
    template = "kimi-k2-thinking"
    tokenizer = tokenizers[template]
    reqs = _chat_requests(models, chats, tmp_path, template)
    message = {"content": "CONTENT", "reasoning": "REASONING"}  # vLLM 0.34's name; reasoning_content before
    outputs = standin.vllm(reqs, tmp_path / "outputs.jsonl", tokenizer, message=message, with_ids=False)
    out = tmp_path / "rows.jsonl"
    responses(models[template], reqs, outputs, out, "vllm")
    rows = read_jsonl(out)
    assert [row["id"] for row in rows] == [line["custom_id"] for line in read_jsonl(reqs)]
    for request, row in zip(read_jsonl(reqs), rows):
        body = request["body"]
        prompt = list(tokenizer.apply_chat_template(body["messages"], tools=body.get("tools"),
                                                    add_generation_prompt=True, tokenize=True, return_dict=False))
        assert row["input_ids"][:len(prompt)] == prompt and not any(row["loss_mask"][:len(prompt)])
        masked = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
        assert masked == "<think>REASONING</think>CONTENT<|im_end|>", masked


# -- the engines' own classes ------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_requests_and_stand_in_answers_validate_with_the_engines_classes(models, tokenizers, chats, tmp_path,
                                                                         engine):
    template = "kimi-k2-thinking"
    reqs, outputs = tmp_path / "requests.jsonl", tmp_path / "outputs.jsonl"
    requests(models[template], chats, reqs, engine, *SAMPLING[2:])
    getattr(standin, engine)(reqs, outputs, tokenizers[template])
    pythonpath = os.environ.get("HSX_ENGINE_PYTHONPATH", "")
    verdict, stderr = standin.validate_with_engine(engine, reqs, outputs, pythonpath)
    if verdict.startswith("ABSENT"):
        print(f"{engine}'s classes do not import here ({verdict}); set HSX_ENGINE_PYTHONPATH to a "
              "directory holding the package (docs/prepare.md, Regeneration)")
        pytest.skip(f"{engine} is not importable: {verdict}")
    assert verdict.startswith("OK"), f"{verdict}\n{stderr}"
    if engine == "vllm":  # the chat form too
        chat, chat_out = tmp_path / "chat.jsonl", tmp_path / "chat-out.jsonl"
        requests(models[template], chats, chat, "vllm", "--endpoint", "chat-completions")
        standin.vllm(chat, chat_out, tokenizers[template], message={"content": "x", "reasoning": "y"})
        verdict, stderr = standin.validate_with_engine(engine, chat, chat_out, pythonpath)
        assert verdict.startswith("OK"), f"{verdict}\n{stderr}"


# -- SGLang's runner (sglang_batch.py) with a stand-in sglang.Engine --------------------------------


def _sglang_batch():
    path = Path(__file__).resolve().parents[2] / "client/python/hsx/prepare/sglang_batch.py"
    spec = importlib.util.spec_from_file_location("sglang_batch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeEngine:
    """sglang.Engine.generate's batch form, answering as standin.sglang does; refuses rids in `bad`."""

    def __init__(self, tokenizer, bad=()):
        self.tokenizer, self.bad, self.calls = tokenizer, set(bad), []

    def generate(self, input_ids, sampling_params, rid):
        self.calls.append(list(rid))
        if self.bad & set(rid):
            raise ValueError("refused")
        ids = standin.generated(self.tokenizer)
        return [{"text": self.tokenizer.decode(ids), "output_ids": ids,
                 "meta_info": {"id": r, "finish_reason": {"type": "stop"}, "prompt_tokens": len(p)}}
                for r, p in zip(rid, input_ids)]


def test_sglang_runner_answers_every_request_resumes_and_isolates_failures(models, tokenizers, chats, tmp_path):
    template = "chatml-generation"
    runner, tokenizer = _sglang_batch(), tokenizers[template]
    reqs = tmp_path / "requests.jsonl"
    requests(models[template], chats, reqs, "sglang")
    rids = [line["rid"] for line in read_jsonl(reqs)]
    outputs = tmp_path / "outputs.jsonl"
    # A run killed after writing two answers and half of a third: the rerun sends the rest only.
    partial = Path(f"{outputs}.partial")
    standin.sglang(reqs, partial, tokenizer)
    text = partial.read_text().splitlines(keepends=True)
    partial.write_text("".join(text[:2]) + text[2][:20])
    engine = FakeEngine(tokenizer, bad={rids[4]})
    assert runner.run(engine, reqs, outputs, chunk=4) == len(rids) - 2
    assert engine.calls[0] == rids[2:6] and [rids[4]] in engine.calls  # the refused chunk, one by one
    answers = read_jsonl(outputs)
    assert sorted(a["meta_info"]["id"] for a in answers) == sorted(rids) and not partial.exists()
    assert [a for a in answers if "error" in a] == [{"error": {"message": "ValueError: refused"},
                                                     "meta_info": {"id": rids[4]}}]
    out = tmp_path / "rows.jsonl"
    proc = responses(models[template], reqs, outputs, out, "sglang")
    assert len(read_jsonl(out)) == len(rids) - 1 and "1 skipped (engine error)" in proc.stderr


# -- the whole chain, to hsx-dump and hsx-verify ------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_conversations_to_requests_to_engine_to_rows_to_hsx_dump_and_verify(models, tokenizers, chats, tmp_path,
                                                                            run, tiny, engine):
    template = "kimi-k2-thinking"
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    assert len(tokenizers[template]) <= vocab  # the fixture ids are ids of the tiny model
    model = tmp_path / "model"  # the template's tokenizer with the tiny model's vocab_size (freq file, id check)
    shutil.copytree(models[template], model)
    (model / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    reqs, out, _ = _round_trip({template: model}, tokenizers, chats, tmp_path, engine, template)
    rows, answer = read_jsonl(out), standin.generated(tokenizers[template])
    sent = [_prompt_ids(line, engine) for line in read_jsonl(reqs)]
    assert [(row["input_ids"], row["loss_mask"]) for row in rows] == [
        (prompt + answer, [0] * len(prompt) + [1] * len(answer)) for prompt in sent]
    assert json.loads(Path(f"{out}.freq.json").read_text())["vocab_size"] == vocab
    dump = tmp_path / "dump"
    proc = run("hsx-dump", "--model", tiny, "--input", out, "--out", dump)
    assert f"wrote {len(rows)} samples" in proc.stdout, proc.stdout
    verdict = run("hsx-verify", dump, "--input", out, "--strict")
    assert " 0 errors" in verdict.stdout, verdict.stdout
    from hsx import read_sample

    manifest = [json.loads(line) for line in (dump / "manifest.jsonl").read_text().splitlines()]
    for entry in manifest:
        sample = read_sample(dump / entry["file"])
        row = rows[entry["index"]]
        assert sample["token_ids"].tolist() == row["input_ids"] and sample["loss_mask"].tolist() == row["loss_mask"]
