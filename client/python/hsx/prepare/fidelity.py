"""What an assistant message holds, and whether a rendered turn still holds it.

Owns the check behind "nothing the model wrote is dropped silently": every text
field of an assistant message (its content or text parts, `reasoning_content`,
each tool call's name and arguments) must appear in the text decoded from the
tokens masked for that turn. A template that drops or rewrites a field (Kimi
K2-Thinking empties the reasoning of every finished turn; a template that
renders no tool calls drops them) fails the check, and the caller writes the
conversation another way or skips it with the field's name.

The comparison is a substring test on the field with surrounding whitespace
stripped (templates trim turns). Tool-call arguments are the exception that
templates legitimately reformat: a string is found as written or, when it is
JSON, by its keys and values; a mapping by its keys and values, each as written
or JSON-quoted.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

REASONING = "reasoning_content"


def _text_parts(content: Any) -> Iterator[tuple[str, str]]:
    if isinstance(content, str):
        yield "content", content
    elif isinstance(content, list):
        for i, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                yield f"content[{i}].text", part["text"]


def _leaves(value: Any) -> Iterator[Any]:
    """The keys and scalar values of a JSON value, depth first."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    elif value is not None:
        yield value


def _forms(leaf: Any) -> set[str]:
    """How a template may write one key or value: as it is, or JSON-encoded (ASCII-escaped or not)."""
    forms = {json.dumps(leaf, ensure_ascii=False), json.dumps(leaf)}
    if isinstance(leaf, str):
        forms |= {leaf, json.dumps(leaf, ensure_ascii=False)[1:-1], json.dumps(leaf)[1:-1]}
    elif isinstance(leaf, bool):
        forms |= {str(leaf)}
    return {f.strip() for f in forms}


def _arguments_present(arguments: Any, text: str) -> bool:
    if isinstance(arguments, str):
        if arguments.strip() in text:
            return True
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return False
        if not isinstance(arguments, (dict, list)):
            return False
    return all(any(form in text for form in _forms(leaf)) for leaf in _leaves(arguments))


def _calls(message: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    for i, call in enumerate(message.get("tool_calls") or []):
        if isinstance(call, dict):
            function = call.get("function") if isinstance(call.get("function"), dict) else call
            yield i, function


def missing_fields(message: dict[str, Any], text: str) -> list[str]:
    """The fields of assistant `message` whose text does not appear in `text`, by path (e.g.
    'reasoning_content', 'tool_calls[0].function.arguments'); empty when the turn holds them all."""
    missing = [path for path, value in _text_parts(message.get("content")) if value.strip() not in text]
    reasoning = message.get(REASONING)
    if isinstance(reasoning, str) and reasoning.strip() not in text:
        missing.append(REASONING)
    for i, function in _calls(message):
        name = function.get("name")
        if isinstance(name, str) and name.strip() not in text:
            missing.append(f"tool_calls[{i}].function.name")
        if "arguments" in function and not _arguments_present(function["arguments"], text):
            missing.append(f"tool_calls[{i}].function.arguments")
    return missing


def drop_reason(fields: list[str]) -> str:
    """The report's reason key for a turn missing `fields`: the first field's kind."""
    kind = fields[0].split("[")[0].split(".")[0]
    return f"template drops {kind}"


def preview(text: str, limit: int = 160) -> str:
    """A rendered turn, shortened for a report line."""
    return text if len(text) <= limit else text[:limit // 2] + " ... " + text[-limit // 2:]
