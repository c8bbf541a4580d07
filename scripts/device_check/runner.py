#!/usr/bin/env python3
"""The device check's runner: runs the bundle's steps on a GPU machine and writes a short report.

Prepared here by `scripts/device-check.sh --prepare` (which copies this file into the bundle as
run.py) and started there by the bundle's run.sh. Standard library only: the GPU machine has a
python3 but none of our packages. Guarantees:
  - every step runs under a hard timeout, and the whole run under --budget-s (default 480 s);
  - a step that hangs cannot starve the ones after it: while a step runs, the budget keeps back
    each later step's reserve_s (its share, about what it takes on an H200 plus a margin);
  - without a GPU it says "no GPU: <reason>", runs what needs none, skips the rest, and exits 0
    unless something that ran failed;
  - OUT gets exactly three files (report.md, report.json, device-check.log), each written whole.

Later work adds what it checks to STEPS below and nothing else: prepare bundles the binaries
each step names, and the report lists each step's outcome.
"""

import argparse
import collections
import datetime
import glob
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import gtest_output
import isolated
import sanitizer
from gtest_output import parse_gtest_xml  # noqa: F401  (the tests' and the steps' name for it)

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = "hsx_cuda_probe"  # versions and devices (tests/cuda/cuda_probe.cc)
CUDA_TESTS = "hsx_cuda_tests"  # tests/cuda: kernels, backend, model, TP, capture overlap
MAX_BUDGET_S = 540  # a device command runs at most 10 minutes; leave room for start and copy-back
LOG_TAIL_BYTES = 64 * 1024  # of each command's output, in the log

# What Context.execute returns: exit status, output (all of it; the log keeps its tail), whether it was killed at its
# time limit, and how long it ran.
Outcome = collections.namedtuple("Outcome", "rc output timed_out seconds")

# Shared libraries the bundle does not carry. Prepare and the bundle check both use these.
# glibc's own libraries: every Linux machine has them, and they must match its loader.
GLIBC_FAMILY = re.compile(
    r"^(linux-vdso|linux-gate|ld-linux[-\w]*|lib(c|m|mvec|pthread|dl|rt|util|resolv|anl|nsl"
    r"|BrokenLocale|thread_db|nss_\w+))\.so")
# The NVIDIA driver: only the machine's own matches its kernel module.
DRIVER = re.compile(r"^lib(cuda|nvidia-[\w.-]+)\.so")
# CUDA libraries the GPU machine has (toolkit, Python nvidia-* packages); hundreds of MB each.
GPU_MACHINE_CUDA = re.compile(r"^lib(cublas|cublasLt|cudnn[\w]*|nccl)\.so")
# What is looked for on the GPU machine, reported, and put on the binaries' library path: the
# CUDA backend loads cuBLASLt, NCCL and cuDNN with dlopen (so ldd does not list them), and the cuDNN
# frontend (--attention=cudnn) loads the shared CUDA runtime for its own calls.
CUDA_LIBRARIES_TO_FIND = ["libcublasLt.so.13", "libcublas.so.13", "libcudnn.so.9", "libnccl.so.2",
                          "libcudart.so.13"]


def carried(soname):
    """Whether prepare copies this library into the bundle."""
    return not (GLIBC_FAMILY.match(soname) or DRIVER.match(soname) or GPU_MACHINE_CUDA.match(soname))


# --- the steps --------------------------------------------------------------------------------


class Step:
    """One line of the report. `binaries` are bundled by prepare; `needs_gpu` steps are skipped,
    saying so, without one. run() returns a dict with at least status and summary."""

    binaries = ()
    needs_gpu = False
    timeout_s = 60
    reserve_s = 10  # kept for this step out of the budget while earlier steps run

    def __init__(self, name, title):
        self.name = name
        self.title = title

    def run(self, ctx):
        raise NotImplementedError

    def detailed(self, previous):
        """This step as rerun by --from-report after `previous` (its result there) failed: more
        detail where the step has more to give; by default the step as it is."""
        return self


class Pending(Step):
    """A part of the check that is not written yet: listed so the report shows what is missing."""

    def __init__(self, name, title, owner):
        super().__init__(name, title)
        self.owner = owner

    def run(self, ctx):
        return {"status": "not built yet", "summary": "comes with " + self.owner}


class BundleCheck(Step):
    """Every bundled binary's libraries resolve into the bundle, or to glibc, the driver or the
    GPU machine's CUDA libraries; and the machine's glibc is as new as the binaries need."""

    timeout_s = 60

    def __init__(self):
        super().__init__("bundle", "bundled binaries load here (libraries, glibc)")

    def run(self, ctx):
        problems = []
        need = ctx.manifest.get("glibc_required", "")
        have = glibc_version()
        if need and have and version_tuple(have) < version_tuple(need):
            problems.append("glibc %s here, the binaries need %s" % (have, need))
        binaries = sorted(os.listdir(ctx.bin_dir))
        if shutil.which("ldd") is None:
            return {"status": "skip", "summary": "ldd not on PATH: libraries not checked; " + (
                "; ".join(problems) or "glibc %s, need %s" % (have or "?", need or "?"))}
        for binary in binaries:
            ldd = ctx.execute(["ldd", os.path.join(ctx.bin_dir, binary)], 30)
            if ldd.rc != 0 or ldd.timed_out:
                problems.append("%s: ldd failed (exit %s)" % (binary, ldd.rc))
                continue
            for soname, path in parse_ldd(ldd.output):
                if path is None:
                    problems.append("%s: %s not found" % (binary, soname))
                elif carried(soname) and not os.path.realpath(path).startswith(ctx.lib_dir + os.sep):
                    problems.append("%s: %s resolved outside the bundle (%s)" % (binary, soname, path))
        if problems:
            return {"status": "fail", "summary": "; ".join(problems[:8])}
        return {"status": "pass",
                "summary": "%d binaries, every library from the bundle or the system's glibc/CUDA"
                           " (glibc %s, need %s)" % (len(binaries), have or "?", need or "?")}


class GTestSuite(Step):
    """A GoogleTest binary (or a filter of one). A test that crashes the binary does not hide the
    tests after it: the binary is run again without the tests that finished and the one that
    crashed (at most MAX_ATTEMPTS runs, within the step's time). A failure that names a sticky CUDA
    error poisons the process's context, so the tests that failed after it are run once more in a
    fresh process: the report tells the defect from its consequences. The result lists each failed
    and crashed test with what it printed (the mismatch messages of tests/common/value_comparison.h).

    env: extra environment (HSX_TEST_SHAPES=small for smaller shapes); wrap: a command to run the
    binary under (compute-sanitizer), as a function of the context."""

    MAX_ATTEMPTS = 4

    def __init__(self, name, binary, title, timeout_s, gtest_filter=None, reserve_s=Step.reserve_s, env=None):
        super().__init__(name, title)
        self.binaries = (binary,)
        self.timeout_s = timeout_s
        self.reserve_s = reserve_s
        self.gtest_filter = gtest_filter
        self.env = dict(env or {})

    def wrap(self, ctx):
        """The command before the binary's argv ([] for none); raises StepEnded if it cannot run."""
        return []

    def detailed(self, previous):
        """Only the tests that failed or crashed before (all of the filter if the report names
        none), on small shapes; CUDA tests under compute-sanitizer memcheck with backtraces."""
        gtest_filter = failed_tests_filter(previous, self.gtest_filter)
        if self.binaries[0] == CUDA_TESTS:
            return SanitizerSuite("memcheck", gtest_filter, self.timeout_s, self.reserve_s, detail=True,
                                  name=self.name, title="%s (detail rerun: failed tests, small shapes, memcheck)"
                                  % self.title)
        return GTestSuite(self.name, self.binaries[0], "%s (detail rerun: failed tests, small shapes)" % self.title,
                          self.timeout_s, gtest_filter, self.reserve_s, env=dict(self.env, HSX_TEST_SHAPES="small"))

    def argv(self, ctx, xml_path, gtest_filter):
        argv = self.wrap(ctx) + [ctx.binary(self.binaries[0]), "--gtest_output=xml:" + xml_path]
        return argv + (["--gtest_filter=" + gtest_filter] if gtest_filter else [])

    def run(self, ctx):
        try:
            return self.run_attempts(ctx)
        except StepEnded as ended:
            return ended.result

    def run_attempts(self, ctx):
        ends_at = time.monotonic() + min(self.timeout_s, ctx.remaining_s())
        tally = GTestTally()
        gtest_filter = self.gtest_filter
        for attempt in range(1, self.MAX_ATTEMPTS + 1):
            xml_path = os.path.join(ctx.work_dir, "%s-%d.xml" % (self.name, attempt))
            left = ends_at - time.monotonic()
            if left < 3:
                tally.notes.append("no time left for run %d" % attempt)
                break
            outcome = ctx.execute(self.argv(ctx, xml_path, gtest_filter), left, env=self.env)
            self.inspect(outcome, ctx)
            gtest_filter = tally.add(outcome, xml_path, gtest_filter)
            if gtest_filter is None:
                break
        return self.verdict(tally)

    def inspect(self, outcome, ctx):
        """Hook for subclasses: read the run's output (the sanitizer's findings)."""

    def verdict(self, tally):
        counts = tally.counts
        summary = "%(passed)d passed, %(failed)d failed, %(skipped)d skipped of %(tests)d" % counts
        if tally.crashed:
            summary += ", %d crashed (%s)" % (len(tally.crashed), "; ".join(
                "%s: %s" % (c["name"], c["how"]) for c in tally.crashed[:3]))
        if tally.failures:
            summary += "; failed: " + "; ".join(f["name"] for f in tally.failures[:6])
        if tally.skip_reasons:
            summary += " (skipped: %s)" % "; ".join(tally.skip_reasons[:3])
        if tally.notes:
            summary += " [%s]" % "; ".join(tally.notes)
        if tally.timed_out:
            status = "timeout"
            summary = "%s; %s" % (tally.timed_out, summary)
        elif counts["failed"] or tally.crashed or tally.bad_exit:
            status = "fail"
        elif counts["tests"] and counts["skipped"] == counts["tests"]:
            status = "skip"
        elif not counts["tests"]:
            status = "error"
            summary = "no test ran" + (" [%s]" % "; ".join(tally.notes) if tally.notes else "")
        else:
            status = "pass"
        return {"status": status, "summary": summary, "counts": counts,
                "tests": {"failed": tally.failures, "crashed": tally.crashed}}


class GTestTally:
    """What the runs of one GTestSuite step found, added up run by run."""

    def __init__(self):
        self.counts = {"tests": 0, "passed": 0, "failed": 0, "skipped": 0, "disabled": 0}
        self.failures, self.crashed, self.skip_reasons, self.notes = [], [], [], []
        self.timed_out = None  # what the kill says, when the last run hit the time limit
        self.bad_exit = False
        self.sticky_rerun_done = False

    def add(self, outcome, xml_path, gtest_filter):
        """Adds one run; returns the filter for the next run, or None when the step is done."""
        tests = gtest_output.tests_in_output(outcome.output)
        running = [name for name, status, _ in tests if status is None]
        if outcome.timed_out:
            self.timed_out = True
            self.add_from_output(tests)
            self.timed_out = "killed at its time limit, after %.0f s%s" % (
                outcome.seconds, " in " + running[-1] if running else "")
            return None
        if os.path.exists(xml_path):
            return self.add_from_xml(outcome, xml_path, tests)
        # No XML: the binary died. Count what finished, name the test it died in, run the rest.
        self.add_from_output(tests)
        how = exit_description(outcome.rc)
        if not running:
            self.bad_exit = True
            self.notes.append("%s before any test ran, no XML report" % how if not tests else
                              "%s after its last test, no XML report" % how)
            return None
        victim = running[-1]
        output = next(text for name, status, text in tests if name == victim and status is None)
        self.crashed.append({"name": victim, "how": how, "message": gtest_output.first_lines(output)})
        self.counts["tests"] += 1
        return gtest_output.exclude(gtest_filter, [name for name, _, _ in tests])

    def add_from_output(self, tests):
        for name, status, text in tests:
            if status is None:
                continue
            self.counts["tests"] += 1
            key = {"OK": "passed", "FAILED": "failed", "SKIPPED": "skipped"}[status]
            self.counts[key] += 1
            if status == "FAILED":
                self.failures.append({"name": name, "message": gtest_output.first_lines(text)})

    def add_from_xml(self, outcome, xml_path, tests):
        counts, reasons = parse_gtest_xml(xml_path)
        failures = gtest_output.xml_failures(xml_path)
        sticky = gtest_output.sticky_failure(failures)
        order = [name for name, _, _ in tests]
        after = [f["name"] for f in failures if sticky and f is not sticky and f["name"] in order
                 and order.index(f["name"]) > order.index(sticky["name"])] if sticky and sticky["name"] in order else []
        if after and not self.sticky_rerun_done:
            # Keep the sticky failure; count the rest of this run except the failures after it,
            # which run again in a fresh process.
            self.sticky_rerun_done = True
            counts["failed"] -= len(after)
            counts["tests"] -= len(after)
            failures = [f for f in failures if f["name"] not in after]
            self.notes.append("%s left a sticky CUDA error; the %d tests that failed after it ran again in a "
                              "fresh process" % (sticky["name"], len(after)))
            self.merge(counts, reasons, failures)
            return gtest_output.only(after)
        self.merge(counts, reasons, failures)
        if outcome.rc != 0 and not counts["failed"]:
            self.bad_exit = True
            self.notes.append("%s with no failed test" % exit_description(outcome.rc))
        return None

    def merge(self, counts, reasons, failures):
        for key in self.counts:
            self.counts[key] += counts[key]
        self.failures += failures
        self.skip_reasons += [r for r in reasons if r not in self.skip_reasons]


def failed_tests_filter(previous, gtest_filter, also=()):
    """A filter of the tests a previous result names as failed or crashed (plus `also`), or
    gtest_filter when it names none."""
    tests = previous.get("tests") or {}
    names = [t["name"] for t in tests.get("failed", []) + tests.get("crashed", []) if t.get("name")]
    names += [n for n in also if n not in names]
    return gtest_output.only(names) if names else gtest_filter


def exit_description(rc):
    """'killed by SIGSEGV' for a negative Popen return code, else 'exit status N'."""
    if rc is not None and rc < 0:
        try:
            return "killed by %s" % signal.Signals(-rc).name
        except ValueError:
            return "killed by signal %d" % -rc
    return "exit status %s" % rc


class SanitizerSuite(GTestSuite):
    """A GoogleTest filter under one compute-sanitizer tool (memcheck, racecheck, synccheck,
    initcheck), on small shapes (HSX_TEST_SHAPES=small). Each distinct finding goes into the result
    (tool, what, kernel, source line, the test that was running, how often)."""

    needs_gpu = True

    def __init__(self, tool, gtest_filter, timeout_s, reserve_s, detail=False, name=None, title=None):
        super().__init__(name or "sanitize_" + tool, CUDA_TESTS,
                         title or "compute-sanitizer --tool %s: the CUDA conformance suite and the CUDA model test on"
                         " small shapes" % tool, timeout_s, gtest_filter, reserve_s, env={"HSX_TEST_SHAPES": "small"})
        self.tool = tool
        self.detail = detail
        self.findings = []
        self.errors = 0

    def wrap(self, ctx):
        binary = ctx.sanitizer()
        if binary is None:
            raise StepEnded("not built", "no compute-sanitizer: not in the bundle (%s), not on PATH, not in "
                            "/usr/local/cuda*/bin" % sanitizer.ARCHIVE)
        return sanitizer.command(binary, self.tool, self.detail)

    def detailed(self, previous):
        """The tests with findings or failures only, with backtraces and a higher print limit."""
        names = [f["test"] for f in previous.get("findings", []) if f.get("test")]
        gtest_filter = failed_tests_filter(previous, self.gtest_filter, also=names)
        return SanitizerSuite(self.tool, gtest_filter, self.timeout_s, self.reserve_s, detail=True, name=self.name,
                              title="%s (detail rerun: backtraces)" % self.title)

    def inspect(self, outcome, ctx):
        for finding in sanitizer.findings(outcome.output, self.tool):
            same = [f for f in self.findings if (f["what"], f["kernel"], f["line"]) ==
                    (finding["what"], finding["kernel"], finding["line"])]
            if same:
                same[0]["count"] += finding["count"]
            else:
                self.findings.append(finding)
        self.errors += sanitizer.error_count(outcome.output) or 0

    def verdict(self, tally):
        result = super().verdict(tally)
        result["findings"] = self.findings
        if self.findings or self.errors:
            result["status"] = "fail" if result["status"] in ("pass", "skip", "fail") else result["status"]
            result["summary"] = "%d errors, %d distinct: %s; tests: %s" % (
                self.errors, len(self.findings), "; ".join(sanitizer.describe(f) for f in self.findings[:4]),
                result["summary"])
        elif result["status"] == "pass":
            result["summary"] = "no errors; tests: " + result["summary"]
        return result


class CpuPipeline(Step):
    """The bundled tools end to end on the CPU backend: generate a tiny model, inspect it, dump
    eight samples, verify the dump. Shows the tools run on the GPU machine's system."""

    binaries = ("hsx-make-model", "hsx-inspect", "hsx-dump", "hsx-verify")
    timeout_s = 120
    reserve_s = 20

    def __init__(self):
        super().__init__("cpu_pipeline", "hsx-make-model, hsx-inspect, hsx-dump --model --device cpu, hsx-verify")

    def run(self, ctx):
        model = os.path.join(ctx.work_dir, "tiny")
        samples = os.path.join(ctx.work_dir, "samples.jsonl")
        dump = os.path.join(ctx.work_dir, "dump")
        commands = [
            [ctx.binary("hsx-make-model"), "--preset", "tiny", "--out", model],
            [ctx.binary("hsx-inspect"), "--model", model, "--json"],
            None,  # the samples, once the model's vocabulary is known
            [ctx.binary("hsx-dump"), "--model", model, "--device", "cpu", "--input", samples, "--out", dump],
            [ctx.binary("hsx-verify"), dump, "--input", samples, "--strict"],
        ]
        tokens = 0
        for argv in commands:
            if argv is None:
                tokens = write_samples(os.path.join(model, "config.json"), samples, count=8, seed=1)
                continue
            outcome = ctx.execute(argv, self.timeout_s)
            tool = os.path.basename(argv[0])
            if outcome.timed_out:
                return {"status": "timeout",
                        "summary": "%s killed at its time limit, after %.0f s" % (tool, outcome.seconds)}
            if outcome.rc != 0:
                return {"status": "fail", "summary": "%s exited %d (see the log)" % (tool, outcome.rc)}
        return {"status": "pass", "summary": "8 samples, %d tokens dumped and verified" % tokens}


class GpuForward(Step):
    """bench/gpu_forward: one rank's share of Kimi-K2 layers at 8k and 32k tokens per forward,
    and the capture copy time at 32k with the overlap off and on; its RESULT line (JSON) becomes
    the summary. Runs without a GPU too, where the binary itself
    must say "no GPU" and exit 0. --max-seconds keeps it inside its timeout."""

    binaries = ("gpu_forward",)
    timeout_s = 170
    reserve_s = 60

    def __init__(self, tokens="8192,32768", layers=2, repeats=3, capture_tokens=32768):
        super().__init__("gpu_forward", "bench/gpu_forward: one rank of Kimi-K2 at 8k and 32k tokens"
                         " (tokens/s, TFLOP/s per op class against a cuBLAS BF16 peak; the capture copy"
                         " time the forward pays with the overlap off and on)")
        self.tokens, self.layers, self.repeats, self.capture_tokens = tokens, layers, repeats, capture_tokens

    def detailed(self, previous):
        """One layer at 1k tokens, one repeat: whether it runs at all, and where it stops."""
        return GpuForward(tokens="1024", layers=1, repeats=1, capture_tokens=1024)

    def run(self, ctx):
        # Its own limit inside the time this step has, so that it reports what it measured.
        max_seconds = int(max(10, min(110, ctx.remaining_s() - 15)))
        argv = [ctx.binary("gpu_forward"), "--tokens=%s" % self.tokens, "--layers=%d" % self.layers,
                "--repeats=%d" % self.repeats, "--max-seconds=%d" % max_seconds,
                "--capture-tokens=%d" % self.capture_tokens]
        outcome = ctx.execute(argv, self.timeout_s)
        if outcome.timed_out:
            return {"status": "timeout", "summary": "killed at its time limit, after %.0f s" % outcome.seconds}
        result = parse_bench_result(outcome.output)
        if outcome.rc != 0 or result is None:
            last = outcome.output.strip().splitlines()[-1] if outcome.output.strip() else "no output"
            return {"status": "fail", "summary": "exit %d: %s" % (outcome.rc, last)}
        if not result.get("gpu"):
            said = [l for l in outcome.output.splitlines() if "no GPU" in l]
            return {"status": "skip", "summary": said[0] if said else "no GPU"}
        return {"status": "pass", "summary": summarize_forward(result), "result": result}


# A loopback TCP pair moving the same bytes as the service: the baseline of StreamCost. Each side
# prints its CPU seconds around the transfer alone (getrusage), and the receiver the bytes.
SOCKET_RECEIVER = """
import resource, socket, sys
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
view = memoryview(bytearray(1 << 20))
start, received = cpu(), 0
while True:
    n = conn.recv_into(view)
    if not n:
        break
    received += n
print(received, cpu() - start, flush=True)
"""
SOCKET_SENDER = """
import resource, socket, sys
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
port, total = int(sys.argv[1]), int(sys.argv[2])
conn = socket.create_connection(("127.0.0.1", port))
block = bytes(1 << 20)
start, sent = cpu(), 0
while sent < total:
    n = min(len(block), total - sent)
    conn.sendall(block[:n] if n < len(block) else block)
    sent += n
conn.close()
print(sent, cpu() - start, flush=True)
"""


def process_cpu_s(pid, engine_only=False):
    """utime + stime of a live process (/proc/PID/stat), or of its threads named hsx-engine*."""
    ticks = os.sysconf("SC_CLK_TCK")
    paths = glob.glob("/proc/%d/task/*/stat" % pid) if engine_only else ["/proc/%d/stat" % pid]
    total = 0
    for path in paths:
        try:
            with open(path) as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just ended (engine threads stay)
        name, rest = text.split("(", 1)[1].rsplit(")", 1)
        if engine_only and not name.startswith("hsx-engine"):
            continue
        fields = rest.split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    return total / ticks


class StepEnded(Exception):
    """Raised inside a step to end it with this result (a failure or timeout, said)."""

    def __init__(self, status, summary):
        super().__init__(summary)
        self.result = {"status": status, "summary": summary}


class StreamCost(Step):
    """The streaming path's CPU cost where the engine runs on the device: bench/stream_cost.py's set-up (a model of
    hidden 7168 and vocabulary 32000 with --capture 0, so no decoder layer runs; 64 samples of
    512-2048 tokens; bf16; hsx-dump --discard --concurrency 4) served by hsx-server --device DEVICE,
    a warm-up pass and then `passes` measured ones: the server's CPU-ns per streamed byte (the
    whole process, its hsx-engine* threads, the rest: the streaming path) and hsx-dump's, from the
    processes' own accounting, next to a loopback socket sender and receiver moving the same bytes
    once. Medians over the passes."""

    binaries = ("hsx-make-model", "hsx-server", "hsx-dump")
    timeout_s = 150
    reserve_s = 45

    def __init__(self, device="cuda", hidden=7168, vocab=32000, samples=64, lengths=(512, 2048), passes=3):
        super().__init__("stream_cost", "streaming CPU cost with --device %s: hsx-server -> hsx-dump --discard, CPU-ns per"
                         " streamed byte of the server (whole, engine threads, streaming) and the client, against"
                         " a loopback socket pair" % device)
        self.needs_gpu = device == "cuda"
        self.device = device
        # bench/bench_util.py's wide model (NARROW_ATTENTION), copied: the bundle carries no bench/
        # (test_the_stream_cost_step_runs_the_benchmarks_set_up keeps the two equal).
        self.config = {"hidden_size": hidden, "vocab_size": vocab, "n_routed_experts": 0, "num_hidden_layers": 1,
                       "intermediate_size": 32, "num_attention_heads": 1, "num_key_value_heads": 1,
                       "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
                       "v_head_dim": 16, "first_k_dense_replace": 1}
        self.samples = samples
        self.lengths = lengths
        self.passes = passes

    def detailed(self, previous):
        """8 samples of 64-256 tokens and one measured pass: whether the path works at all."""
        return StreamCost(self.device, samples=8, lengths=(64, 256), passes=1)

    def run(self, ctx):
        try:
            return self.measure(ctx)
        except StepEnded as ended:
            return ended.result

    def measure(self, ctx):
        model, samples = self.prepare(ctx)
        server_log = os.path.join(ctx.work_dir, "stream-server.log")
        with open(server_log, "w") as log:
            server = subprocess.Popen(
                [ctx.binary("hsx-server"), "--model", model, "--device", self.device, "--listen", "127.0.0.1:0",
                 "--capture", "0", "--max-batch-tokens", "8192"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=ctx.env, cwd=ctx.work_dir,
                start_new_session=True)
        try:
            address = wait_for_server(server, server_log, min(90, ctx.remaining_s() - 10))
            runs = [self.dump_pass(ctx, server.pid, address, samples, i) for i in range(self.passes + 1)][1:]
        finally:
            kill_group(server)
            with open(server_log) as f:
                ctx.log.write("\n[hsx-server's log]\n" + f.read()[-LOG_TAIL_BYTES:])
        nbytes = runs[0]["bytes"]
        sender, receiver = socket_baseline(ctx, nbytes)
        return summarize_stream_cost(runs, sender, receiver, self.device)

    def prepare(self, ctx):
        """The model and the samples in the work folder: (model, samples)."""
        tiny = os.path.join(ctx.work_dir, "stream-tiny")
        model = os.path.join(ctx.work_dir, "stream-wide")
        config_path = os.path.join(ctx.work_dir, "stream-wide.json")
        outcome = ctx.execute([ctx.binary("hsx-make-model"), "--preset", "tiny", "--out", tiny], 60)
        if outcome.rc != 0 or outcome.timed_out:
            raise StepEnded("fail", "hsx-make-model --preset tiny exited %s" % outcome.rc)
        with open(os.path.join(tiny, "config.json")) as f:
            config = json.load(f)
        config.update(self.config)
        with open(config_path, "w") as f:
            json.dump(config, f)
        outcome = ctx.execute([ctx.binary("hsx-make-model"), "--config", config_path, "--out", model], 90)
        if outcome.rc != 0 or outcome.timed_out:
            raise StepEnded("fail", "hsx-make-model --config exited %s" % outcome.rc)
        samples = os.path.join(ctx.work_dir, "stream-samples.jsonl")
        rng = random.Random(0)
        with open(samples, "w") as f:
            for i in range(self.samples):
                ids = [rng.randrange(self.config["vocab_size"]) for _ in range(rng.randint(*self.lengths))]
                f.write(json.dumps({"id": str(i), "input_ids": ids}) + "\n")
        return model, samples

    def dump_pass(self, ctx, server_pid, address, samples, index):
        """One hsx-dump --discard pass (index 0 warms up): its bytes and each side's CPU seconds."""
        out = os.path.join(ctx.work_dir, "stream-out-%d" % index)
        argv = [ctx.binary("hsx-dump"), "--server", address, "--input", samples, "--out", out, "--capture", "0",
                "--dtype", "bf16", "--concurrency", "4", "--discard"]
        ctx.log.write("\n$ %s\n" % " ".join(argv))
        whole, engine = process_cpu_s(server_pid), process_cpu_s(server_pid, engine_only=True)
        with tempfile.TemporaryFile(dir=ctx.work_dir) as output:
            dump = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                    env=ctx.env, cwd=ctx.work_dir)
            deadline = time.monotonic() + max(5.0, min(60.0, ctx.remaining_s() - 5))
            while True:
                pid, status, usage = os.wait4(dump.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() > deadline:
                    dump.kill()
                    dump.wait()
                    raise StepEnded("timeout", "hsx-dump pass %d killed at its time limit" % index)
                time.sleep(0.02)
            dump.returncode = os.waitstatus_to_exitcode(status)
            output.seek(0)
            text = output.read().decode("utf-8", "replace")
        ctx.log.write(text[-LOG_TAIL_BYTES:])
        shutil.rmtree(out, ignore_errors=True)
        whole, engine = process_cpu_s(server_pid) - whole, process_cpu_s(server_pid, engine_only=True) - engine
        match = re.search(r"(\d+) tokens, (\d+) bytes", text)
        if dump.returncode != 0 or not match:
            raise StepEnded("fail", "hsx-dump pass %d exited %d (see the log)" % (index, dump.returncode))
        return {"bytes": int(match.group(2)), "server_s": whole, "engine_s": engine,
                "client_s": usage.ru_utime + usage.ru_stime}


def wait_for_server(server, log_path, timeout_s):
    """The address hsx-server reports once it says it is ready."""
    deadline = time.monotonic() + max(5.0, timeout_s)
    while time.monotonic() < deadline:
        with open(log_path) as f:
            text = f.read()
        listening = re.search(r"listening on (\S+)", text)
        if listening and "ready: serving" in text:
            return listening.group(1)
        if server.poll() is not None:
            last = text.strip().splitlines()[-1] if text.strip() else "no output"
            raise StepEnded("fail", "hsx-server exited %d: %s" % (server.returncode, last))
        time.sleep(0.1)
    raise StepEnded("timeout", "hsx-server was not ready within %.0f s" % timeout_s)


def socket_baseline(ctx, nbytes):
    """CPU seconds of a loopback sender and receiver moving nbytes: (sender_s, receiver_s)."""
    receiver = subprocess.Popen([sys.executable, "-c", SOCKET_RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()
        sent = subprocess.run([sys.executable, "-c", SOCKET_SENDER, port, str(nbytes)], capture_output=True,
                              text=True, timeout=max(10.0, ctx.remaining_s() - 5), check=True)
        received = receiver.stdout.readline().split()
    finally:
        receiver.kill()
        receiver.wait()
    return float(sent.stdout.split()[1]), float(received[1])


def summarize_stream_cost(runs, sender_s, receiver_s, device):
    """The step's result from the measured passes and the socket pair (ns per byte, medians)."""
    def median_ns(key):
        values = sorted(run[key] * 1e9 / run["bytes"] for run in runs)
        return values[len(values) // 2]
    nbytes = runs[0]["bytes"]
    result = {"device": device, "bytes": nbytes, "passes": len(runs),
              "server_ns_per_byte": median_ns("server_s"), "engine_ns_per_byte": median_ns("engine_s"),
              "client_ns_per_byte": median_ns("client_s"),
              "socket_sender_ns_per_byte": sender_s * 1e9 / nbytes,
              "socket_receiver_ns_per_byte": receiver_s * 1e9 / nbytes}
    streaming = sorted((run["server_s"] - run["engine_s"]) * 1e9 / run["bytes"] for run in runs)
    result["streaming_ns_per_byte"] = streaming[len(streaming) // 2]
    summary = ("%.2f GB x %d passes: server %.3f ns/B (engine threads %.3f, streaming %.3f = %.2fx the socket"
               " sender's %.3f); hsx-dump --discard %.3f (%.2fx the receiver's %.3f)" % (
                   nbytes / 1e9, len(runs), result["server_ns_per_byte"], result["engine_ns_per_byte"],
                   result["streaming_ns_per_byte"],
                   result["streaming_ns_per_byte"] / max(result["socket_sender_ns_per_byte"], 1e-12),
                   result["socket_sender_ns_per_byte"], result["client_ns_per_byte"],
                   result["client_ns_per_byte"] / max(result["socket_receiver_ns_per_byte"], 1e-12),
                   result["socket_receiver_ns_per_byte"]))
    return {"status": "pass", "summary": summary, "result": result}


def parse_bench_result(output):
    """The JSON of the last 'RESULT {...}' line, or None."""
    for line in reversed(output.splitlines()):
        if line.startswith("RESULT "):
            try:
                return json.loads(line[len("RESULT "):])
            except ValueError:
                return None
    return None


def summarize_forward(result):
    parts = ["peak %.0f TF/s" % result["peak_tflops"],
             "dequant %.2f ms (%.0f GB/s)" % (result["dequant_ms"], result["dequant_gbs"])]
    for f in result["forwards"]:
        classes = f["classes"]
        parts.append("%dk: %.0f tok/s (proj %.0f, routed %.0f [GEMMs %.0f], attn %.1f TF/s)" % (
            f["tokens"] // 1024, f["tokens_per_s"], classes["attention projections"]["tflops"],
            classes["routed experts"]["tflops"], f["routed_gemm_tflops"], classes["attention"]["tflops"]))
    captures = result.get("captures")
    if captures:
        parts.append("captures %dk (%.0f MB): copies %.1f ms, paid %.1f ms overlap off, %.1f ms on" % (
            captures["tokens"] // 1024, captures["mb"], captures["copy_ms"], captures["exposed_overlap_off_ms"],
            captures["exposed_overlap_on_ms"]))
    return "; ".join(parts)


# What runs under compute-sanitizer: the CUDA backend's per-op conformance cases and the whole tiny
# model against the CPU backend.
SANITIZED_TESTS = "Cuda/BackendConformance.*:CudaModelTest.MatchesTheCpuBackend"

# The device check, in order. New suites, oracle comparisons and benchmarks go here (and only
# here): prepare bundles each step's binaries, the report gets one line per step.
STEPS = [
    BundleCheck(),
    GTestSuite("cuda_kernels", "hsx_cuda_tests", "CUDA kernels and the backend's per-op conformance against"
               " the CPU reference (tests/cuda)", timeout_s=150, reserve_s=40,
               gtest_filter="-CudaModelTest.*:*RowsDoNotDependOn*:*TensorParallel*:*CudaCommunicator*:Cudnn*"
                            ":*CudaCapture*"),
    GTestSuite("oracle", "hsx_cuda_tests", "--device cuda against the CPU backend, whole model"
               " (fp32 1e-5, bf16 2e-2)", timeout_s=120, reserve_s=20,
               gtest_filter="CudaModelTest.MatchesTheCpuBackend*"),
    GTestSuite("batch_invariance", "hsx_cuda_tests", "a sample's states bitwise the same solo and in any"
               " batch (20 seeds, up to 2048 tokens), rows independent of M", timeout_s=180, reserve_s=40,
               gtest_filter="CudaModelTest.BatchedEqualsSoloBitForBit*:*RowsDoNotDependOn*"),
    GTestSuite("cudnn_attention", "hsx_cuda_tests", "--attention=cudnn (cuDNN SDPA) against the reference"
               " kernel at Kimi head dims 192/128 and on the whole tiny model (bf16 2e-2), and bitwise batch"
               " invariance, op and model", timeout_s=90, reserve_s=20, gtest_filter="Cudnn*"),
    GTestSuite("tensor_parallel", "hsx_cuda_tests", "TP 2/4/8 with every rank on one GPU (same-device"
               " transport) against TP 1 (fp32 1e-5), TP 8 batch invariance bitwise, the transports against the"
               " host plan bitwise, abort; NCCL where >= 2 GPUs", timeout_s=120, reserve_s=40,
               gtest_filter="Devices/TensorParallelTest.*/cuda:Transports/CudaCommunicatorTest.*"),
    GTestSuite("capture_overlap", "hsx_cuda_tests", "captures copied on a second stream through the staging"
               " ring hold the source as it was when copied (in-place updates, sub-range copies per sample, tiny"
               " rings that wrap), the tiny model's captures with the overlap on equal those with it off,"
               " bitwise, and through the batcher (last copies fenced, waited for on its delivery thread) each"
               " sample equals its solo run, bitwise; fp8 captures encoded on the device (CopyToHostFp8) are the"
               " CPU rule's bytes: every finite bf16 value under 23 scales, rows of 45 and 7168 with inf/NaN"
               " rows marked, overlap on (ring, wrapping) and off, and through the batcher",
               timeout_s=90, reserve_s=20, gtest_filter="*CudaCapture*"),
    # compute-sanitizer, one tool a step (each its own process): the per-op conformance suite and
    # the whole-model comparison on small shapes (HSX_TEST_SHAPES=small), 10-100x slower under it.
    SanitizerSuite("memcheck", SANITIZED_TESTS, timeout_s=90, reserve_s=25),
    SanitizerSuite("racecheck", SANITIZED_TESTS, timeout_s=90, reserve_s=25),
    SanitizerSuite("synccheck", SANITIZED_TESTS, timeout_s=60, reserve_s=15),
    SanitizerSuite("initcheck", SANITIZED_TESTS, timeout_s=75, reserve_s=20),
    GpuForward(),
    StreamCost(),
    CpuPipeline(),
    GTestSuite("cpu_unit", "hsx_unit_tests", "CPU unit tests (tests/unit)", timeout_s=180, reserve_s=40),
]


def required_binaries():
    names = [PROBE]
    for step in STEPS:
        names += [b for b in step.binaries if b not in names]
    return names


# --- parsing ----------------------------------------------------------------------------------


def glibc_version():
    """The running glibc's version ("2.39"): asked of the C library itself, since a Python
    may be linked against an older one than the machine has."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").split()[-1]
    except (ValueError, OSError, AttributeError, IndexError):
        return platform.libc_ver()[1]


def version_tuple(text):
    return tuple(int(part) for part in re.findall(r"\d+", text))


def parse_ldd(output):
    """(soname, resolved path or None when not found) for each line of ldd's output."""
    libraries = []
    for line in output.splitlines():
        line = line.strip()
        match = re.match(r"^(\S+) => (not found|(\S+) \(0x[0-9a-f]+\))$", line)
        if match:
            libraries.append((match.group(1), match.group(3)))
            continue
        match = re.match(r"^(\S+) \(0x[0-9a-f]+\)$", line)  # the loader, the vdso
        if match:
            libraries.append((os.path.basename(match.group(1)), match.group(1)))
    return libraries


def write_samples(config_path, path, count, seed):
    """count JSONL samples of random token ids below the model's vocabulary; returns the tokens."""
    with open(config_path) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(seed)
    tokens = 0
    with open(path, "w") as f:
        for i in range(count):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(4, 64))]
            tokens += len(ids)
            f.write(json.dumps({"id": i, "input_ids": ids}) + "\n")
    return tokens


# --- the machine ------------------------------------------------------------------------------


class Context:
    """What a step needs: the bundle's paths, the environment for its binaries, a work folder,
    the log, and the time left."""

    def __init__(self, args, manifest, log):
        self.bin_dir = os.path.join(HERE, "bin")
        self.lib_dir = os.path.realpath(os.path.join(HERE, "lib"))
        self.manifest = manifest
        self.log = log
        self.deadline = time.monotonic() + args.budget_s
        self.held_back_s = 0.0  # the later steps' reserves, while a step runs
        self.floor_s = 0.0      # the running step's own reserve: it gets at least this
        self.work_dir = tempfile.mkdtemp(prefix="hsx-device-check-")
        self.env = dict(os.environ)
        self.library_path = [self.lib_dir]

    def binary(self, name):
        return os.path.join(self.bin_dir, name)

    def add_library_dirs(self, dirs):
        for d in dirs:
            if d not in self.library_path:
                self.library_path.append(d)
        inherited = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
        self.env["LD_LIBRARY_PATH"] = ":".join(self.library_path + inherited)

    def remaining_s(self):
        """The time the running step may use: what is left of the budget less the later steps'
        reserves, but at least the step's own reserve (while the budget lasts)."""
        left = self.deadline - time.monotonic()
        return max(min(left, self.floor_s), left - self.held_back_s)

    def begin_step(self, own_reserve_s, later_reserves_s):
        self.floor_s = own_reserve_s
        self.held_back_s = later_reserves_s

    def sanitizer(self):
        """The compute-sanitizer binary (the bundle's, unpacked on first use), or None."""
        return sanitizer.locate(HERE, self.work_dir, self.log)

    def execute(self, argv, timeout_s, system_tool=False, env=None):
        """Runs argv with the bundle's environment (a system_tool with the caller's, so that it
        loads none of the bundle's libraries) plus `env`; returns an Outcome whose output is the
        whole output (the log gets its tail).
        The process group is killed at the timeout or when the run's budget is spent, and the
        command dies with the step's process (PR_SET_PDEATHSIG) should that die first. Output
        goes to a file, not a pipe, so a child that outlives its parent cannot hold us up."""
        timeout_s = max(1.0, min(timeout_s, self.remaining_s()))
        environment = dict(os.environ if system_tool else self.env, **(env or {}))
        self.log.write("\n$ %s%s\n" % ("".join("%s=%s " % kv for kv in sorted((env or {}).items())), " ".join(argv)))
        self.log.flush()
        start = time.monotonic()
        with tempfile.TemporaryFile(dir=self.work_dir) as output_file:
            try:
                process = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=output_file, stderr=subprocess.STDOUT,
                    env=environment, cwd=self.work_dir, start_new_session=True, preexec_fn=die_with_parent)
            except OSError as error:
                self.log.write("could not start: %s\n" % error)
                return Outcome(127, str(error), False, 0.0)
            timed_out = False
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            # Also after a normal exit: whatever the command left running in its group goes.
            kill_group(process)
            output_file.seek(0)
            text = output_file.read().decode("utf-8", "replace")
        if len(text) > LOG_TAIL_BYTES:
            self.log.write("[... %d bytes cut ...]\n" % (len(text) - LOG_TAIL_BYTES) + text[-LOG_TAIL_BYTES:])
        else:
            self.log.write(text)
        seconds = time.monotonic() - start
        self.log.write("[exit %s%s, %.1f s]\n" % (process.returncode, ", TIMED OUT" if timed_out else "", seconds))
        self.log.flush()
        return Outcome(process.returncode, text, timed_out, seconds)


def die_with_parent():
    """In a command's process, before exec: SIGKILL when the step's process dies (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def kill_group(process):
    """Ends the command's process group (start_new_session): SIGTERM, up to 5 s for the
    leader, then SIGKILL for whatever of the group is left."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # nothing left in the group
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def find_library(soname, roots):
    """The first folder among roots' library folders that holds soname, or None."""
    for root in roots:
        if os.path.exists(os.path.join(root, soname)):
            return root
    return None


def library_roots():
    """Where a GPU machine keeps the driver and CUDA's libraries: the loader's cache, the
    lib folders of the Python packages nvidia-* (site-packages/nvidia/<package>/lib), CUDA
    toolkits, the driver's own folder."""
    roots = []
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
        roots += sorted({os.path.dirname(p) for p in re.findall(r"=> (\S+)", cache)})
    except (OSError, subprocess.SubprocessError):
        pass
    site_dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    site_dirs += glob.glob("/opt/*/.venv/lib/python3*/site-packages")
    site_dirs += glob.glob("/usr/local/lib/python3*/dist-packages")
    for site in site_dirs:
        roots += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib")))
    roots += sorted(glob.glob("/usr/local/cuda*/lib64")) + sorted(glob.glob("/usr/local/cuda*/targets/*/lib"))
    roots += ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64"]
    seen, unique = set(), []
    for root in roots:
        if root not in seen and os.path.isdir(root):
            seen.add(root)
            unique.append(root)
    return unique


def nvidia_smi(ctx):
    """name, driver and memory of each GPU by nvidia-smi, and the CUDA version its header
    names; or the reason it gave none."""
    if shutil.which("nvidia-smi") is None:
        return {"error": "nvidia-smi not on PATH"}
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    listed = ctx.execute(query, 30, system_tool=True)
    if listed.rc != 0 or listed.timed_out:
        last = listed.output.strip().splitlines()[-1] if listed.output.strip() else "no output"
        return {"error": "nvidia-smi failed (exit %s): %s" % (listed.rc, last)}
    gpus = []
    for line in listed.output.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3:
            gpus.append({"name": fields[0], "driver": fields[1], "memory": fields[2]})
    result = {"gpus": gpus}
    match = re.search(r"CUDA Version:\s*([\d.]+)", ctx.execute(["nvidia-smi"], 30, system_tool=True).output)
    if match:
        result["cuda_version"] = match.group(1)
    return result


def probe_gpu(ctx):
    """What the GPU machine offers: nvidia-smi, the CUDA probe, the libraries. Adds the
    folders of libcuda and the CUDA libraries the binaries need to the binaries' search path."""
    roots = library_roots()
    needed = set(ctx.manifest.get("gpu_machine_libraries", []))
    found = {}
    for soname in ["libcuda.so.1"] + CUDA_LIBRARIES_TO_FIND + sorted(needed):
        found[soname] = find_library(soname, roots)
    # The CUDA libraries the binaries dlopen (cuBLASLt, NCCL: not in ldd's list) are looked up on
    # the loader's path first, so their folders go there too.
    wanted = ["libcuda.so.1"] + sorted(needed) + CUDA_LIBRARIES_TO_FIND
    ctx.add_library_dirs([found[s] for s in wanted if found[s]])
    gpu = {"nvidia_smi": nvidia_smi(ctx), "libraries": {s: (os.path.join(d, s) if d else None)
                                                         for s, d in found.items()}}
    missing = sorted(s for s in needed if not found[s])
    if missing:
        gpu["missing_libraries"] = missing
    if PROBE in ctx.manifest.get("binaries", []):
        probe = ctx.execute([ctx.binary(PROBE)], 60)
        try:
            gpu["probe"] = json.loads(probe.output.strip().splitlines()[-1]) if probe.rc == 0 else None
        except (ValueError, IndexError):
            gpu["probe"] = None
        if gpu["probe"] is None:
            gpu["probe_error"] = "timed out" if probe.timed_out else "exit %s" % probe.rc
    else:
        gpu["probe_error"] = ctx.manifest.get("missing_binaries", {}).get(PROBE, "not bundled")
    gpu["available"], gpu["reason"] = gpu_verdict(gpu)
    return gpu


def gpu_verdict(gpu):
    """(available, why not) from what nvidia-smi, the loader and the CUDA probe said: the
    driver's absence first, as it explains the rest."""
    probe = gpu.get("probe")
    if probe is not None and any("error" not in d for d in probe.get("devices", [])):
        return True, None
    smi = gpu.get("nvidia_smi", {})
    if probe is None and smi.get("gpus"):
        return True, None  # no word from the probe (not bundled, or it failed): nvidia-smi's
    reasons = []
    if "error" in smi:
        reasons.append(smi["error"])
    if not gpu.get("libraries", {}).get("libcuda.so.1"):
        reasons.append("libcuda.so.1 (the driver) not found")
    if probe is None:
        reasons.append("CUDA probe: %s" % gpu.get("probe_error"))
    else:
        reasons.append(probe.get("error") or "; ".join(d["error"] for d in probe.get("devices", [])))
    return False, "; ".join(r for r in reasons if r)


# --- the report -------------------------------------------------------------------------------


def machine_facts():
    os_name = ""
    try:
        with open("/etc/os-release") as f:
            os_name = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', f.read(), re.M)).get("PRETTY_NAME", "")
    except OSError:
        pass
    return {"os": os_name, "kernel": platform.release(), "glibc": glibc_version(),
            "cpus": os.cpu_count(), "python": platform.python_version()}


def gpu_line(gpu):
    if not gpu["available"]:
        return "no GPU: " + gpu["reason"]
    parts = []
    probe = gpu.get("probe") or {}
    for d in probe.get("devices", []):
        parts.append("%s (sm_%s, %d SMs, %.1f GiB)" % (d["name"], d["compute_capability"].replace(".", ""),
                                                      d["multiprocessors"], d["memory_total_bytes"] / 2**30))
    if not parts:
        parts = [g["name"] for g in gpu["nvidia_smi"].get("gpus", [])]
    smi_gpus = gpu["nvidia_smi"].get("gpus", [])
    versions = []
    if smi_gpus:
        versions.append("driver %s" % smi_gpus[0]["driver"])
    if probe.get("driver_version"):
        versions.append("CUDA driver API %s" % probe["driver_version"])
    if probe.get("runtime_version"):
        versions.append("runtime %s" % probe["runtime_version"])
    return "GPU: %s; %s" % (", ".join(parts), ", ".join(versions))


def render_markdown(report):
    title = "# hsx device check"
    if report.get("from_report"):
        title += " (detail rerun of %s's failed steps: %s)" % (report["from_report"]["date"],
                                                              ", ".join(report["from_report"]["rerun"]) or "none")
    sanitizer_version = (report["bundle"].get("sanitizer") or {}).get("version")
    lines = [title, "",
             "- date: %s" % report["date"],
             "- host: %s (%s, kernel %s, glibc %s, %s CPUs)" % (
                 report["host"], report["machine"]["os"] or "?", report["machine"]["kernel"],
                 report["machine"]["glibc"] or "?", report["machine"]["cpus"]),
             "- bundle: %s, built %s%s" % (report["bundle"].get("commit", "?"), report["bundle"].get("built", "?"),
                                           ", compute-sanitizer %s" % sanitizer_version if sanitizer_version else ""),
             "- %s" % gpu_line(report["gpu"]),
             "- result: **%s** in %.0f s" % (report["result"], report["seconds"]),
             "", "| step | status | s | result |", "|---|---|---|---|"]
    for step in report["steps"]:
        lines.append("| %s: %s | %s | %.1f | %s |" % (step["name"], step["title"], step["status"],
                                                      step["seconds"], step["summary"].replace("|", "/")))
    lines += render_problems(report["steps"])
    libraries = report["gpu"].get("libraries", {})
    lines += ["", "CUDA libraries on this machine: " + ", ".join(
        "%s %s" % (s, p or "not found") for s, p in sorted(libraries.items()))]
    return "\n".join(lines) + "\n"


def render_problems(steps):
    """The report's detail: each failed or crashed test with what it printed (the mismatch
    messages), and each sanitizer finding with its kernel and source line."""
    lines = []
    for step in steps:
        tests = step.get("tests") or {}
        problems = [("crashed (%s)" % t["how"], t) for t in tests.get("crashed", [])]
        problems += [("failed", t) for t in tests.get("failed", [])]
        findings = step.get("findings") or []
        if not problems and not findings:
            continue
        lines += ["", "## %s" % step["name"]]
        for finding in findings:
            lines.append("- %s" % sanitizer.describe(finding))
        for how, test in problems:
            lines += ["", "### %s %s" % (test["name"], how), "", "```", test.get("message", "").strip() or "(nothing printed)",
                      "```"]
    return lines


def write_whole(path, text):
    """Writes text to path through a temporary file and a rename: never half a file."""
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        f.write(text)
    os.replace(temporary, path)


RERUN_STATUSES = ("fail", "error", "timeout", "crashed")  # what --from-report runs again
ISOLATION_GRACE_S = 30  # past the step's time, before its process is killed from outside


class Reporter:
    """Writes report.json and report.md after every step, each file whole (a rename), so that a
    run cut short still leaves the report of every step that finished; the last write is final."""

    def __init__(self, out, manifest, started, origin=None):
        self.out, self.manifest, self.started, self.origin = out, manifest, started, origin
        self.gpu = {"available": False, "reason": "not probed yet", "nvidia_smi": {}, "libraries": {}}

    def write(self, results, steps, final=False):
        done = {r["name"] for r in results}
        pending = [{"name": s.name, "title": s.title, "status": "pending", "summary": "not reached yet",
                    "seconds": 0.0} for s in steps if s.name not in done]
        failed = [r["name"] for r in results if r["status"] in RERUN_STATUSES]
        if final:
            result = "fail (%s)" % ", ".join(failed) if failed else "pass"
        else:
            result = "incomplete: %d of %d steps reported%s" % (
                len(results), len(steps), "; failed so far: " + ", ".join(failed) if failed else "")
        report = {
            "schema": 2,
            "complete": final,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "host": socket.gethostname(),
            "machine": machine_facts(),
            "bundle": {k: self.manifest.get(k) for k in ("commit", "built", "build_type", "cuda_archs", "nvcc",
                                                          "sanitizer")},
            "gpu": self.gpu,
            "steps": results + pending,
            "result": result,
            "seconds": time.monotonic() - self.started,
        }
        if self.origin:
            report["from_report"] = self.origin
        write_whole(os.path.join(self.out, "report.json"), json.dumps(report, indent=2) + "\n")
        write_whole(os.path.join(self.out, "report.md"), render_markdown(report))
        return report


def run(args):
    out = os.path.abspath(args.out)
    with open(os.path.join(HERE, "manifest.json")) as f:
        manifest = json.load(f)
    steps, selected, origin = plan_steps(args)
    reporter = Reporter(out, manifest, time.monotonic(), origin)
    results = []
    # Line-buffered: what a step writes is on disk at once, even if its process then dies.
    with open(os.path.join(out, "device-check.log"), "w", buffering=1) as log:
        ctx = Context(args, manifest, log)
        ctx.add_library_dirs([])
        try:
            try:
                reporter.gpu = probe_gpu(ctx)
            except Exception as error:  # still run the steps that need no GPU, and report
                reporter.gpu = {"available": False, "reason": "the probe broke: %s: %s" % (type(error).__name__, error),
                                "nvidia_smi": {}, "libraries": {}}
            print(gpu_line(reporter.gpu), flush=True)
            reporter.write(results, steps)
            results = run_steps(steps, selected, ctx, reporter.gpu, on_result=lambda done: reporter.write(done, steps),
                                unselected="not in --steps" if not origin else
                                "did not fail in the report of %s" % origin["date"])
        finally:
            shutil.rmtree(ctx.work_dir, ignore_errors=True)
    report = reporter.write(results, steps, final=True)
    print("\n" + render_markdown(report) + "\nreport: %s/report.md, report.json, device-check.log" % out)
    return 1 if report["result"] != "pass" else 0


def plan_steps(args):
    """(steps, selected names, origin): all of STEPS, or with --from-report the failed steps of
    that report, each as its detailed variant (smaller shapes, sanitizer on)."""
    if not args.from_report:
        return STEPS, args.steps, None
    previous = args.previous_report
    failed = {s["name"]: s for s in previous.get("steps", []) if s.get("status") in RERUN_STATUSES}
    steps = [step.detailed(failed[step.name]) if step.name in failed else step for step in STEPS]
    origin = {"path": args.from_report, "date": previous.get("date"), "rerun": sorted(failed)}
    return steps, [s.name for s in steps if s.name in failed], origin


def run_steps(steps, selected, ctx, gpu, on_result=None, unselected="not in --steps"):
    """Runs the selected steps (all when `selected` is empty) in order, each in a process of its
    own (isolated.py) with the later ones' reserves held back from the budget; prints a line per
    step and calls on_result(results so far) after each; returns the results."""
    def will_run(step):
        return (not selected or step.name in selected) and (gpu["available"] or not step.needs_gpu)

    results = []
    for i, step in enumerate(steps):
        if selected and step.name not in selected:
            results.append({"name": step.name, "title": step.title, "status": "not run",
                            "summary": unselected,
                            "seconds": 0.0})
        else:
            ctx.begin_step(step.reserve_s, sum(s.reserve_s for s in steps[i + 1:] if will_run(s)))
            results.append(run_isolated(step, ctx, gpu))
        print("%-16s %-13s %s" % (step.name, results[-1]["status"], results[-1]["summary"]), flush=True)
        if on_result:
            on_result(list(results))
    return results


def run_isolated(step, ctx, gpu):
    """run_step in a forked process: a step that dies (a signal, a hang past its time) is reported
    as such, and the next step starts in a clean process."""
    start = time.monotonic()
    allowance = max(ctx.remaining_s(), 5.0) + ISOLATION_GRACE_S
    path = os.path.join(ctx.work_dir, "result-%s.json" % step.name)
    result = isolated.run_in_own_process(lambda: run_step(step, ctx, gpu), path, allowance, [ctx.log])
    result.setdefault("name", step.name)
    result.setdefault("title", step.title)
    result["seconds"] = round(time.monotonic() - start, 1)
    if result["status"] in ("crashed",):
        ctx.log.write("\n[%s: %s]\n" % (step.name, result["summary"]))
        ctx.log.flush()
    return result


def run_step(step, ctx, gpu):
    start = time.monotonic()
    result = {"name": step.name, "title": step.title}
    missing = [b for b in step.binaries if b not in ctx.manifest.get("binaries", [])]
    if missing:
        why = ctx.manifest.get("missing_binaries", {}).get(missing[0], "not in the bundle")
        result.update(status="not built", summary="%s: %s" % (", ".join(missing), why))
    elif step.needs_gpu and not gpu["available"]:
        result.update(status="skip", summary="no GPU")
    elif ctx.remaining_s() < 5:
        result.update(status="skip", summary="the run's time budget was spent")
    else:
        ctx.log.write("\n== %s: %s\n" % (step.name, step.title))
        try:
            result.update(step.run(ctx))
        except Exception as error:  # a broken step is reported, the others still run
            result.update(status="error", summary="%s: %s" % (type(error).__name__, error))
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def main(argv):
    parser = argparse.ArgumentParser(
        prog="run.sh", description="Runs the hsx device check from this bundle and writes report.md, "
        "report.json and device-check.log to --out (default: $OUT). Exits 0 when nothing that ran "
        "failed, also on a machine without a GPU (the report then says 'no GPU: <reason>').")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the report (default $OUT)")
    parser.add_argument("--budget-s", type=float, default=480,
                        help="hard limit for the whole run in seconds (default 480, at most %d)" % MAX_BUDGET_S)
    parser.add_argument("--steps", default="",
                        help="comma-separated names of the steps to run (default: all): "
                        + ", ".join(step.name for step in STEPS))
    parser.add_argument("--from-report", metavar="REPORT_JSON",
                        help="rerun only the steps that failed (fail, error, timeout, crashed) in this earlier "
                        "report.json, with more detail: only their failed tests, small shapes "
                        "(HSX_TEST_SHAPES=small), under compute-sanitizer memcheck; benchmarks on smaller sizes")
    parser.add_argument("--list-binaries", action="store_true",
                        help="print the binaries the steps need, one a line (used by prepare), and exit")
    args = parser.parse_args(argv)
    if args.list_binaries:
        print("\n".join(required_binaries()))
        return 0
    args.steps = [name for name in args.steps.split(",") if name]
    args.previous_report = None
    if args.from_report:
        if args.steps:
            parser.error("--from-report and --steps: give one (the report chooses the steps)")
        try:
            with open(args.from_report) as f:
                args.previous_report = json.load(f)
        except (OSError, ValueError) as error:
            parser.error("--from-report: cannot read %s: %s" % (args.from_report, error))
        if not isinstance(args.previous_report, dict) or not isinstance(args.previous_report.get("steps"), list):
            parser.error("--from-report: %s is not a device-check report.json (no list 'steps')" % args.from_report)
    unknown = [name for name in args.steps if name not in [step.name for step in STEPS]]
    if unknown:
        parser.error("--steps: no step named %s (the steps: %s)" % (
            ", ".join(unknown), ", ".join(step.name for step in STEPS)))
    if not args.out:
        parser.error("--out: no folder given and OUT is not set")
    if not 10 <= args.budget_s <= MAX_BUDGET_S:
        parser.error("--budget-s: %g is outside 10..%d" % (args.budget_s, MAX_BUDGET_S))
    if not os.path.exists(os.path.join(HERE, "manifest.json")):
        parser.error("no manifest.json beside %s: run it from a bundle made by "
                     "scripts/device-check.sh --prepare" % os.path.basename(__file__))
    try:
        os.makedirs(args.out, exist_ok=True)
        probe_file = os.path.join(args.out, ".writable")
        open(probe_file, "w").close()
        os.remove(probe_file)
    except OSError as error:
        parser.error("--out: cannot write to %s: %s" % (args.out, error.strerror or error))
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
