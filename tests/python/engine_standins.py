"""Stand-in engines for the regeneration tests: each answers a requests file of `hsx.prepare requests`
in its engine's documented output format, "generating" a fixed answer (its text tokenized with the
fixture tokenizer), so that a test knows exactly which ids a row must hold.

vLLM: `vllm run-batch` output lines (BatchRequestOutput, vllm/entrypoints/launchers/run_batch.py in
0.34.0): {"id", "custom_id", "response": {"status_code": 200, "request_id", "body": <CompletionResponse
or ChatCompletionResponse>}, "error": null}. SGLang: what sglang.Engine.generate returns per request
(tokenizer_manager.py in 0.5.23): {"text", "output_ids", "meta_info": {"id", "finish_reason", ...}}.
"""

import subprocess
import sys

from prepare_helpers import read_jsonl, write_jsonl

ANSWER = "Regenerated: the answer is 42."
END = "<|im_end|>"  # the end-of-turn token of every fixture template, which the engines stop on


def generated(tokenizer, text=ANSWER + END):
    return list(tokenizer.encode(text, add_special_tokens=False))


def _usage(prompt, ids):
    return {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}


def _completion(request, tokenizer, ids, finish):
    prompt = request["body"]["prompt"]
    choice = {"index": 0, "text": tokenizer.decode(ids), "logprobs": None, "finish_reason": finish,
              "stop_reason": None, "token_ids": ids, "prompt_token_ids": prompt}
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": [choice],
            "usage": _usage(prompt, ids)}


def _chat(request, tokenizer, ids, finish, message, prompt_ids):
    choice = {"index": 0, "message": {"role": "assistant", **message}, "logprobs": None, "finish_reason": finish,
              "stop_reason": None, "token_ids": ids}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice],
            "usage": _usage(prompt_ids or [], ids or []), "prompt_token_ids": prompt_ids}


def vllm(requests, outputs, tokenizer, length=(), ids_for=None, message=None, chat_prompt=None, with_ids=True):
    """Answers every request of REQUESTS into OUTPUTS. `length`: custom_ids cut at the token limit
    (finish_reason "length", 3 ids); `ids_for(custom_id)` replaces the generated ids; for chat requests,
    `message` is the returned message, `chat_prompt(request)` the prompt ids reported, and `with_ids`
    False leaves token_ids out (a text-only answer)."""
    lines = []
    for i, request in enumerate(read_jsonl(requests)):
        cid = request["custom_id"]
        ids = ids_for(cid) if ids_for else generated(tokenizer)
        finish = "stop"
        if cid in length:
            ids, finish = ids[:3], "length"
        if request["url"] == "/v1/completions":
            body = _completion(request, tokenizer, ids, finish)
        else:
            body = _chat(request, tokenizer, ids if with_ids else None, finish,
                         message or {"content": ANSWER}, chat_prompt(request) if chat_prompt else None)
        lines.append({"id": f"vllm-{i}", "custom_id": cid,
                      "response": {"status_code": 200, "request_id": f"vllm-batch-{i}", "body": body},
                      "error": None})
    return write_jsonl(outputs, lines)


def sglang(requests, outputs, tokenizer, length=(), ids_for=None):
    """Answers every request as sglang.Engine.generate returns it (see vllm() for the arguments)."""
    lines = []
    for request in read_jsonl(requests):
        rid = request["rid"]
        ids = ids_for(rid) if ids_for else generated(tokenizer)
        finish = {"type": "stop", "matched": ids[-1]}
        if rid in length:
            ids, finish = ids[:3], {"type": "length", "length": 3}
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(request["input_ids"]),
                "completion_tokens": len(ids), "cached_tokens": 0}
        lines.append({"text": tokenizer.decode(ids), "output_ids": ids, "meta_info": meta})
    return write_jsonl(outputs, lines)


# Run in a child process with the engine's package importable (HSX_ENGINE_PYTHONPATH): validates what
# hsx writes, and what the stand-ins answer, with the engine's own classes. Prints "ABSENT: why" when
# the package does not import, "OK n" when every line passed.
VALIDATE = r'''
import json, sys
engine, requests_path, outputs_path = sys.argv[1:4]
try:
    if engine == "vllm":
        from vllm.entrypoints.launchers.run_batch import BatchRequestInput, BatchRequestOutput
    else:
        import ast, importlib.util, os
        from sglang.srt.managers.io_struct import GenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams
except Exception as error:
    print(f"ABSENT: {type(error).__name__}: {error}")
    sys.exit(0)
requests = [json.loads(l) for l in open(requests_path) if l.strip()]
outputs = {}
for l in open(outputs_path):
    if l.strip():
        o = json.loads(l)
        outputs[o["custom_id"] if engine == "vllm" else o["meta_info"]["id"]] = o
for line in requests:
    if engine == "vllm":
        request = BatchRequestInput.model_validate(line)
        body = request.body
        assert body.return_token_ids is True, body
        assert body.max_tokens == line["body"]["max_tokens"] and body.temperature == line["body"]["temperature"]
        if line["url"] == "/v1/completions":
            assert body.prompt == line["body"]["prompt"], "prompt ids"
        answer = BatchRequestOutput.model_validate(outputs[request.custom_id])
        choice = answer.response.body.choices[0]
        assert choice.token_ids == outputs[request.custom_id]["response"]["body"]["choices"][0]["token_ids"]
        kind = type(answer.response.body).__name__
        assert kind == ("CompletionResponse" if line["url"] == "/v1/completions" else "ChatCompletionResponse"), kind
    else:
        # Engine.generate's parameters, read from its source (importing the engine needs CUDA-era packages)
        root = os.path.dirname(importlib.util.find_spec("sglang").origin)
        tree = ast.parse(open(os.path.join(root, "srt", "entrypoints", "engine.py")).read())
        engine_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
        generate = next(n for n in engine_class.body if isinstance(n, ast.FunctionDef) and n.name == "generate")
        accepted = {a.arg for a in generate.args.args + generate.args.kwonlyargs}
        assert set(line) <= accepted, set(line) - accepted
        request = GenerateReqInput(**line)
        request.normalize_batch_and_arguments()
        params = SamplingParams(**line["sampling_params"])
        params.verify(1 << 20)
        assert request.input_ids == line["input_ids"] and request.rid == line["rid"]
print(f"OK {len(requests)}")
'''


def validate_with_engine(engine, requests, outputs, pythonpath):
    """('OK n' | 'ABSENT: why', stderr) from VALIDATE in a child process."""
    import os

    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", VALIDATE, engine, str(requests), str(outputs)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    return (lines[-1] if lines else f"FAILED ({proc.returncode})"), proc.stderr[-3000:]
