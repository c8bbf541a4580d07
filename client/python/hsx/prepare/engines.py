"""The two engines' offline formats: the request lines hsx writes for them and the output lines it reads back.

Owns what each field means and where each sampling parameter goes; nothing here knows about
tokenizers or chat templates. Read from the engines' own code (docs/prepare.md, "Regeneration",
names the files and versions):

vLLM, `vllm run-batch -i REQUESTS -o OUTPUTS` (vllm/entrypoints/launchers/run_batch.py in 0.34.0:
BatchRequestInput, BatchRequestOutput, BatchResponseData):

  request  {"custom_id": ID, "method": "POST", "url": URL, "body": BODY}
           URL "/v1/completions" (vLLM >= 0.34.0 reads it in run-batch): BODY is a CompletionRequest
           with the prompt as token ids, {"prompt": [ids], "max_tokens", "temperature", ...,
           "return_token_ids": true} (completion/protocol.py; return_token_ids since 0.10.2);
           URL "/v1/chat/completions" (every run-batch): BODY is a ChatCompletionRequest,
           {"messages", "tools"?, "chat_template_kwargs"?, ..., "return_token_ids": true}; vLLM
           renders the prompt with its own copy of the template.
  output   {"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error"}
           a completion body: choices[0] {"text", "token_ids", "prompt_token_ids", "finish_reason"};
           a chat body: choices[0] {"message": {"content", "reasoning" (0.34; "reasoning_content"
           before), "tool_calls"}, "token_ids", "finish_reason"} and the body's "prompt_token_ids".
           A failed request: "error" set, or a status_code other than 200.

SGLang has no file-driven batch runner (0.5.23 has no OpenAI batch API); its offline entry point is
`sglang.Engine.generate(input_ids=..., sampling_params=..., rid=...)`, whose arguments are those of
the native `/generate` request, GenerateReqInput (srt/managers/io_struct.py):

  request  {"rid": ID, "input_ids": [ids], "sampling_params": {"max_new_tokens", "temperature", ...}}
           one Engine.generate call's keyword arguments, and one POST /generate body
  output   {"text", "output_ids", "meta_info": {"id": ID, "finish_reason": {"type": "stop"|"length"|
           "abort", ...}, "prompt_tokens", ...}, "prompt_token_ids"?} as Engine.generate returns it
           and /generate answers it (srt/managers/tokenizer_manager.py); a failed request:
           {"error": ...} (/generate's error body; "meta_info": {"id"} where the runner knows it,
           hsx/prepare/sglang_batch.py).

Errors are chats.InputError with what is wrong in the line; the run adds FILE:LINE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .chats import InputError

ENGINES = ("vllm", "sglang")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = {"completions": COMPLETIONS, "chat-completions": CHAT}


@dataclass
class Sampling:
    """The sampling flags; None (or empty) leaves a parameter to the engine's default."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def settings(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class Request:
    """One request line as hsx reads it back: its id, the prompt ids it sends (completions and
    SGLang) or the messages the engine renders (chat completions)."""

    custom_id: str
    url: str
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    template_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    """One output line: what the engine generated for one request, or why it failed."""

    custom_id: str | None
    error: str | None = None
    prompt_ids: list[int] | None = None  # as the engine reports them
    ids: list[int] | None = None  # the generated ids
    finish: str | None = None  # "stop", "length", ...
    message: dict[str, Any] | None = None  # a chat completion's message
    endpoint: str = ""  # the shape of the answer: COMPLETIONS, CHAT or "generate"
    prompt_tokens: int | None = None  # SGLang's meta_info.prompt_tokens (a count, no ids)


# -- requests ----------------------------------------------------------------------------------------


def _vllm_sampling(sampling: Sampling) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature}
    optional = {"top_p": sampling.top_p, "top_k": sampling.top_k, "seed": sampling.seed,
                "stop": list(sampling.stop) or None, "stop_token_ids": list(sampling.stop_token_ids) or None}
    body.update({key: value for key, value in optional.items() if value is not None})
    return body


def vllm_completion(custom_id: str, prompt_ids: list[int], sampling: Sampling, served_model: str | None) -> dict:
    """A /v1/completions batch line: the prompt as token ids, the ids asked back."""
    body: dict[str, Any] = {"prompt": list(prompt_ids), **_vllm_sampling(sampling), "return_token_ids": True}
    if served_model:
        body = {"model": served_model, **body}
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body}


def vllm_chat(custom_id: str, messages, tools, template_args: dict[str, Any], sampling: Sampling,
              served_model: str | None) -> dict:
    """A /v1/chat/completions batch line: the messages before the turn; vLLM adds the generation prompt."""
    body: dict[str, Any] = {"messages": messages}
    if served_model:
        body = {"model": served_model, **body}
    if tools:
        body["tools"] = tools
    if template_args:
        body["chat_template_kwargs"] = dict(template_args)
    body.update({**_vllm_sampling(sampling), "return_token_ids": True})
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def sglang_generate(custom_id: str, prompt_ids: list[int], sampling: Sampling) -> dict:
    """A GenerateReqInput: Engine.generate's keyword arguments, a /generate body."""
    params: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature}
    optional = {"top_p": sampling.top_p, "top_k": sampling.top_k, "sampling_seed": sampling.seed,
                "stop": list(sampling.stop) or None, "stop_token_ids": list(sampling.stop_token_ids) or None}
    params.update({key: value for key, value in optional.items() if value is not None})
    return {"rid": custom_id, "input_ids": list(prompt_ids), "sampling_params": params}


# -- reading lines back ------------------------------------------------------------------------------


def _object(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise InputError(f"{what} is not a JSON object (a {type(obj).__name__})")
    return obj


def _field(obj: dict[str, Any], key: str, kind, what: str):
    if key not in obj:
        raise InputError(f'{what}: no "{key}" field')
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise InputError(f'{what}: "{key}" is not a {names} (a {type(value).__name__})')
    return value


def token_ids(value: Any, what: str) -> list[int]:
    """A list of token ids (non-negative integers), or InputError naming `what`."""
    if not isinstance(value, list):
        raise InputError(f"{what} is not a list of token ids (a {type(value).__name__})")
    for i, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise InputError(f"{what}[{i}] is not a token id ({token!r})")
    return value


def request_id(engine: str, obj: Any) -> str:
    """The id of a request line (custom_id for vLLM, rid for SGLang)."""
    obj = _object(obj, "the request")
    return _field(obj, "custom_id" if engine == "vllm" else "rid", str, "the request")


def read_request(engine: str, obj: Any) -> Request:
    """A request line hsx wrote for `engine`."""
    obj = _object(obj, "the request")
    if engine == "sglang":
        ids = token_ids(_field(obj, "input_ids", list, "the request"), "the request's input_ids")
        return Request(request_id(engine, obj), "generate", prompt_ids=ids)
    cid = request_id(engine, obj)
    url = _field(obj, "url", str, "the request")
    body = _object(obj.get("body"), 'the request\'s "body"')
    if url == COMPLETIONS:
        return Request(cid, url, prompt_ids=token_ids(body.get("prompt"), 'the request\'s "body.prompt"'))
    if url == CHAT:
        messages = _field(body, "messages", list, 'the request\'s "body"')
        args = body.get("chat_template_kwargs") or {}
        return Request(cid, url, messages=messages, tools=body.get("tools"), template_args=dict(args))
    raise InputError(f'the request\'s "url" is {url!r}; hsx writes {COMPLETIONS!r} or {CHAT!r}')


def reply_id(engine: str, obj: Any) -> str | None:
    """The request id an output line answers; None for an error line that names none (SGLang)."""
    obj = _object(obj, "the output line")
    if engine == "vllm":
        return _field(obj, "custom_id", str, "the output line")
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("id"), str):
        return meta["id"]
    if "error" in obj:
        return None
    _field(obj, "meta_info", dict, "the output line")
    return _field(meta, "id", str, 'the output line\'s "meta_info"')


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        inner = error.get("error", error)
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
    return str(error)


def _vllm_choice(body: dict[str, Any]) -> dict[str, Any]:
    choices = _field(body, "choices", list, 'the output\'s "response.body"')
    if len(choices) != 1:
        raise InputError(f'the output\'s "response.body.choices" has {len(choices)} choices; hsx asks for one')
    return _object(choices[0], 'the output\'s "response.body.choices[0]"')


def _vllm_reply(obj: dict[str, Any]) -> Reply:
    cid = reply_id("vllm", obj)
    for key in ("response", "error"):
        if key not in obj:
            raise InputError(f'the output line has no "{key}" field (vLLM writes it, null or not)')
    response, error = obj["response"], obj["error"]
    status = response.get("status_code") if isinstance(response, dict) else None
    if error is not None or response is None or status != 200:
        return Reply(cid, error=f"status {status}: {_error_text(error)}")
    response = _object(response, 'the output\'s "response"')
    body = _object(response.get("body"), 'the output\'s "response.body"')
    choice = _vllm_choice(body)
    ids = choice.get("token_ids")
    ids = None if ids is None else token_ids(ids, "choices[0].token_ids")
    finish = choice.get("finish_reason")
    if "message" in choice:
        message = _object(choice["message"], "choices[0].message")
        prompt = body.get("prompt_token_ids")
        prompt = None if prompt is None else token_ids(prompt, "the body's prompt_token_ids")
        return Reply(cid, prompt_ids=prompt, ids=ids, finish=finish, message=message, endpoint=CHAT)
    if "text" not in choice:
        raise InputError('choices[0] has neither "text" (a completion) nor "message" (a chat completion)')
    prompt = choice.get("prompt_token_ids")
    prompt = None if prompt is None else token_ids(prompt, "choices[0].prompt_token_ids")
    return Reply(cid, prompt_ids=prompt, ids=ids, finish=finish, endpoint=COMPLETIONS)


def _sglang_reply(obj: dict[str, Any]) -> Reply:
    cid = reply_id("sglang", obj)
    if "error" in obj:
        return Reply(cid, error=_error_text(obj["error"]))
    meta = obj["meta_info"]
    reason = meta.get("finish_reason")
    finish = reason.get("type") if isinstance(reason, dict) else reason
    if finish == "abort":
        return Reply(cid, error=f"aborted: {reason.get('message')}")
    ids = token_ids(_field(obj, "output_ids", list, "the output line"), "output_ids")
    prompt = obj.get("prompt_token_ids")
    prompt = None if prompt is None else token_ids(prompt, "prompt_token_ids")
    count = meta.get("prompt_tokens")
    return Reply(cid, prompt_ids=prompt, ids=ids, finish=finish, endpoint="generate",
                 prompt_tokens=count if isinstance(count, int) and not isinstance(count, bool) else None)


def read_reply(engine: str, obj: Any) -> Reply:
    """An output line of `engine`'s runner."""
    obj = _object(obj, "the output line")
    return _vllm_reply(obj) if engine == "vllm" else _sglang_reply(obj)
