"""A conversation -> the rows hsx.prepare writes for it, in the form `--rows` asks for, each checked.

Owns the choice between the two forms of a sample and the check that decides it:

  packed    one row: the whole conversation, a mask on each assistant message's span
            (masking.py). Right only where the template is append-only for the conversation and
            drops nothing: then the per-turn rows are prefixes of it and say nothing more.
  per-turn  one row per assistant message k, id "ID#turnK" (K the message's index): the prompt
            the model saw for it, then its completion (turns.py), the mask on the completion.

  --rows auto (the default) writes the packed row when the conversation passes both conditions and
  per-turn rows otherwise, reporting why; --rows packed skips such a conversation instead;
  --rows per-turn always writes per-turn rows.

Every row is checked before it is written: the text decoded from the tokens masked for each
assistant message must hold what the message holds (fidelity.py). A row that fails is never
written as if nothing happened: packed falls back to per-turn (auto) or is skipped; a per-turn
row is skipped with a reason naming the message and the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import limits, turns
from .chats import media_part, parse_line
from .fidelity import drop_reason, missing_fields, preview
from .masking import Masker, Renderings, SampleError

ROWS = ("auto", "packed", "per-turn")


@dataclass
class Row:
    sample_id: str | int
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class Skip:
    sample_id: str | int
    reason: str
    detail: str


@dataclass
class Record:
    """A line written as it is instead of a row (a request for an engine, regenerate.py); `tokens` is
    what the summary counts for it."""

    sample_id: str | int
    line: str
    tokens: int = 0


@dataclass
class Outcome:
    """What one conversation gives: rows to write, rows skipped, and why it was not packed (auto).

    `records` are lines written as they are (in place of rows); `kept` are rows written but reported
    and counted by reason (an engine's truncated generation kept by --on-truncated keep)."""

    rows: list[Row] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    split: Skip | None = None
    records: list[Record] = field(default_factory=list)
    kept: list[Skip] = field(default_factory=list)


def _dropped(k: int, fields: list[str], rendered: str) -> Skip:
    return Skip("", drop_reason(fields), f"message {k} (assistant): {', '.join(fields)} not in the tokens masked "
                f"for it (the template renders the turn as {preview(rendered)!r})")


class RowMaker:
    """Turns conversations into checked rows with one Masker (tokenizer and template) and one --rows."""

    def __init__(self, masker: Masker, rows: str = "auto", max_turns: int | None = None,
                 max_seconds: float | None = None):
        """`max_turns` and `max_seconds` bound one conversation (limits.py); None: no bound."""
        if rows not in ROWS:
            raise ValueError(f"rows must be one of {ROWS}, not {rows!r}")
        self.masker, self.rows = masker, rows
        self.max_turns, self.max_seconds = max_turns, max_seconds

    def packed(self, renderings: Renderings) -> Row | Skip:
        """The one-row form, or why it would lose something."""
        try:
            text, spans = self.masker.turn_spans(renderings)
            ids, mask, ranges = self.masker.encode_spans(text, [(s, e) for _, s, e in spans])
        except SampleError as error:
            return Skip("", error.reason, str(error))
        covered = {k: self.masker.decode(ids[first:last]) for (k, _, _), (first, last) in zip(spans, ranges)}
        for k, message in enumerate(renderings.messages):
            if message["role"] == "assistant":
                missing = missing_fields(message, covered.get(k, ""))
                if missing:
                    return _dropped(k, missing, covered.get(k, ""))
        return Row("", ids, mask)

    def turn(self, renderings: Renderings, k: int) -> Row | Skip:
        """Assistant message k's row at its generation boundary, or why it cannot be written."""
        try:
            head = self.masker.tokens(turns.prompt(renderings, k))
            tail = self.masker.tokens(turns.completion(renderings, k))
        except SampleError as error:
            return Skip("", error.reason, str(error))
        written = self.masker.decode(tail)
        missing = missing_fields(renderings.messages[k], written)
        if missing:
            return _dropped(k, missing, written)
        return Row("", head + tail, [0] * len(head) + [1] * len(tail))

    def per_turn(self, renderings: Renderings, sample_id) -> Outcome:
        outcome = Outcome()
        for k, message in enumerate(renderings.messages):
            if message["role"] != "assistant":
                continue
            result = self.turn(renderings, k)
            result.sample_id = f"{sample_id}#turn{k}"
            (outcome.rows if isinstance(result, Row) else outcome.skips).append(result)
        return outcome

    def line(self, text: str) -> Outcome:
        """One chat JSONL line's rows (raises chats.InputError for a line that is not a conversation)."""
        conversation = parse_line(text)
        sid, count = conversation.sample_id, len(conversation.messages)
        if self.max_turns is not None and count > self.max_turns:
            return Outcome(skips=[Skip(sid, "over --max-turns", f"{count} messages, over --max-turns {self.max_turns}")])
        media = media_part(conversation.messages)
        if media is not None:
            return Outcome(skips=[Skip(conversation.sample_id, "media content",
                                       f"{media}; hsx extracts text only (drafts are trained on text)")])
        if not conversation.has_assistant():
            return Outcome(skips=[Skip(conversation.sample_id, "no assistant turn",
                                       "the conversation has no assistant message")])
        try:
            with limits.deadline(self.max_seconds):
                return self(conversation)
        except limits.OverTime:
            return Outcome(skips=[Skip(sid, "over --max-seconds-per-conversation", "not rendered and tokenized "
                                       f"within --max-seconds-per-conversation {self.max_seconds:g}")])

    def __call__(self, conversation: Any) -> Outcome:
        renderings = Renderings(self.masker, conversation.messages, conversation.tools)
        sid = conversation.sample_id
        if self.rows == "per-turn":
            return self.per_turn(renderings, sid)
        packed = self.packed(renderings)
        packed.sample_id = sid
        if isinstance(packed, Row):
            return Outcome(rows=[packed])
        if self.rows == "packed":
            return Outcome(skips=[packed])
        outcome = self.per_turn(renderings, sid)
        outcome.split = packed
        return outcome
