"""The bounds hsx.prepare puts on one conversation: its defaults and the per-conversation clock.

Owns what keeps one hostile line from taking the run's memory or time (issue 45, item 3):

  --max-line-bytes N    an input line longer than N bytes (its newline not counted) stops the run
                        with FILE:LINE; it is never read whole (run.py reads lines in bounded pieces)
  --max-turns N         a conversation of more than N messages is skipped and reported (an error
                        under --strict): rendering it costs time quadratic in its messages (each
                        assistant turn renders the whole prefix before it, twice)
  --max-seconds-per-conversation S
                        rendering and tokenizing one conversation taking longer is stopped, and the
                        conversation skipped and reported (an error under --strict)

The clock is SIGALRM (signal.setitimer): its handler raises OverTime in the main thread at the next
Python instruction, which stops a Jinja template in any loop (Jinja runs as Python code). A call
into native code (the Rust tokenizer encoding one text) is not interrupted: OverTime is raised
when it returns. Those calls are bounded by the line limit instead (one 8 MiB text: seconds).
OverTime is a BaseException so that the `except Exception` around a template's rendering (its
own errors) does not take it for the template's.
"""

from __future__ import annotations

import contextlib
import signal
import threading

# 8 MiB: a conversation filling a 256k-token context (the largest of the models hsx serves) is at
# most about 3 MiB of JSON even when every character is a \uXXXX escape (6 bytes, about 2 per
# token for CJK text, 12 bytes for an emoji's surrogate pair); 8 MiB leaves room for tool
# schemas and duplicated reasoning, and bounds one line's cost (a line is held several times
# over: bytes, text, parsed JSON, renderings, token offsets).
MAX_LINE_BYTES = 8 << 20
# 1024 messages: far over real conversations (agent traces of a few hundred steps); 2,000 messages
# take 34 s on the fixture template (docs/prepare.md, Memory and speed), 1024 about 9 s.
MAX_TURNS = 1024
# 120 s: 1024 messages with a real template take tens of seconds; a template that never ends
# costs at most this per line.
MAX_SECONDS = 120.0


class OverTime(BaseException):
    """The conversation's --max-seconds-per-conversation ran out."""


def _raise(signum, frame):
    raise OverTime()


@contextlib.contextmanager
def deadline(seconds: float | None):
    """Raises OverTime inside the block once `seconds` have passed (wall clock). No limit when
    `seconds` is None or outside the main thread (signals reach the main thread only)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
