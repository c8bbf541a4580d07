"""Regeneration: chat conversations -> requests for an engine, and the engine's outputs -> hsx rows.

Owns the two line sources the resumable run (run.py) drives for `python -m hsx.prepare requests`
and `... responses`, and the rules that tie an output back to its request:

  requests   one request per turn to regenerate, id "ID#turnK": K is the index the assistant
             message has (or would have) in the conversation, as in per-turn rows (rows.py). The
             turns are every assistant message's index, and len(messages) when the conversation
             ends with a user or tool message (the answer it waits for); --turns last keeps the
             last of them. The prompt is turns.prompt()'s text (messages[:K] with the generation
             prompt) tokenized as apply_chat_template(..., tokenize=True) does; the context is the
             conversation's own earlier messages, never earlier regenerated answers.
  responses  one row per answered request: the prompt ids, then the generated ids, masked on the
             generated ids only. The ids are the engine's own; none is re-tokenized. The prompt ids
             are the ones the engine reports, checked against the request's (a difference is an
             error naming both files and lines). A chat completion that carries no ids is rendered
             instead: its text, reasoning and tool calls become the assistant message after the
             request's messages, written as a per-turn row (RowMaker.turn, checked the same way).

Every request is accounted for: an engine error, a generation the engine cut at the token limit
(finish_reason "length", kept or dropped by --on-truncated) and a request no output line answers
are reported and counted; a line that is not the engine's format is an error naming FILE:LINE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import xxhash

from . import turns
from .chats import InputError, media_part, parse_line
from .engines import CHAT, COMPLETIONS, Reply, Request, Sampling, read_reply, read_request, reply_id, request_id
from .engines import sglang_generate, vllm_chat, vllm_completion
from .masking import Masker, PrepareError, Renderings, SampleError
from .rows import Outcome, Record, Row, RowMaker, Skip

TURNS = ("all", "last")
ON_TRUNCATED = ("keep", "drop")
TRUNCATED = "generation truncated (finish_reason length)"


def load_json(text: str | bytes) -> Any:
    """One JSONL line's value; InputError worded as chats.parse_line words it."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InputError(f"not UTF-8 (byte {error.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"not valid JSON ({error.msg} at column {error.colno})") from None


def positions(messages: list[dict[str, Any]]) -> list[int]:
    """The indexes of the turns to regenerate (see the module's first docstring)."""
    found = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
    if messages and messages[-1]["role"] in ("user", "tool"):
        found.append(len(messages))
    return found


def _clean(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a chat request carries them: None-valued fields dropped, as transformers does."""
    return [{key: value for key, value in m.items() if value is not None} for m in messages]


class RequestMaker:
    """Conversations -> one engine's request lines (a run.Run source)."""

    def __init__(self, masker: Masker, engine: str, sampling: Sampling, turns_: str = "all",
                 url: str = COMPLETIONS, served_model: str | None = None):
        self.masker, self.engine, self.sampling, self.turns = masker, engine, sampling, turns_
        self.url, self.served_model = url, served_model

    def _request(self, cid: str, ids: list[int], renderings: Renderings, k: int) -> dict[str, Any]:
        if self.engine == "sglang":
            return sglang_generate(cid, ids, self.sampling)
        if self.url == CHAT:
            return vllm_chat(cid, _clean(renderings.messages[:k]), renderings.tools, self.masker.template_kwargs,
                             self.sampling, self.served_model)
        return vllm_completion(cid, ids, self.sampling, self.served_model)

    def line(self, text: str) -> Outcome:
        conversation = parse_line(text)
        sid = conversation.sample_id
        media = media_part(conversation.messages)
        if media is not None:
            return Outcome(skips=[Skip(sid, "media content", f"{media}; hsx extracts text only")])
        ks = positions(conversation.messages)
        if not ks:
            return Outcome(skips=[Skip(sid, "no turn to regenerate", "no assistant message, and the last "
                                       "message is not from the user or a tool")])
        if self.turns == "last":
            ks = ks[-1:]
        renderings = Renderings(self.masker, conversation.messages, conversation.tools)
        outcome = Outcome()
        for k in ks:
            cid = f"{sid}#turn{k}"
            try:
                ids = self.masker.tokens(turns.prompt(renderings, k))
            except SampleError as error:
                outcome.skips.append(Skip(cid, error.reason, str(error)))
                continue
            line = json.dumps(self._request(cid, ids, renderings, k), separators=(",", ":"))
            outcome.records.append(Record(cid, line, len(ids)))
        return outcome


class RequestIndex:
    """Where each request of a requests file is (byte offset and line), read once; a request is
    parsed again when its answer comes."""

    def __init__(self, path: Path, engine: str):
        self.path, self.engine = Path(path), engine
        self.where: dict[str, tuple[int, int]] = {}
        hasher, offset = xxhash.xxh64(), 0
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, 1):
                hasher.update(raw)
                if raw.strip():
                    try:
                        cid = request_id(engine, load_json(raw))
                    except InputError as error:
                        raise PrepareError(f"{self.path}:{number}: {error}") from None
                    if cid in self.where:
                        raise PrepareError(f"{self.path}:{number}: the id {cid!r} again (first at line "
                                           f"{self.where[cid][1]}); each request needs its own id")
                    self.where[cid] = (offset, number)
                offset += len(raw)
        self.digest = hasher.hexdigest()

    def get(self, cid: str) -> tuple[Request, int]:
        if cid not in self.where:
            raise InputError(f"answers {cid!r}, which is not a request of {self.path}")
        offset, number = self.where[cid]
        with open(self.path, "rb") as f:
            f.seek(offset)
            raw = f.readline()
        try:
            return read_request(self.engine, load_json(raw)), number
        except InputError as error:
            raise PrepareError(f"{self.path}:{number}: {error}") from None


def answered(path: Path, engine: str) -> dict[str, int]:
    """Each request id an output file answers -> its line; a second answer is an error. A line that
    names no id is passed over here: the run stops at it, keeping the lines before (run.py)."""
    seen: dict[str, int] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                cid = reply_id(engine, load_json(raw))
            except InputError:
                continue
            if cid is None:
                continue
            if cid in seen:
                raise PrepareError(f"{path}:{number}: a second answer to {cid!r} (the first is line {seen[cid]})")
            seen[cid] = number
    return seen


def _differ(ours: list[int], theirs: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    a = ours[at] if at < len(ours) else "end"
    b = theirs[at] if at < len(theirs) else "end"
    return f"at position {at} ({b} here, {a} there; {len(theirs)} and {len(ours)} ids)"


class ReplyReader:
    """An engine's output lines -> rows (a run.Run source); `missing` is the run's trailer."""

    def __init__(self, engine: str, index: RequestIndex, outputs: Path, maskers, vocab_size: int,
                 on_truncated: str = "keep"):
        """`maskers(template_args)` gives the Masker for a chat request's template arguments."""
        self.engine, self.index, self.outputs, self.maskers = engine, index, Path(outputs), maskers
        self.vocab_size, self.on_truncated = vocab_size, on_truncated
        self.answered = answered(self.outputs, engine)

    def missing(self) -> Outcome:
        """The requests no output line answers."""
        return Outcome(skips=[Skip(cid, "no response", f"{self.index.path}:{number}: no line of {self.outputs} "
                                   "answers this request") for cid, (_, number) in self.index.where.items()
                              if cid not in self.answered])

    def _in_vocab(self, ids: list[int], what: str) -> None:
        top = max(ids, default=-1)
        if top >= self.vocab_size:
            raise InputError(f"{what} holds token id {top}, not below the model's vocab_size {self.vocab_size} "
                             "(was it generated by another model than --model?)")

    def _chat_prompt(self, request: Request) -> list[int]:
        masker = self.maskers(request.template_args)
        renderings = Renderings(masker, request.messages, request.tools)
        return masker.tokens(turns.prompt(renderings, len(request.messages)))

    def _prompt(self, reply: Reply, request: Request, number: int) -> list[int]:
        """The row's prompt ids: the engine's, checked against the request's."""
        ours = self._chat_prompt(request) if request.url == CHAT else request.prompt_ids
        there = f"the request ({self.index.path}:{number})"
        if reply.prompt_ids is not None and reply.prompt_ids != ours:
            source = "the template's rendering of the messages of " if request.url == CHAT else ""
            raise InputError(f"the engine's prompt ids differ from {source}{there} {_differ(ours, reply.prompt_ids)}")
        if reply.prompt_tokens is not None and reply.prompt_tokens != len(ours):
            raise InputError(f"meta_info.prompt_tokens is {reply.prompt_tokens}, but {there} has {len(ours)} "
                             "prompt ids")
        return reply.prompt_ids if reply.prompt_ids is not None else ours

    def _rendered(self, reply: Reply, request: Request) -> Row | Skip:
        """A chat completion without ids: its message rendered after the request's messages."""
        message = reply.message
        assistant: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            assistant["reasoning_content"] = reasoning
        if message.get("tool_calls"):
            assistant["tool_calls"] = message["tool_calls"]
        masker = self.maskers(request.template_args)
        renderings = Renderings(masker, [*request.messages, assistant], request.tools)
        return RowMaker(masker, "per-turn").turn(renderings, len(request.messages))

    def _row(self, reply: Reply, request: Request, number: int) -> Row | Skip:
        expected = "generate" if self.engine == "sglang" else request.url
        if reply.endpoint != expected:
            raise InputError(f"answers a {expected} request ({self.index.path}:{number}) with a {reply.endpoint} "
                             "response")
        prompt = self._prompt(reply, request, number)
        if reply.ids is None:
            if reply.endpoint != CHAT:
                raise InputError("no generated token ids (choices[0].token_ids); the request asks for them with "
                                 "return_token_ids, which vLLM answers from 0.10.2 on")
            return self._rendered(reply, request)
        self._in_vocab(prompt, "the prompt")
        self._in_vocab(reply.ids, "the generated ids")
        return Row("", prompt + reply.ids, [0] * len(prompt) + [1] * len(reply.ids))

    def line(self, text: str) -> Outcome:
        reply = read_reply(self.engine, load_json(text))
        if reply.custom_id is None:
            return Outcome(skips=[Skip(None, "engine error", f"{reply.error} (the line names no request)")])
        request, number = self.index.get(reply.custom_id)
        cid = reply.custom_id
        if reply.error is not None:
            return Outcome(skips=[Skip(cid, "engine error", reply.error)])
        result = self._row(reply, request, number)
        result.sample_id = cid
        if isinstance(result, Skip):
            return Outcome(skips=[result])
        if reply.finish != "length":
            return Outcome(rows=[result])
        note = Skip(cid, TRUNCATED, f"the engine stopped at its token limit ({sum(result.loss_mask)} generated "
                    f"tokens); --on-truncated {self.on_truncated}")
        if self.on_truncated == "drop":
            return Outcome(skips=[note])
        return Outcome(rows=[result], kept=[note])
