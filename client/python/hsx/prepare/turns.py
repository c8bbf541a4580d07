"""One assistant turn at its generation boundary: the prompt the model saw and the text it wrote.

Owns the per-turn form of a sample. For assistant message k:

  prompt      the template's rendering of messages[:k] with the generation prompt, exactly what
              an engine serving the model feeds it before turn k;
  completion  what the model emits after that boundary: the template's rendering of message k
              itself (reasoning, content, tool calls, the end-of-turn token).

The completion is the text the template adds when message k is appended to the prompt's
messages (rendered without the generation prompt). Two templates' habits need more:

- A template that rewrites earlier turns once message k is added (Kimi K2-Thinking renders an
  open tool chain with its reasoning while it is open and without it once a final answer
  follows): then the rendering does not continue the prompt. The turn's own text is taken from
  the same messages with the earlier turns' reasoning left out (where the two renderings agree
  again); the prompt stays the real one.
- A template that never renders a finished turn's reasoning (Kimi K2-Thinking and K2.5 give every
  turn up to the last plain answer an empty `<think></think>`): it renders reasoning only in its
  branch for turns of an open tool chain. The turn is rendered once more through that branch
  (the same message with one probe tool call added), and again with its reasoning empty; the two
  differ by exactly the template's rendering of the reasoning, at the place the template puts it.
  That text is put at the same place in the completion. The probe's call is never kept.

Either way the caller checks the completion's tokens against the message (fidelity.py); these
are ways to find the template's own rendering, never a guess that goes unchecked.
"""

from __future__ import annotations

from typing import Any

from .fidelity import REASONING
from .masking import NotPrefixStable, Renderings, TemplateRaised

PROBE_CALL = {"id": "functions.hsx_probe:0", "type": "function",
              "function": {"name": "hsx_probe", "arguments": "{}"}}


def prompt(renderings: Renderings, k: int) -> str:
    """The generation prompt of turn k: messages[:k] rendered with the generation prompt."""
    if k == 0:
        raise NotPrefixStable("message 0 is an assistant message: nothing comes before it to render the "
                              "turn's prompt from")
    return renderings.text(k, True)


def _without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if key != REASONING}


def _boundary(renderings: Renderings, k: int) -> str:
    """What the template adds for message k after its prompt (see the module's first case)."""
    before = prompt(renderings, k)
    upto = renderings.text(k + 1, False)
    if upto.startswith(before):
        return upto[len(before):]
    context = [_without_reasoning(m) if m["role"] == "assistant" else m for m in renderings.messages[:k]]
    try:
        before = renderings.render(context, True)
        upto = renderings.render([*context, renderings.messages[k]], False)
    except TemplateRaised:  # the variant only: the real messages rendered above
        upto, before = "", "-"
    if upto.startswith(before):
        return upto[len(before):]
    raise NotPrefixStable(f"message {k} (assistant): the template renders the messages before it differently "
                          "once it is added, with or without their reasoning")


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _splice_reasoning(renderings: Renderings, k: int, turn: str) -> str | None:
    """`turn` with the message's reasoning put where the template's open-chain branch puts it, or
    None when that branch does not render it either (see the module's second case)."""
    message = renderings.messages[k]
    head = prompt(renderings, k)
    probed = {**message, "tool_calls": [*(message.get("tool_calls") or []), PROBE_CALL]}
    context = renderings.messages[:k]
    try:
        with_reasoning = renderings.render([*context, probed], False)
        without = renderings.render([*context, {**probed, REASONING: ""}], False)
    except TemplateRaised:
        return None
    if not (with_reasoning.startswith(head) and without.startswith(head)):
        return None
    full, empty = with_reasoning[len(head):], without[len(head):]
    at, grown = _common_prefix(full, empty), len(full) - len(empty)
    if grown <= 0 or full[at + grown:] != empty[at:] or turn[:at] != empty[:at]:
        return None
    inserted = full[at:at + grown]
    if message[REASONING].strip() not in inserted or PROBE_CALL["function"]["name"] in inserted:
        return None
    return turn[:at] + inserted + turn[at:]


def completion(renderings: Renderings, k: int) -> str:
    """The text the model emitted for assistant message k, as the template renders it."""
    turn = _boundary(renderings, k)
    reasoning = renderings.messages[k].get(REASONING)
    if isinstance(reasoning, str) and reasoning.strip() and reasoning.strip() not in turn:
        turn = _splice_reasoning(renderings, k, turn) or turn
    return turn
