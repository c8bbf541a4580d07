"""compute-sanitizer in the device check: where the bundle keeps it, and what its output says.

The bundle carries NVIDIA's compute-sanitizer (PyPI nvidia-cuda-sanitizer-api, pinned in
tests/python/requirements.txt) as one xz archive, unpacked into the run's work folder the first
time a step needs it. `findings` turns its text output into one entry per distinct defect: the
tool, what it found, the kernel, the source line where it gives one (the CUDA code is built with
-lineinfo), the test that was running, and how many times it was seen.

Standard library only (it runs on the GPU machine inside the device-check bundle).
"""

import os
import re
import shutil
import tarfile

ARCHIVE = "sanitizer.tar.xz"  # in the bundle, beside run.py
BINARY = "cu13/bin/compute-sanitizer"  # inside the archive
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")

PREFIX = "========= "
NOT_FINDINGS = re.compile(r"^(COMPUTE-SANITIZER|ERROR SUMMARY|LEAK SUMMARY|RACECHECK SUMMARY|Target application"
                          r"|Error: No attachable process|Tool:)")
SUMMARY = re.compile(r"^========= ERROR SUMMARY: (\d+) errors?")
RUN = re.compile(r"^\[ RUN      \] (\S+)")
# "at kernel(int*)+0x70 in /src/kernels/cuda/moe.cu:120" (current) or
# "at 0x00000070 in /src/kernels/cuda/moe.cu:120:kernel(int*)" (older releases); either without the
# source line when the code has no line information.
AT_CURRENT = re.compile(r"\bat (.+?)\+0x[0-9a-fA-F]+(?: in (\S+?:\d+))?\s*(?:\[.*\])?$")
AT_OLDER = re.compile(r"\bat 0x[0-9a-fA-F]+ in (\S+?:\d+):(.+?)\s*(?:\[.*\])?$")


def locate(bundle_dir, work_dir, log=None):
    """The compute-sanitizer to run: the bundle's (unpacked once into work_dir), else one on PATH
    or in a CUDA toolkit; None when there is none. The bundle's comes first: its version is the
    one the report names."""
    archive = os.path.join(bundle_dir, ARCHIVE)
    if os.path.exists(archive):
        target = os.path.join(work_dir, "sanitizer")
        binary = os.path.join(target, BINARY)
        if not os.path.exists(binary):
            with tarfile.open(archive, "r:xz") as tar:
                tar.extractall(target, filter="tar") if hasattr(tarfile, "data_filter") else tar.extractall(target)
            if log:
                log.write("[compute-sanitizer unpacked into %s]\n" % target)
        return binary
    for candidate in [shutil.which("compute-sanitizer")] + sorted(
            os.path.join(d, "bin", "compute-sanitizer") for d in _cuda_homes()):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _cuda_homes():
    roots = ["/usr/local/cuda"]
    if os.path.isdir("/usr/local"):
        roots += [os.path.join("/usr/local", d) for d in os.listdir("/usr/local") if d.startswith("cuda-")]
    return [r for r in roots if os.path.isdir(r)]


def command(binary, tool, detail=False):
    """The compute-sanitizer command line (before the target's argv) for one tool. detail: device
    and host backtraces and a higher print limit, for the rerun of a step that found something."""
    argv = [binary, "--tool", tool, "--print-limit", "1000" if detail else "100", "--error-exitcode", "86"]
    if detail:
        argv += ["--show-backtrace", "both"]
    if tool == "racecheck":
        argv += ["--racecheck-report", "all" if detail else "analysis"]
    return argv


def _location(line):
    """(kernel, source line or None) from an 'at ...' line, or (None, None)."""
    text = line.strip()
    older = AT_OLDER.search(text)
    if older:
        return older.group(2).strip(), older.group(1)
    current = AT_CURRENT.search(text)
    if current:
        return current.group(1).strip(), current.group(2)
    return None, None


def _blocks(text):
    """(header, [detail lines], test running) for each sanitizer report block in the output."""
    test, block = None, None
    for raw in text.splitlines():
        run = RUN.match(raw)
        if run:
            test = run.group(1)
            continue
        if not raw.startswith(PREFIX.rstrip()):
            continue
        body = raw[len(PREFIX):] if raw.startswith(PREFIX) else ""
        if not body.strip():
            continue
        if body.startswith(" "):
            if block is not None:
                block[1].append(body.strip())
            continue
        if block is not None:
            yield block
        block = None if NOT_FINDINGS.match(body) else (body.strip(), [], test)
    if block is not None:
        yield block


def findings(text, tool):
    """One dict per distinct defect in compute-sanitizer's output: tool, what, kernel, line (None
    where it gives none), test, count; in the order first seen."""
    merged = {}
    for header, details, test in _blocks(text):
        kernel, line = _location(header)  # racecheck names the access in its header line
        for detail in details:
            if kernel is None and detail.startswith("at "):
                kernel, line = _location(detail)
        what = re.sub(r"\s+at .*$", "", header) if kernel else header
        key = (what, kernel, line)
        if key in merged:
            merged[key]["count"] += 1
        else:
            merged[key] = {"tool": tool, "what": what, "kernel": kernel, "line": line, "test": test, "count": 1}
    return list(merged.values())


def error_count(text):
    """The total of ERROR SUMMARY lines (one per process the sanitizer watched), or None if none."""
    counts = [int(m.group(1)) for m in (SUMMARY.match(line) for line in text.splitlines()) if m]
    return sum(counts) if counts else None


def describe(finding):
    where = finding["kernel"] or "host"
    if finding["line"]:
        where += " (%s)" % finding["line"]
    times = " x%d" % finding["count"] if finding["count"] > 1 else ""
    test = " in %s" % finding["test"] if finding["test"] else ""
    return "%s: %s in %s%s%s" % (finding["tool"], finding["what"], where, test, times)
