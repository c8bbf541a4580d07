"""One chat JSONL line -> a checked conversation: messages, tools and a sample id.

Owns the three input layouts hsx.prepare reads and what counts as bad input in
them. Nothing here knows about tokenizers.

  ShareGPT  {"conversations": [{"from": "human", "value": "..."}, ...]}
            ("role"/"content" items are read too)
  OpenAI    {"messages": [{"role": "user", "content": "..."}, ...], "tools": [...]?}
            (assistant "tool_calls", "reasoning_content", tool "tool_call_id"/"name" kept)
  plain     {"prompt": "...", "response": "...", "system": "..."?}

A line may carry "id" (a string or an integer): it becomes the sample id. An integer id must
be a 64-bit signed integer (what every reader of the ids, hsx-dump first, holds); a larger one
is refused, never rewritten: the line should carry it as a string. Without one, the id is "sha256:" + the first 16 hex digits of the SHA-256 of the
line's canonical JSON (keys sorted, no spaces, UTF-8), so the same
conversation gets the same id wherever it is in the file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names -> roles.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "model": "assistant", "tool": "tool", "function": "tool",
                  "observation": "tool"}


INT64 = (-(1 << 63), (1 << 63) - 1)


class InputError(ValueError):
    """A line that cannot be read as a conversation; the message says why (no FILE:LINE prefix)."""


@dataclass
class Conversation:
    """A checked conversation: messages as a chat template reads them, tools, and the sample id."""

    messages: list[dict[str, Any]]
    sample_id: str | int
    tools: list[Any] | None = None
    layout: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def has_assistant(self) -> bool:
        return any(m["role"] == "assistant" for m in self.messages)


MEDIA_KEYS = ("image", "image_url", "input_audio", "audio", "audio_url", "video", "video_url", "file")


def media_part(messages: list[dict[str, Any]]) -> str | None:
    """Where the first image, audio or video part is ("message 2 (role user): content[1] is an
    image_url part"), or None. hsx extracts the text model's states only (the server ignores the
    vision tower), so such a part would be extracted as its placeholder token as if it were text."""
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            keys = [k for k in MEDIA_KEYS if k in part]
            if kind not in (None, "text") or keys:
                name = kind if kind not in (None, "text") else keys[0]
                return f"message {i} (role {message['role']}): content[{j}] is a media part ({name})"
    return None


def canonical_id(obj: Any) -> str:
    """The content-derived sample id: sha256 of the canonical JSON, 16 hex digits."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _sample_id(obj: dict[str, Any]) -> str | int:
    value = obj.get("id")
    if value is None:
        return canonical_id(obj)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f'"id" must be a string or an integer, not {type(value).__name__}')
    if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
        raise InputError(f'"id" {value} is outside the 64-bit signed integers hsx-dump reads; write it as a string')
    return value


def _path(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    name = key.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
    return f"{path}.{name}" if path else name


def _lone_surrogate(obj: Any) -> None:
    """Raises InputError naming the first string (or key) holding a lone surrogate: JSON's "\\ud800"
    escape decodes to one, which is no character and which no tokenizer or UTF-8 writer takes.
    Iterative: the object may be as deep as the JSON reader allows."""
    stack = [("", obj)]
    while stack:
        path, value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            for text, where in ((key, path), (item, _path(path, key))):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as error:
                        raise InputError(f"{where or 'the line'}: a lone surrogate (\\u{ord(text[error.start]):04x}), "
                                         "not a character: not Unicode text") from None
            if isinstance(item, (dict, list)):
                stack.append((_path(path, key), item))


def _check_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """One message with a known role and content; assistant tool calls may come without content."""
    role = message["role"]
    if role not in ROLES:
        raise InputError(f'message {index}: unknown role "{role}" (expected one of {", ".join(ROLES)})')
    content = message.get("content")
    if content is None:
        if role == "assistant" and message.get("tool_calls"):
            message["content"] = ""  # OpenAI writes null content beside tool calls
        else:
            raise InputError(f'message {index} (role {role}): no "content" field')
    elif not isinstance(content, (str, list)):
        raise InputError(f'message {index} (role {role}): "content" must be a string or a list of parts, '
                         f"not {type(content).__name__}")
    calls = message.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        raise InputError(f'message {index} (role {role}): "tool_calls" must be a list on an assistant message')
    return message


def _sharegpt(items: Any) -> list[dict[str, Any]]:
    if not isinstance(items, list):
        raise InputError('"conversations" must be a list of messages')
    messages = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InputError(f"message {i}: not a JSON object")
        if "from" in item:
            speaker = item["from"]
            if speaker not in SHAREGPT_ROLES:
                raise InputError(f'message {i}: unknown role "{speaker}" (ShareGPT "from" must be one of '
                                 f'{", ".join(sorted(SHAREGPT_ROLES))})')
            if "value" not in item:
                raise InputError(f'message {i} (from {speaker}): no "value" field')
            rest = {k: v for k, v in item.items() if k not in ("from", "value")}
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": item["value"], **rest})
        elif "role" in item:
            messages.append(dict(item))
        else:
            raise InputError(f'message {i}: no "from" (ShareGPT) or "role" field')
    return messages


def _openai(items: Any) -> list[dict[str, Any]]:
    if not isinstance(items, list):
        raise InputError('"messages" must be a list of messages')
    messages = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InputError(f"message {i}: not a JSON object")
        if "role" not in item:
            raise InputError(f'message {i}: no "role" field')
        messages.append(dict(item))
    return messages


def _plain(obj: dict[str, Any]) -> list[dict[str, Any]]:
    for key in ("prompt", "response"):
        if key not in obj:
            raise InputError(f'"prompt"/"response" layout without a "{key}" field')
        if not isinstance(obj[key], str):
            raise InputError(f'"{key}" must be a string')
    messages = []
    if obj.get("system") is not None:
        if not isinstance(obj["system"], str):
            raise InputError('"system" must be a string')
        messages.append({"role": "system", "content": obj["system"]})
    messages.append({"role": "user", "content": obj["prompt"]})
    messages.append({"role": "assistant", "content": obj["response"]})
    return messages


def parse_line(text: str) -> Conversation:
    """Reads one non-blank JSONL line; raises InputError saying what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"not valid JSON ({error.msg} at column {error.colno})") from None
    except RecursionError:  # Python's reader recurses once per level: about 1,000 levels
        raise InputError("JSON nested too deeply to read") from None
    except ValueError as error:  # an integer of over 4,300 digits (sys.int_info.str_digits_check_threshold)
        raise InputError(f"not valid JSON ({str(error).split(':')[0]})") from None
    _lone_surrogate(obj)
    if not isinstance(obj, dict):
        raise InputError(f"not a JSON object (a {type(obj).__name__})")
    sample_id = _sample_id(obj)
    if "conversations" in obj:
        layout, messages = "sharegpt", _sharegpt(obj["conversations"])
    elif "messages" in obj:
        layout, messages = "openai", _openai(obj["messages"])
    elif "prompt" in obj or "response" in obj:
        layout, messages = "plain", _plain(obj)
    else:
        raise InputError('no "conversations" (ShareGPT), "messages" (OpenAI) or "prompt"/"response" field')
    if not messages:
        raise InputError("the conversation has no messages")
    messages = [_check_message(m, i) for i, m in enumerate(messages)]
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InputError('"tools" must be a list')
    return Conversation(messages=messages, sample_id=sample_id, tools=tools or None, layout=layout)
