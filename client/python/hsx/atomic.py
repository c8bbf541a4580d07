"""hsx.atomic: writing a file so that it is whole under its final name or not there at all,
and the one error a failed write gives (WriteFailed: the final name and the OSError).

hsx.convert and hsx.vocab write through here. A file is written under a temporary name
beside its final one, flushed and fsynced (stage), then renamed over the final name and
its directory fsynced (commit). Any failure removes the temporary. An OSError on the way
(ENOSPC, EDQUOT, EIO: in write, fsync, rename or mkdir) becomes WriteFailed, also when a
serializer hides it: torch.save into a file object answers a failed write with a
RuntimeError ("unexpected pos N vs M", the OSError as its context), and numpy's tofile
with an OSError without errno ("N requested and M written"); both write through a
_Sink here, which keeps the OSError the file really raised.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


class WriteFailed(Exception):
    """A write, fsync or rename of `path` (the final name) failed with `error` (an OSError)."""

    def __init__(self, path: Path, error: OSError):
        super().__init__(f"{path}: {reason(error)}")
        self.path, self.error = path, error
        self.renamed = False  # commit(): the rename was done, the directory's fsync failed


def reason(error: OSError) -> str:
    """The strerror as a clause ("no space left on device"), or the error's text without one."""
    text = error.strerror or str(error) or type(error).__name__
    return text[:1].lower() + text[1:]


class _Sink:
    """What a serializer writes into: the file's write and flush, keeping the OSError behind
    a failure, which the serializer may turn into another exception."""

    def __init__(self, file: Any):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as error:
            self.error = error
            raise


def _cause(error: BaseException, sink: _Sink | None) -> OSError | None:
    """The OSError behind `error`: the one the file raised, else the first with an errno
    in its chain, else `error` itself when it is an OSError."""
    if sink is not None and sink.error is not None:
        return sink.error
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    return error if isinstance(error, OSError) else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stage(final: Path, write: Callable[[_Sink], object], temp: Path) -> int:
    """Writes `temp` (beside `final`) through write(sink), flushes and fsyncs it; returns
    its size. On failure `temp` is gone and an OSError is WriteFailed naming `final`."""
    sink = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(temp, "wb") as f:
            sink = _Sink(f)
            write(sink)
            sink.flush()
            os.fsync(f.fileno())
            return f.tell()
    except BaseException as error:
        _remove(temp)
        cause = _cause(error, sink)
        if cause is None:
            raise
        raise WriteFailed(final, cause) from None


def commit(temp: Path, final: Path) -> None:
    """Renames `temp` over `final` and fsyncs the directory; on failure `temp` is gone
    and an OSError is WriteFailed naming `final`."""
    renamed = False
    try:
        os.replace(temp, final)
        renamed = True
        fsync_dir(final.parent)
    except OSError as error:
        _remove(temp)
        failed = WriteFailed(final, error)
        failed.renamed = renamed
        raise failed from None


def write_atomic(final: Path, write: Callable[[_Sink], object], temp: Path | None = None) -> int:
    """stage() then commit(); the temporary is .NAME.partial unless given. Returns the size."""
    temp = temp or final.parent / f".{final.name}.partial"
    size = stage(final, write, temp)
    commit(temp, final)
    return size


def append_line(fd: int, data: bytes, path: Path) -> None:
    """Appends `data` to the open file `fd` (O_APPEND) and fsyncs it; a short write is
    continued, so a line is torn only where a write failed (readers skip a torn last line).
    An OSError is WriteFailed naming `path`."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as error:
        raise WriteFailed(path, error) from None


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
