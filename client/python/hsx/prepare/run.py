"""The streaming run: chat JSONL in, hsx input JSONL out, resumable, with its report and frequencies.

Owns the files a run writes beside OUTPUT and the rules that keep them whole:

  OUTPUT                      hsx-dump's input: {"input_ids", "loss_mask", "id"} per line
  OUTPUT.report.jsonl         every sample not written as it came: skipped, dropped or truncated
  OUTPUT.freq.json            token frequencies ("hsx-token-frequencies/1")
  OUTPUT.partial              the output while the run lasts
  OUTPUT.report.jsonl.partial the report while the run lasts
  OUTPUT.prepare-state.json   the resume journal: where the input was read up to, the lengths of
                              both partial files at that point, the frequencies and counts so far

Each line becomes rows through a source (rows.RowMaker.line for chat conversations). The input is
read line by line (constant memory whatever its size), each line in pieces: one longer than
--max-line-bytes stops the run at its FILE:LINE without ever being held whole. Every
--checkpoint-every samples read, on an error and at the end, both partial files
are flushed and fsynced and then the journal is replaced atomically (temporary
file, fsync, rename). A rerun of the same command after a kill reads the
journal, checks that the input still begins with the bytes it had read
(XXH64) and that the settings are the same, cuts both partial files back to the
journaled lengths and goes on from the journaled line: the final files are byte
for byte those of an uninterrupted run. At the end the frequencies and the
report are put in place, then OUTPUT (renamed from OUTPUT.partial), then the
journal is removed: OUTPUT exists only whole.

A write that fails (a full disk: ENOSPC) stops the run with an error naming the file; the journal
then still describes the last checkpoint, so freeing space and rerunning continues from it. No
temporary file (NAME.tmp.PID) outlives the run, failed or not.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .chats import InputError
from .masking import PrepareError, TemplateRaised

STATE_FORMAT = "hsx-prepare-state/1"
FREQ_FORMAT = "hsx-token-frequencies/1"
ON_LONG = ("truncate", "drop", "error")


@dataclass
class Options:
    input: Path
    output: Path
    max_tokens: int | None = None
    on_long: str = "truncate"
    shard: tuple[int, int] = (0, 1)
    strict: bool = False
    count_all_tokens: bool = False
    checkpoint_every: int = 1000
    progress: bool = True
    max_line_bytes: int | None = None  # None: no limit (limits.MAX_LINE_BYTES is the command line's default)


@dataclass
class Stats:
    written: int = 0
    tokens: int = 0
    masked: int = 0
    truncated: int = 0
    dropped: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    lines: int = 0  # input lines of this shard that held a sample
    per_turn: dict[str, int] = field(default_factory=dict)  # conversations written per turn, by why
    kept: dict[str, int] = field(default_factory=dict)  # rows written but reported (Outcome.kept), by why


class Paths:
    def __init__(self, output: Path):
        self.output = output
        self.partial = Path(f"{output}.partial")
        self.report = Path(f"{output}.report.jsonl")
        self.report_partial = Path(f"{output}.report.jsonl.partial")
        self.freq = Path(f"{output}.freq.json")
        self.state = Path(f"{output}.prepare-state.json")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path.parent if str(path.parent) else ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = Path(f"{path}.tmp.{os.getpid()}")
    try:
        with _writing(path), open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:  # never left behind, whatever failed (a full disk, an interrupt)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(path)


class DiskError(PrepareError):
    """A write to one of the run's files failed; `path` is that file."""

    def __init__(self, path: Path, error: OSError):
        what = (error.strerror or str(error)).rstrip(".")
        super().__init__(f"{path}: {what[:1].lower()}{what[1:]}")
        self.path, self.errno = path, error.errno


@contextlib.contextmanager
def _writing(path: Path):
    """Names `path` in an OSError raised inside (a file object's write or fsync names no file)."""
    try:
        yield
    except OSError as error:
        raise DiskError(path, error) from None


class Run:
    """One run over one input file (one shard of it), from start or from a journal."""

    def __init__(self, options: Options, source, settings: dict[str, Any], vocab_size: int | None,
                 trailer=None, frequencies: bool = True):
        """`source` turns one input line's text into an Outcome (rows.py), raising InputError or
        TemplateRaised for a line that stops the run (RowMaker.line for chat conversations).
        `trailer()`, when given, returns an Outcome of skips reported after the last line (requests an
        engine never answered, regenerate.py); `frequencies` False writes no OUTPUT.freq.json (an
        output of requests, not of rows)."""
        self.o, self.source, self.vocab_size = options, source, vocab_size
        self.trailer, self.write_frequencies = trailer, frequencies
        self.settings = settings
        self.paths = Paths(options.output)
        self.stats = Stats()
        self.counts: Counter = Counter()
        self.offset = 0  # input bytes consumed
        self.line = 0  # input lines consumed (1-based number of the last one)
        self.hasher = xxhash.xxh64()
        self.finished = False

    # -- the journal -------------------------------------------------------------------------------

    def _state(self, out_bytes: int, report_bytes: int) -> dict[str, Any]:
        s = self.stats
        return {"format": STATE_FORMAT, "settings": self.settings, "input_offset": self.offset,
                "input_line": self.line, "input_xxh64": self.hasher.hexdigest(), "output_bytes": out_bytes,
                "report_bytes": report_bytes, "finished": self.finished,
                "stats": {"written": s.written, "tokens": s.tokens, "masked": s.masked, "truncated": s.truncated,
                          "dropped": s.dropped, "skipped": s.skipped, "lines": s.lines,
                          "per_turn": s.per_turn, "kept": s.kept},
                "counts": sorted(self.counts.items())}

    def _checkpoint(self, out, report) -> None:
        for f, path in ((out, self.paths.partial), (report, self.paths.report_partial)):
            with _writing(path):
                f.flush()
                os.fsync(f.fileno())
        _write_atomic(self.paths.state, json.dumps(self._state(out.tell(), report.tell())))

    def _load(self) -> tuple[int, int]:
        where = self.paths.state
        try:
            state = json.loads(where.read_text(encoding="utf-8"))
            if state.get("format") != STATE_FORMAT:
                raise ValueError(f"format {state.get('format')!r}")
        except (OSError, ValueError) as error:
            raise PrepareError(f"{where}: unreadable resume journal ({error}); remove it and "
                               f"{self.paths.partial} to start over") from None
        if state["settings"] != self.settings:
            differ = sorted(k for k in set(state["settings"]) | set(self.settings)
                            if state["settings"].get(k) != self.settings.get(k))
            raise PrepareError(f"{where}: an interrupted run with other settings ({', '.join(differ)}) is "
                               f"pending; rerun it with the same flags, or remove {where} and "
                               f"{self.paths.partial} to start over")
        self.offset, self.line = state["input_offset"], state["input_line"]
        self.finished = state["finished"]
        st = state["stats"]
        self.stats = Stats(st["written"], st["tokens"], st["masked"], st["truncated"], st["dropped"],
                           dict(st["skipped"]), st["lines"], dict(st["per_turn"]), dict(st.get("kept", {})))
        self.counts = Counter({int(t): n for t, n in state["counts"]})
        self._check_input_prefix(state["input_xxh64"])
        return state["output_bytes"], state["report_bytes"]

    def _check_input_prefix(self, expected: str) -> None:
        left = self.offset
        with open(self.o.input, "rb") as f:
            while left:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                self.hasher.update(chunk)
                left -= len(chunk)
        if left or self.hasher.hexdigest() != expected:
            raise PrepareError(f"{self.o.input}: its first {self.offset} bytes are not those the interrupted run "
                               f"read (journal {self.paths.state}); remove the journal and "
                               f"{self.paths.partial} to start over")

    @staticmethod
    def _cut(path: Path, size: int) -> None:
        if not path.exists() or path.stat().st_size < size:
            raise PrepareError(f"{path}: shorter than its resume journal says ({size} bytes); remove the "
                               "journal and the .partial files to start over")
        os.truncate(path, size)

    def _open(self) -> tuple[int, int]:
        p = self.paths
        for kept in (p.state, p.freq):  # a killed run's temporaries (NAME.tmp.PID): never read, only removed
            for stale in kept.parent.glob(f"{kept.name}.tmp.*"):
                if stale.name[len(kept.name) + 5:].isdigit():
                    stale.unlink(missing_ok=True)
        if p.state.exists():
            out_bytes, report_bytes = self._load()
            if not self.finished:
                self._cut(p.partial, out_bytes)
                self._cut(p.report_partial, report_bytes)
            return out_bytes, report_bytes
        if p.output.exists():
            raise PrepareError(f"{p.output}: exists; remove it (and {p.report.name}, {p.freq.name}) to prepare "
                               "it again")
        for path in (p.partial, p.report_partial):
            path.write_bytes(b"")
        _write_atomic(p.state, json.dumps(self._state(0, 0)))
        return 0, 0

    # -- one sample --------------------------------------------------------------------------------

    def _where(self, line: int | None) -> str:
        return f"{self.o.input}:{line}" if line is not None else str(self.o.input)

    def _skip(self, report, line, sample_id, reason, detail) -> None:
        if self.o.strict:
            raise PrepareError(f"{self._where(line)}: {detail} (--strict)")
        self.stats.skipped[reason] = self.stats.skipped.get(reason, 0) + 1
        self._report(report, line, sample_id, "skipped", reason, detail=detail)

    @staticmethod
    def _report(report, line, sample_id, action, reason, **more) -> None:
        entry = {"line": line, "id": sample_id, "action": action, "reason": reason, **more}
        with _writing(Path(report.name)):
            report.write((json.dumps(entry) + "\n").encode("ascii"))

    def _sample(self, raw: bytes, line: int, out, report) -> None:
        try:
            outcome = self.source(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise PrepareError(f"{self._where(line)}: not UTF-8 (byte {error.start})") from None
        except InputError as error:
            raise PrepareError(f"{self._where(line)}: {error}") from None
        except TemplateRaised as error:
            raise PrepareError(f"{self._where(line)}: the chat template raised: {error}") from None
        self._refuse_first(line, outcome)
        if outcome.split is not None:
            split = outcome.split
            self.stats.per_turn[split.reason] = self.stats.per_turn.get(split.reason, 0) + 1
            self._report(report, line, split.sample_id, "per-turn", split.reason, detail=split.detail,
                         rows=len(outcome.rows))
        for skip in outcome.skips:
            self._skip(report, line, skip.sample_id, skip.reason, skip.detail)
        for note in outcome.kept:
            self.stats.kept[note.reason] = self.stats.kept.get(note.reason, 0) + 1
            self._report(report, line, note.sample_id, "kept", note.reason, detail=note.detail)
        for row in outcome.rows:
            self._write(out, report, line, row)
        for record in outcome.records:
            with _writing(Path(out.name)):
                out.write((record.line + "\n").encode("utf-8"))
            self.stats.written += 1
            self.stats.tokens += record.tokens
        return None

    def _refuse_first(self, line, outcome) -> None:
        """Raises what would stop the run at this line before any of its rows is written, so that
        the partial files hold whole lines only (a rerun starts the line again)."""
        if self.o.strict and outcome.skips:
            skip = outcome.skips[0]
            raise PrepareError(f"{self._where(line)}: {skip.detail} (--strict)")
        limit = self.o.max_tokens
        if self.o.on_long == "error" and limit is not None:
            for row in outcome.rows:
                if len(row.input_ids) > limit:
                    raise PrepareError(f"{self._where(line)}: {len(row.input_ids)} tokens, over --max-tokens "
                                       f"{limit} (--on-long error)")

    def _write(self, out, report, line, row) -> None:
        sid = row.sample_id
        ids, mask = self._fit(report, line, sid, row.input_ids, row.loss_mask)
        if ids is None:
            return
        if not any(mask):
            self._skip(report, line, sid, "no assistant token", "the assistant messages render to no characters")
            return
        with _writing(Path(out.name)):
            out.write((json.dumps({"input_ids": ids, "loss_mask": mask, "id": sid}, separators=(",", ":"))
                       + "\n").encode("ascii"))
        counted = ids if self.o.count_all_tokens else [t for t, m in zip(ids, mask) if m]
        self.counts.update(counted)
        self.stats.written += 1
        self.stats.tokens += len(ids)
        self.stats.masked += sum(mask)

    def _fit(self, report, line, sid, ids, mask):
        """--max-tokens: the sample as written, or (None, None) when it is dropped (and reported)."""
        limit = self.o.max_tokens
        if limit is None or len(ids) <= limit:
            return ids, mask
        if self.o.on_long == "error":
            raise PrepareError(f"{self._where(line)}: {len(ids)} tokens, over --max-tokens {limit} "
                               "(--on-long error)")
        if self.o.on_long == "drop":
            self.stats.dropped += 1
            self._report(report, line, sid, "dropped", "over --max-tokens", tokens=len(ids), max_tokens=limit)
            return None, None
        if not any(mask[:limit]):
            self.stats.dropped += 1
            self._report(report, line, sid, "dropped", "no assistant token within --max-tokens",
                         tokens=len(ids), max_tokens=limit)
            return None, None
        self.stats.truncated += 1
        self._report(report, line, sid, "truncated", "over --max-tokens", tokens=len(ids), max_tokens=limit,
                     kept=limit)
        return ids[:limit], mask[:limit]

    # -- the run -----------------------------------------------------------------------------------

    def _progress(self, total: int):
        if not self.o.progress:
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            raise PrepareError("the progress bar needs tqdm: pip install 'hsx[prepare]', or pass "
                               "--no-progress") from None
        return tqdm(total=total, initial=self.offset, unit="B", unit_scale=True, desc="hsx.prepare",
                    disable=None, dynamic_ncols=True)

    def _read_line(self, source, line: int, mine: bool) -> tuple[bytes | None, int]:
        """The next line's bytes (newline included; b"" at the end) and its length, or (None, length)
        for a line of another shard longer than --max-line-bytes (hashed here in pieces). A line of
        this shard over the limit raises: it is never held whole."""
        limit = self.o.max_line_bytes
        raw = source.readline() if limit is None else source.readline(limit + 1)
        if limit is None or len(raw) <= limit or raw.endswith(b"\n"):
            return raw, len(raw)
        if mine:
            size, ended = self._read_rest(source, lambda piece: None)
            raise PrepareError(f"{self._where(line)}: {len(raw) + size - ended} bytes, over --max-line-bytes {limit}")
        self.hasher.update(raw)
        size, _ = self._read_rest(source, self.hasher.update)
        return None, len(raw) + size

    @staticmethod
    def _read_rest(source, update) -> tuple[int, int]:
        """Reads to the end of the line in pieces, passing each to `update`: (bytes read, 1 if they
        end with the newline else 0)."""
        size = 0
        while True:
            piece = source.readline(1 << 20)
            update(piece)
            size += len(piece)
            if not piece or piece.endswith(b"\n"):
                return size, int(piece.endswith(b"\n"))

    def _loop(self, out, report) -> None:
        index, count = self.o.shard
        bar = self._progress(os.path.getsize(self.o.input))
        since = 0
        with open(self.o.input, "rb") as source:
            source.seek(self.offset)
            while True:
                line = self.line + 1
                mine = (line - 1) % count == index
                try:
                    raw, size = self._read_line(source, line, mine)
                    if raw == b"":
                        break
                    if mine and raw.strip():
                        self._sample(raw, line, out, report)
                        self.stats.lines += 1
                        since += 1
                except DiskError:  # the files' state is unknown: the last checkpoint stands
                    raise
                except (PrepareError, KeyboardInterrupt):
                    self._checkpoint(out, report)  # everything before this line is kept for a rerun
                    raise
                self.line, self.offset = line, self.offset + size
                if raw is not None:
                    self.hasher.update(raw)
                if bar is not None:
                    bar.update(size)
                if since >= self.o.checkpoint_every:
                    self._checkpoint(out, report)
                    since = 0
        if self.trailer is not None:
            # Journaled first and not after: a rerun after an error or a kill here cuts the report back
            # to this point and reports the trailer's lines once.
            self._checkpoint(out, report)
            for skip in self.trailer().skips:
                self._skip(report, None, skip.sample_id, skip.reason, skip.detail)
        if bar is not None:
            bar.close()
        self.finished = True
        self._checkpoint(out, report)

    def frequencies(self) -> dict[str, Any]:
        return {"format": FREQ_FORMAT, "vocab_size": self.vocab_size,
                "scope": "all" if self.o.count_all_tokens else "assistant", "samples": self.stats.written,
                "tokens": sum(self.counts.values()), "counts": [[t, n] for t, n in sorted(self.counts.items())]}

    def _finish(self) -> None:
        p = self.paths
        if self.write_frequencies:
            _write_atomic(p.freq, json.dumps(self.frequencies(), separators=(",", ":")) + "\n")
        if p.report_partial.exists():
            os.replace(p.report_partial, p.report)
        if p.partial.exists():
            os.replace(p.partial, p.output)
        _fsync_dir(p.output)
        p.state.unlink()
        _fsync_dir(p.output)

    def run(self) -> Stats:
        """Runs to the end; a failed write (a full disk) becomes a PrepareError naming the file."""
        try:
            return self._run()
        except (OSError, DiskError) as error:
            if isinstance(error, OSError):  # closing a file whose write failed raises once more
                context = error.__context__
                error = context if isinstance(context, DiskError) else DiskError(
                    Path(error.filename) if error.filename else self.paths.output, error)
            full = error.errno in (errno.ENOSPC, errno.EDQUOT)
            raise PrepareError(f"{error} (after {self._where(self.line or None)}); the work up to the last checkpoint is "
                               f"kept: {'free space and ' if full else ''}rerun the same command to continue") from None

    def _run(self) -> Stats:
        out_bytes, report_bytes = self._open()
        if not self.finished:
            with open(self.paths.partial, "r+b") as out, open(self.paths.report_partial, "r+b") as report:
                out.seek(out_bytes)
                report.seek(report_bytes)
                self._loop(out, report)
        self._finish()
        return self.stats
