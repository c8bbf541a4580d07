"""A conversation -> input_ids and the assistant-only loss mask, with the model's own tokenizer.

Owns loading the tokenizer and chat template from a local model directory and
the mask rule:

  The text is the chat template's rendering of the whole conversation (no
  generation prompt). For each assistant message k, the template renders the
  messages before it with the generation prompt (P_k) and the messages up to and
  including it without (Q_k). The characters Q_k adds to P_k are that message's
  span: what the model writes for that turn (content, thinking, tool calls, the
  end-of-turn token), not the header the template opens the turn with. A token
  is masked (1) when its characters overlap a span, the rule transformers'
  apply_chat_template(..., return_assistant_tokens_mask=True) applies to
  {% generation %} blocks, so on a template whose generation blocks cover
  exactly those characters both masks are equal.

  This needs a template that renders earlier turns the same way whatever
  follows: the full text must start with Q_k, and Q_k with P_k. A conversation
  where it does not (a template that rewrites history, e.g. drops the reasoning
  of earlier turns once a later turn exists) raises NotPrefixStable naming the
  message; it is never masked by guesswork.

Fast tokenizers give character offsets. Slow ones (e.g. tiktoken-based, loaded
with trust_remote_code) do not: there each span boundary must fall between two
tokens (the tokens of the text before it are a prefix of the whole text's
tokens), or the conversation is refused with SpanSplitsToken.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


class PrepareError(RuntimeError):
    """An error that stops the run; the message is complete (names the file, line or flag)."""


class SampleError(ValueError):
    """A conversation this template and tokenizer cannot turn into a sample; `reason` is a short key."""

    reason = "unusable"


class NotPrefixStable(SampleError):
    reason = "template not prefix-stable"


class SpanSplitsToken(SampleError):
    reason = "span boundary inside a token"


class TemplateRaised(RuntimeError):
    """The chat template raised while rendering this conversation."""


def _import_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory only, never the network
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import transformers
    except ImportError as error:
        raise PrepareError(f"hsx.prepare needs transformers ({error}); install it with: "
                           "pip install 'hsx[prepare]'") from None
    return transformers


def _remote_code_files(model_dir: Path) -> list[str]:
    """The tokenizer's custom code files when tokenizer_config.json maps AutoTokenizer to one."""
    config = model_dir / "tokenizer_config.json"
    try:
        auto_map = json.loads(config.read_text(encoding="utf-8")).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return []
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    names = entry if isinstance(entry, list) else [entry]
    files = {n.split(".")[0] + ".py" for n in names if isinstance(n, str) and "--" not in n}
    return sorted(files) or (["(auto_map)"] if entry else [])


def load_tokenizer(model_dir: str | os.PathLike, trust_remote_code: bool = False,
                   chat_template: str | None = None):
    """The model directory's tokenizer, with `chat_template` (text) in place of its own if given."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise PrepareError(f"{model_dir}: not a directory (--model takes a local model directory)")
    custom = _remote_code_files(model_dir)
    if custom and not trust_remote_code:
        raise PrepareError(f"{model_dir}: the tokenizer is custom code ({', '.join(custom)}); pass "
                           "--trust-remote-code to run it (it executes Python from that directory)")
    transformers = _import_transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as error:  # transformers raises many kinds; all mean "cannot load"
        raise PrepareError(f"{model_dir}: cannot load the tokenizer: {type(error).__name__}: {error}") from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not isinstance(getattr(tokenizer, "chat_template", None), str) or not tokenizer.chat_template:
        raise PrepareError(f"{model_dir}: the tokenizer has no chat template (chat_template.jinja or "
                           "tokenizer_config.json); pass --chat-template FILE")
    return tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides the output: the chat template, the vocabulary size and the class."""
    text = json.dumps([tokenizer.chat_template, len(tokenizer), type(tokenizer).__name__])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def overlap_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters [start, end) overlap a span, 0 elsewhere.

    The vectorised form of transformers' loop (one pass, the span index only moving forward): a
    token's span is the first one ending after the largest start seen so far, and the token is
    masked when it ends after that span begins.
    """
    import numpy as np

    if not spans or not len(offsets):
        return [0] * len(offsets)
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = np.asarray(spans, dtype=np.int64).T
    seen = np.maximum.accumulate(bounds[:, 0])
    index = np.searchsorted(ends, seen, side="right")
    inside = index < len(ends)
    mask = np.zeros(len(bounds), dtype=np.int64)
    mask[inside] = bounds[inside, 1] > starts[index[inside]]
    return mask.tolist()


def overlapping_tokens(offsets, spans) -> list[tuple[int, int]]:
    """For each span, the [first, last) range of tokens whose characters overlap it ((0, 0) if none)."""
    import numpy as np

    if not len(offsets):
        return [(0, 0)] * len(spans)
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    ranges = []
    for start, end in spans:
        (inside,) = np.nonzero((bounds[:, 1] > start) & (bounds[:, 0] < end))
        ranges.append((int(inside[0]), int(inside[-1]) + 1) if len(inside) else (0, 0))
    return ranges


class Masker:
    """Renders conversations with one tokenizer's template and returns (input_ids, loss_mask)."""

    def __init__(self, tokenizer, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.fast = bool(getattr(tokenizer, "is_fast", False))

    def render(self, messages, tools, add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                **self.template_kwargs)
        except Exception as error:  # the template's own exceptions (jinja2, raise_exception, ...)
            raise TemplateRaised(f"{type(error).__name__}: {error}") from None
        if not isinstance(text, str):
            raise TemplateRaised(f"apply_chat_template returned {type(text).__name__}, not text")
        return text

    def spans(self, messages, tools=None) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text and each assistant message's character span in it."""
        full, turns = self.turn_spans(Renderings(self, messages, tools))
        return full, [(start, end) for _, start, end in turns]

    def turn_spans(self, renderings) -> tuple[str, list[tuple[int, int, int]]]:
        """The whole text and (message index, start, end) of each assistant message's span in it."""
        messages = renderings.messages
        full = renderings.text(len(messages), False)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if k == 0:
                raise NotPrefixStable("message 0 is an assistant message: nothing comes before it to "
                                      "render the turn's header from")
            before, upto = renderings.text(k, True), renderings.text(k + 1, False)
            if not upto.startswith(before):
                raise NotPrefixStable(f"message {k} (assistant): the template renders the messages before it "
                                      "differently once it is added")
            if not full.startswith(upto):
                raise NotPrefixStable(f"message {k} (assistant): the template renders it (or what precedes "
                                      "it) differently once later messages follow")
            if len(upto) > len(before):
                spans.append((k, len(before), len(upto)))
        return full, spans

    def encode(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """Token ids of `text` and the mask: 1 for every token overlapping a span."""
        ids, mask, _ = self.encode_spans(text, spans)
        return ids, mask

    def encode_spans(self, text, spans):
        """Token ids, the mask, and for each span the [first, last) tokens overlapping it."""
        if self.fast:
            encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
            return ids, overlap_mask(offsets, spans), overlapping_tokens(offsets, spans)
        return self._encode_by_prefixes(text, spans)

    def tokens(self, text: str) -> list[int]:
        """`text` tokenized as apply_chat_template(..., tokenize=True) does: no added special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        """The text of `ids`, special tokens included, spaces as they are."""
        try:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except TypeError:  # a remote-code tokenizer without those keywords
            return self.tokenizer.decode(list(ids))

    def _encode_by_prefixes(self, text, spans):
        ids = self.tokens(text)
        mask, ranges = [0] * len(ids), []
        for start, end in spans:
            first, last = self._token_boundary(text, ids, start), self._token_boundary(text, ids, end)
            for token in range(first, last):
                mask[token] = 1
            ranges.append((first, last))
        return ids, mask, ranges

    def _token_boundary(self, text, ids, char):
        prefix = self.tokens(text[:char])
        if ids[:len(prefix)] != prefix:
            raise SpanSplitsToken(f"character {char} (an assistant span's boundary) falls inside a token, "
                                  "and this tokenizer gives no character offsets")
        return len(prefix)

    def __call__(self, conversation) -> tuple[list[int], list[int]]:
        text, spans = self.spans(conversation.messages, conversation.tools)
        return self.encode(text, spans)


class Renderings:
    """One conversation's renderings by one Masker, each made once: the first `end` messages with or
    without the generation prompt (the packed form and the per-turn form share them).

    Kept up to CACHE_CHARS characters in all: every prefix of a conversation of n messages holds
    O(n^2) characters (a 9 MiB line of 200 messages kept 1.1 GB more); past the budget a rendering
    is made again when asked for again (the per-turn form after the packed one: twice the renders)."""

    CACHE_CHARS = 64 << 20

    def __init__(self, masker: Masker, messages, tools):
        self.masker, self.messages, self.tools = masker, messages, tools
        self._texts: dict[tuple[int, bool], str] = {}
        self._chars = 0

    def text(self, end: int, add_generation_prompt: bool) -> str:
        key = (end, add_generation_prompt)
        text = self._texts.get(key)
        if text is None:
            text = self.masker.render(self.messages[:end], self.tools, add_generation_prompt)
            if self._chars + len(text) <= self.CACHE_CHARS:
                self._texts[key] = text
                self._chars += len(text)
        return text

    def render(self, messages, add_generation_prompt: bool) -> str:
        """Another message list (a variant of this conversation's) with the same tools; not kept."""
        return self.masker.render(messages, self.tools, add_generation_prompt)
