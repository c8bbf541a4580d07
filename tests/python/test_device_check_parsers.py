"""What the device check reads out of its tools' output: compute-sanitizer's findings (kernel,
source line, the test that was running), and a gtest run whose first failure poisoned the CUDA
context (the failures after it run again in a fresh process)."""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts" / "device_check"))
import gtest_output  # noqa: E402
import runner  # noqa: E402
import sanitizer  # noqa: E402

MEMCHECK = """\
========= COMPUTE-SANITIZER
[ RUN      ] Cuda/BackendConformance.MoeExpertsMatchReference/cuda_bf16
========= Invalid __global__ read of size 2 bytes
=========     at hsx::cuda::GatherRows(const unsigned short *, int)+0x1b0 in /src/kernels/cuda/moe.cu:120
=========     by thread (3,0,0) in block (7,0,0)
=========     Address 0x7f00 is out of bounds
=========
========= Invalid __global__ read of size 2 bytes
=========     at hsx::cuda::GatherRows(const unsigned short *, int)+0x1b0 in /src/kernels/cuda/moe.cu:120
=========     by thread (4,0,0) in block (7,0,0)
=========
[  FAILED  ] Cuda/BackendConformance.MoeExpertsMatchReference/cuda_bf16 (20 ms)
[ RUN      ] CudaModelTest.MatchesTheCpuBackend
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaStreamSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========
========= ERROR SUMMARY: 3 errors
"""

RACECHECK_OLDER = """\
[ RUN      ] Cuda/BackendConformance.AttentionMatchesReferenceAcrossQueryBlocks/cuda_fp32
========= Error: Race reported between Write access at 0x00000a10 in /src/kernels/cuda/attention.cu:88:hsx::cuda::AttentionTile(float*)
=========     and Read access at 0x00000b20 in /src/kernels/cuda/attention.cu:95:hsx::cuda::AttentionTile(float*) [64 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
========= ERROR SUMMARY: 1 error
"""


def test_memcheck_findings_name_kernel_line_and_test_and_merge_repeats():
    found = sanitizer.findings(MEMCHECK, "memcheck")
    assert found == [
        {"tool": "memcheck", "what": "Invalid __global__ read of size 2 bytes",
         "kernel": "hsx::cuda::GatherRows(const unsigned short *, int)", "line": "/src/kernels/cuda/moe.cu:120",
         "test": "Cuda/BackendConformance.MoeExpertsMatchReference/cuda_bf16", "count": 2},
        {"tool": "memcheck", "what": 'Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch '
                                     'failure" on CUDA API call to cudaStreamSynchronize.',
         "kernel": None, "line": None, "test": "CudaModelTest.MatchesTheCpuBackend", "count": 1}]
    assert sanitizer.error_count(MEMCHECK) == 3
    assert sanitizer.describe(found[0]) == (
        "memcheck: Invalid __global__ read of size 2 bytes in hsx::cuda::GatherRows(const unsigned short *, int)"
        " (/src/kernels/cuda/moe.cu:120) in Cuda/BackendConformance.MoeExpertsMatchReference/cuda_bf16 x2")


def test_racecheck_findings_in_the_older_location_format():
    found = sanitizer.findings(RACECHECK_OLDER, "racecheck")
    assert [(f["what"], f["kernel"], f["line"]) for f in found] == [
        ("Error: Race reported between Write access", "hsx::cuda::AttentionTile(float*)",
         "/src/kernels/cuda/attention.cu:88")]
    assert found[0]["test"] == "Cuda/BackendConformance.AttentionMatchesReferenceAcrossQueryBlocks/cuda_fp32"
    assert sanitizer.error_count(RACECHECK_OLDER) == 1
    assert sanitizer.findings("========= ERROR SUMMARY: 0 errors\n", "initcheck") == []


def test_the_sanitizer_command_line_per_tool():
    assert sanitizer.command("/s", "racecheck") == [
        "/s", "--tool", "racecheck", "--print-limit", "100", "--error-exitcode", "86", "--racecheck-report", "analysis"]
    detail = sanitizer.command("/s", "memcheck", detail=True)
    assert detail[detail.index("--print-limit") + 1] == "1000" and detail[-2:] == ["--show-backtrace", "both"]


XML = """<?xml version="1.0"?><testsuites><testsuite name="S">
<testcase name="A" classname="S" status="run" result="completed"/>
<testcase name="Boom" classname="S" status="run" result="completed"><failure message="Linear: error cudaErrorIllegalAddress: an illegal memory access"/></testcase>
<testcase name="C" classname="S" status="run" result="completed"><failure message="RmsNorm: cudaErrorIllegalAddress"/></testcase>
<testcase name="D" classname="S" status="run" result="completed"><failure message="Add: cudaErrorIllegalAddress"/></testcase>
</testsuite></testsuites>"""

OUTPUT = (
    "[ RUN      ] S.A\n[       OK ] S.A (1 ms)\n"
    "[ RUN      ] S.Boom\n[  FAILED  ] S.Boom (1 ms)\n"
    "[ RUN      ] S.C\n[  FAILED  ] S.C (1 ms)\n"
    "[ RUN      ] S.D\n[  FAILED  ] S.D (1 ms)\n")


def test_failures_after_a_sticky_cuda_error_run_again_in_a_fresh_process(tmp_path):
    xml = tmp_path / "1.xml"
    xml.write_text(XML)
    tally = runner.GTestTally()
    next_filter = tally.add(runner.Outcome(1, OUTPUT, False, 1.0), str(xml), "S.*")
    assert next_filter == "S.C:S.D"  # only the failures after the sticky one
    assert [f["name"] for f in tally.failures] == ["S.Boom"]
    assert tally.counts == {"tests": 2, "passed": 1, "failed": 1, "skipped": 0, "disabled": 0}
    # In the fresh process they pass: the report keeps one defect, not three.
    rerun = tmp_path / "2.xml"
    rerun.write_text('<?xml version="1.0"?><testsuites><testsuite name="S">'
                     '<testcase name="C" classname="S" status="run" result="completed"/>'
                     '<testcase name="D" classname="S" status="run" result="completed"/></testsuite></testsuites>')
    assert tally.add(runner.Outcome(0, "", False, 1.0), str(rerun), next_filter) is None
    assert tally.counts["tests"] == 4 and tally.counts["failed"] == 1 and tally.counts["passed"] == 3
    assert "S.Boom left a sticky CUDA error" in tally.notes[0]


def test_gtest_output_names_the_test_a_crash_interrupted():
    text = "[ RUN      ] S.A\nhello\n[       OK ] S.A (0 ms)\n[ RUN      ] S.B\nabout to crash\n"
    assert gtest_output.tests_in_output(text) == [("S.A", "OK", "hello"), ("S.B", None, "about to crash")]
    assert gtest_output.exclude("S.*-S.X", ["S.A", "S.B"]) == "S.*-S.X:S.A:S.B"
    assert gtest_output.exclude(None, ["S.A"]) == "*-S.A"
