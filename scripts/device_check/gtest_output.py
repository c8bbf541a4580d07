"""What a GoogleTest binary's output says, test by test, also when the binary died before it could
write its XML report: which tests finished and how, which one was running when it died, what each
failing test printed, and whether a failure left the CUDA context poisoned (a sticky error), which
makes the tests after it fail for no fault of their own.

Standard library only (it runs on the GPU machine inside the device-check bundle).
"""

import re
import xml.etree.ElementTree as ElementTree

RUN = re.compile(r"^\[ RUN      \] (\S+)\s*$")
END = re.compile(r"^\[ +(OK|FAILED|SKIPPED) +\] (\S+) \(\d+ ms\)\s*$")

# CUDA errors after which the process's context is unusable (kernels/cuda/cuda_errors.cc,
# IsStickyError), by the names cudaGetErrorName gives them, and the device-lost mark the backend
# puts on such a status.
STICKY = re.compile(
    r"cudaError(IllegalAddress|LaunchTimeout|Assert|HardwareStackError|IllegalInstruction|MisalignedAddress"
    r"|InvalidAddressSpace|InvalidPc|LaunchFailure|TensorMemoryLeak|Contained|MpsClientTerminated"
    r"|ExternalDevice|ECCUncorrectable|NvlinkUncorrectable|DevicesUnavailable|NoDevice|ContextIsDestroyed"
    r"|DeviceUninitialized|Unknown)\b|device lost")

MESSAGE_CHARS = 4000  # of one failing test's output, kept in the report


def tests_in_output(text):
    """[(name, status, output)] in the order the tests ran: status is OK, FAILED, SKIPPED, or None
    for a test that started and never finished (the binary died or was killed in it); output is
    what the test printed between its RUN and end lines."""
    tests, current, lines = [], None, []
    for line in text.splitlines():
        run = RUN.match(line)
        if run:
            if current is not None:
                tests.append((current, None, "\n".join(lines)))
            current, lines = run.group(1), []
            continue
        end = END.match(line)
        if end and current == end.group(2):
            tests.append((current, end.group(1), "\n".join(lines)))
            current, lines = None, []
            continue
        if current is not None:
            lines.append(line)
    if current is not None:
        tests.append((current, None, "\n".join(lines)))
    return tests


def first_lines(text, limit=MESSAGE_CHARS):
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + " [... %d more characters]" % (len(text) - limit)


def exclude(gtest_filter, names):
    """A --gtest_filter that runs what gtest_filter runs, less `names`."""
    positive, _, negative = (gtest_filter or "*").partition("-")
    negatives = [n for n in negative.split(":") if n] + [n for n in names if n]
    return (positive or "*") + ("-" + ":".join(negatives) if negatives else "")


def only(names):
    """A --gtest_filter that runs exactly `names`."""
    return ":".join(names)


def sticky_failure(failures):
    """The first failure whose message names a sticky CUDA error, or None."""
    for failure in failures:
        if STICKY.search(failure["message"]):
            return failure
    return None


def parse_gtest_xml(path):
    """Counts of one gtest run and the distinct reasons given for skips."""
    root = ElementTree.parse(path).getroot()
    counts = {"tests": 0, "passed": 0, "failed": 0, "skipped": 0, "disabled": 0}
    reasons = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        if case.get("status") == "notrun":
            counts["disabled"] += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None or case.get("result") == "skipped":
            counts["skipped"] += 1
            skipped = case.find("skipped")
            message = (skipped.get("message") or "").strip() if skipped is not None else ""
            reason = message.splitlines()[-1] if message else "no reason given"
            if reason not in reasons:
                reasons.append(reason)
        else:
            counts["passed"] += 1
    return counts, reasons


def xml_failures(path):
    """[{"name": Suite.Test, "message": ...}] for each failing test of a --gtest_output=xml report."""
    failures = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        found = case.findall("failure") + case.findall("error")
        if found:
            name = "%s.%s" % (case.get("classname"), case.get("name"))
            text = "\n".join((f.get("message") or f.text or "").strip() for f in found)
            failures.append({"name": name, "message": first_lines(text)})
    return failures
