"""Runs one step of the device check in a process of its own.

A step that crashes (a signal, the OOM killer, a hang past its time) or leaves a poisoned CUDA
context behind in its process cannot take the run with it: the runner forks, the child runs the
step and writes its result as JSON, and the parent reads it, or, when the child died without one,
writes a result that says how it died. The runner's own process never calls into CUDA.

Standard library only (it runs on the GPU machine inside the device-check bundle).
"""

import json
import os
import signal
import sys
import time


def describe_status(status):
    """'killed by SIGSEGV' or 'exit status 3' from an os.waitpid status."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return "killed by %s" % signal.Signals(number).name
        except ValueError:
            return "killed by signal %d" % number
    return "exit status %d" % os.WEXITSTATUS(status)


def run_in_own_process(function, result_path, allowance_s, files_to_flush=()):
    """function() -> dict, run in a forked child within allowance_s seconds; returns its dict, or
    {"status": "crashed" | "timeout", "summary": ...} when the child ended without writing one.
    files_to_flush are flushed before the fork (so that no buffered text is written twice) and by
    the child before it exits."""
    for f in files_to_flush:
        f.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.path.exists(result_path):
        os.remove(result_path)
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(function, result_path, files_to_flush)
    status, timed_out = _wait(pid, allowance_s)
    seconds = time.monotonic() - started
    try:
        with open(result_path) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    if timed_out:
        return {"status": "timeout", "summary": "the step's process was killed after %.0f s, its time limit "
                                                "(see the log)" % seconds}
    return {"status": "crashed", "summary": "the step's process died after %.1f s: %s, before it reported "
                                            "(see the log)" % (seconds, describe_status(status))}


def _child(function, result_path, files_to_flush):
    code = 0
    try:
        os.setpgid(0, 0)  # its own group: the parent can end it and what it started
        result = function()
        temporary = result_path + ".tmp"
        with open(temporary, "w") as f:
            json.dump(result, f)
        os.replace(temporary, result_path)
    except BaseException as error:  # anything at all: report it, never return into the parent's code
        code = 1
        try:
            sys.stderr.write("step process: %s: %s\n" % (type(error).__name__, error))
        except Exception:
            pass
    finally:
        for f in files_to_flush:
            try:
                f.flush()
            except Exception:
                pass
        os._exit(code)


def _wait(pid, allowance_s):
    """(waitpid status, whether it was killed at the allowance)."""
    deadline = time.monotonic() + allowance_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, False
        if time.monotonic() > deadline:
            for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    target()
                except ProcessLookupError:
                    pass
            _, status = os.waitpid(pid, 0)
            return status, True
        time.sleep(0.05)
