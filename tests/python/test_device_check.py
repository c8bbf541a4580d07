"""The device check (scripts/device-check.sh) on this machine, which has no GPU: the bundle is
self-contained (it runs in a root holding only glibc), the run reports "no GPU: <reason>" and
exits 0, a broken bundle or a hung step is reported as such, and bad arguments get precise
errors. The GPU side of the report is exercised with a fake nvidia-smi and probe.
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "device-check.sh"
sys.path.insert(0, str(REPO_ROOT / "scripts" / "device_check"))
import runner  # noqa: E402

BUILD_DIR = os.environ.get("HSX_BUILD_DIR", "build")


def have_gpu():
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


def run(argv, env=None, timeout=300):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                          env=env, check=False)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A bundle prepared from the build the other tests use (a no-op build when it is current)."""
    path = tmp_path_factory.mktemp("device") / "bundle"
    proc = run([SCRIPT, "--prepare", "--build-dir", BUILD_DIR, "--bundle", path])
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "MiB" in proc.stdout
    return path


@pytest.fixture
def bundle_copy(bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy, symlinks=True)
    return copy


def run_bundle(bundle, out, *args, env=None):
    proc = run(["bash", bundle / "run.sh", "--out", out, *args], env=env)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    return proc, report


def step(report, name):
    return next(s for s in report["steps"] if s["name"] == name)


def test_bundle_is_small_and_lists_what_it_carries(bundle):
    size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    assert size <= 64 * 2**20
    manifest = json.loads((bundle / "manifest.json").read_text())
    # compute-sanitizer, packed: the package's own files, its binary among them.
    assert manifest["sanitizer"]["archive"] == "sanitizer.tar.xz" and manifest["sanitizer"]["version"].startswith("13.")
    with tarfile.open(bundle / "sanitizer.tar.xz") as tar:
        names = tar.getnames()
    assert "cu13/bin/compute-sanitizer" in names and "cu13/lib/libsanitizer-public.so" in names
    assert not [n for n in names if "cublas" in n or "cudart" in n], "other nvidia packages' files carried"
    assert set(manifest["binaries"]) | set(manifest["missing_binaries"]) == set(runner.required_binaries())
    carried = set(os.listdir(bundle / "lib"))
    assert set(manifest["libraries"]) == carried
    assert {"libstdc++.so.6", "libgcc_s.so.1", "libgrpc.so.29"} <= carried
    assert not [s for s in carried if not runner.carried(s)], "glibc, driver or cuBLAS/cuDNN/NCCL carried"


def test_run_here_says_no_gpu_and_exits_0(bundle, tmp_path):
    proc, report = run_bundle(bundle, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["device-check.log", "report.json", "report.md"]
    assert report["gpu"]["available"] == have_gpu()
    if not have_gpu():
        assert report["gpu"]["reason"]
        assert "- no GPU: " + report["gpu"]["reason"] in (tmp_path / "report.md").read_text()
        assert proc.stdout.startswith("no GPU: ")
    assert report["result"] == "pass"
    assert [s["name"] for s in report["steps"]] == [s.name for s in runner.STEPS]
    assert step(report, "bundle")["status"] == "pass"
    assert step(report, "cpu_unit")["status"] == "pass" and step(report, "cpu_unit")["counts"]["passed"] > 0
    assert step(report, "cpu_pipeline")["status"] == "pass"
    assert step(report, "stream_cost")["status"] == ("pass" if have_gpu() else "skip"), step(report, "stream_cost")
    forward = step(report, "gpu_forward")
    if "gpu_forward" in json.loads((bundle / "manifest.json").read_text())["binaries"]:
        if have_gpu():
            assert forward["status"] == "pass" and forward["result"]["forwards"], forward
        else:  # the benchmark itself says so and exits 0
            assert forward["status"] == "skip" and forward["summary"].startswith("gpu_forward: no GPU: "), forward
    else:
        assert forward["status"] == "not built", forward
    # CUDA tests: they skip here, saying why
    for gpu_suite in ("oracle", "batch_invariance", "tensor_parallel", "capture_overlap"):
        assert step(report, gpu_suite)["status"] in (("pass",) if have_gpu() else ("skip", "pass")), \
            step(report, gpu_suite)
    cuda = step(report, "cuda_kernels")
    if "hsx_cuda_tests" in json.loads((bundle / "manifest.json").read_text())["binaries"]:
        counts = cuda["counts"]
        assert counts["failed"] == 0 and counts["tests"] > 0
        if not have_gpu():  # the kernel tests skip, saying why; the argument checks run
            assert counts["skipped"] > 0 and "no CUDA device" in cuda["summary"]


def test_bundle_runs_in_a_root_with_only_glibc(bundle, tmp_path):
    """The bundled binaries start where none of this machine's libraries exist but glibc's:
    the GPU machine has no Debian -dev packages. A binary from the build tree, as a control,
    must fail there."""
    if os.geteuid() != 0 or not (shutil.which("chroot") and shutil.which("unshare")):
        pytest.skip("needs root, chroot and unshare to build a root holding only glibc")
    namespace = run(["unshare", "--mount", "--propagation", "private", "true"])
    if namespace.returncode != 0:
        pytest.skip("no mount namespace here (unshare: %s)" % namespace.stderr.strip())
    root = tmp_path / "root"
    shutil.copytree(bundle, root / "b", symlinks=True)
    (root / "tmp").mkdir()
    (root / "proc").mkdir()  # the loader resolves $ORIGIN through /proc/self/exe
    glibc = set()
    for binary in (bundle / "bin").iterdir():
        out = run(["ldd", binary]).stdout
        glibc |= {p for s, p in runner.parse_ldd(out) if p and not runner.carried(s) and p.startswith("/")}
    for path in glibc:
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(path), target)
    shutil.copy2(REPO_ROOT / BUILD_DIR / "bin" / "hsx-inspect", root / "unbundled-hsx-inspect")

    def chrooted(*argv):
        # /proc bound in a mount namespace of its own: gone when the command ends.
        script = 'mount --rbind /proc "$0/proc" && exec chroot "$0" "$@"'
        return run([shutil.which("unshare"), "--mount", "--propagation", "private", "sh", "-c", script,
                    root, *argv], env={"PATH": "/b/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, timeout=120)

    control = chrooted("/unbundled-hsx-inspect", "--version")
    assert control.returncode != 0 and "error while loading shared libraries" in control.stderr
    manifest = json.loads((bundle / "manifest.json").read_text())
    if "hsx_cuda_probe" in manifest["binaries"]:
        probe = chrooted("/b/bin/hsx_cuda_probe")
        assert probe.returncode == 0, probe.stderr
        assert json.loads(probe.stdout)["device_count"] == 0
    for binary in ("hsx_unit_tests", "hsx_cuda_tests"):
        if binary in manifest["binaries"]:
            listed = chrooted("/b/bin/" + binary, "--gtest_list_tests")
            assert listed.returncode == 0 and "." in listed.stdout, listed.stderr
    made = chrooted("/b/bin/hsx-make-model", "--preset", "tiny", "--out", "/tmp/m")
    assert made.returncode == 0, made.stderr
    inspected = chrooted("/b/bin/hsx-inspect", "--model", "/tmp/m", "--json")
    assert inspected.returncode == 0 and json.loads(inspected.stdout)["architecture"]["hidden_size"] > 0
    for tool in ("hsx-dump", "hsx-verify"):
        assert chrooted("/b/bin/" + tool, "--version").returncode == 0


def test_a_library_missing_from_the_bundle_fails_the_bundle_step(bundle_copy, tmp_path):
    (bundle_copy / "lib" / "libxxhash.so.0").unlink()
    out = tmp_path / "out"
    proc, report = run_bundle(bundle_copy, out, "--steps", "bundle")
    assert proc.returncode == 1
    assert report["result"] == "fail (bundle)"
    summary = step(report, "bundle")["summary"]
    assert "libxxhash.so.0" in summary and ("outside the bundle" in summary or "not found" in summary)
    assert step(report, "cpu_unit")["status"] == "not run"


def test_a_hung_suite_is_killed_within_the_budget(bundle_copy, tmp_path):
    hung = bundle_copy / "bin" / "hsx_unit_tests"
    pid_file = tmp_path / "child.pid"
    hung.write_text("#!/bin/sh\nsleep 300 &\necho $! > %s\nsleep 300\n" % pid_file)
    hung.chmod(0o755)
    out = tmp_path / "out"
    proc, report = run_bundle(bundle_copy, out, "--steps", "cpu_unit", "--budget-s", "10")
    assert proc.returncode == 1
    assert step(report, "cpu_unit")["status"] == "timeout"
    assert step(report, "cpu_unit")["seconds"] < 20
    assert step(report, "cpu_unit")["summary"].startswith("killed at its time limit, after ")
    assert report["seconds"] < 25
    # The suite's own children die with it (the process group is killed), not only the suite.
    stat = Path("/proc/%s/stat" % pid_file.read_text().strip())
    assert not stat.exists() or stat.read_text().split()[2] == "Z"


def test_gpu_side_of_the_report_with_a_fake_gpu(bundle_copy, tmp_path):
    """What the report says where a GPU exists, from a fake nvidia-smi and probe."""
    fake_bin = tmp_path / "fakebin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$1" in\n  --query-gpu=*) echo "NVIDIA H200, 580.159.04, 143771 MiB" ;;\n'
                   '  *) echo "| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0 |" ;;\nesac\n')
    probe = bundle_copy / "bin" / "hsx_cuda_probe"
    device = {"index": 0, "name": "NVIDIA H200", "compute_capability": "9.0", "multiprocessors": 132,
              "memory_total_bytes": 150754820096, "memory_free_bytes": 150000000000, "l2_bytes": 62914560}
    probe.write_text("#!/bin/sh\necho '%s'\n" % json.dumps(
        {"runtime_version": "13.0", "driver_version": "13.0", "device_count": 1, "devices": [device]}))
    for script in (smi, probe):
        script.chmod(0o755)
    env = dict(os.environ, PATH="%s:%s" % (fake_bin, os.environ["PATH"]))
    out = tmp_path / "out"
    proc, report = run_bundle(bundle_copy, out, "--steps", "cpu_pipeline", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["gpu"]["available"] is True and report["gpu"]["reason"] is None
    headline = "GPU: NVIDIA H200 (sm_90, 132 SMs, 140.4 GiB); driver 580.159.04, CUDA driver API 13.0, runtime 13.0"
    assert proc.stdout.startswith(headline)
    assert "- " + headline in (out / "report.md").read_text()
    assert report["gpu"]["nvidia_smi"]["cuda_version"] == "13.0"


def test_gpu_forward_result_line_and_summary():
    output = "gpu_forward: x\nRESULT not json\n" + "RESULT " + json.dumps({
        "gpu": True, "peak_tflops": 771.2, "dequant_ms": 1.5, "dequant_gbs": 2900, "forwards": [
            {"tokens": 8192, "tokens_per_s": 51234.5, "routed_gemm_tflops": 402.0, "classes": {
                "attention projections": {"tflops": 512.3}, "routed experts": {"tflops": 301.0},
                "attention": {"tflops": 4.56}}}]}) + "\n"
    result = runner.parse_bench_result(output)
    assert result["peak_tflops"] == 771.2
    assert runner.summarize_forward(result) == (
        "peak 771 TF/s; dequant 1.50 ms (2900 GB/s); 8k: 51234 tok/s (proj 512, routed 301 [GEMMs 402], attn 4.6 TF/s)")
    result["captures"] = {"tokens": 32768, "mb": 1409.3, "copy_ms": 28.04, "exposed_overlap_off_ms": 27.5,
                          "exposed_overlap_on_ms": 1.25}
    assert runner.summarize_forward(result).endswith(
        "; captures 32k (1409 MB): copies 28.0 ms, paid 27.5 ms overlap off, 1.2 ms on")
    assert runner.parse_bench_result("RESULT {broken\n") is None
    assert runner.parse_bench_result("no result line\n") is None


def test_gpu_verdict():
    no_driver = {"nvidia_smi": {"error": "nvidia-smi not on PATH"}, "libraries": {"libcuda.so.1": None},
                 "probe": {"devices": [], "error": "cudaGetDeviceCount: CUDA driver version is insufficient"}}
    assert runner.gpu_verdict(no_driver) == (
        False, "nvidia-smi not on PATH; libcuda.so.1 (the driver) not found; "
               "cudaGetDeviceCount: CUDA driver version is insufficient")
    broken_device = {"nvidia_smi": {"gpus": [{"name": "X"}]}, "libraries": {"libcuda.so.1": "/l/libcuda.so.1"},
                     "probe": {"devices": [{"index": 0, "error": "cudaMemGetInfo: out of memory"}]}}
    assert runner.gpu_verdict(broken_device) == (False, "cudaMemGetInfo: out of memory")
    no_probe = {"nvidia_smi": {"gpus": [{"name": "X"}]}, "libraries": {}, "probe": None}
    assert runner.gpu_verdict(no_probe) == (True, None)


def test_parse_gtest_xml(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites tests="4">
<testsuite name="S"><testcase name="a" status="run" result="completed"/>
<testcase name="b" status="run" result="completed"><failure message="x"/></testcase>
<testcase name="c" status="run" result="skipped"><skipped message="f.cc:3&#x0A;no CUDA device: none"/></testcase>
<testcase name="DISABLED_d" status="notrun" result="suppressed"/></testsuite></testsuites>""")
    counts, reasons = runner.parse_gtest_xml(str(xml))
    assert counts == {"tests": 4, "passed": 1, "failed": 1, "skipped": 1, "disabled": 1}
    assert reasons == ["no CUDA device: none"]


def test_parse_ldd():
    text = ("\tlinux-vdso.so.1 (0x00007ffd)\n\tlibxxhash.so.0 => /lib/x/libxxhash.so.0 (0x00007f84)\n"
            "\tlibcublasLt.so.13 => not found\n\t/lib64/ld-linux-x86-64.so.2 (0x00007f85)\n")
    assert runner.parse_ldd(text) == [("linux-vdso.so.1", "linux-vdso.so.1"),
                                      ("libxxhash.so.0", "/lib/x/libxxhash.so.0"),
                                      ("libcublasLt.so.13", None),
                                      ("ld-linux-x86-64.so.2", "/lib64/ld-linux-x86-64.so.2")]
    assert [runner.carried(s) for s in ("libc.so.6", "libcares.so.2", "libcuda.so.1", "libnvidia-ml.so.1",
                                        "libcudnn_graph.so.9", "libnccl.so.2", "libstdc++.so.6", "libm.so.6")] == \
        [False, True, False, False, False, False, True, False]


def test_a_gpu_step_is_skipped_without_a_gpu_and_a_broken_step_is_reported(tmp_path):
    class NeedsGpu(runner.Step):
        needs_gpu = True

        def run(self, ctx):
            raise AssertionError("ran without a GPU")

    class Broken(runner.Step):
        def run(self, ctx):
            raise KeyError("boom")

    class Ctx:
        manifest = {"binaries": []}
        log = open(tmp_path / "log", "w")

        def remaining_s(self):
            return 100

    no_gpu = {"available": False}
    assert runner.run_step(NeedsGpu("g", "t"), Ctx(), no_gpu)["status"] == "skip"
    result = runner.run_step(Broken("b", "t"), Ctx(), no_gpu)
    assert (result["status"], result["summary"]) == ("error", "KeyError: 'boom'")


def run_stream_cost(tmp_path, **options):
    """runner.StreamCost run here against the build's binaries: (result, tokens of its samples)."""
    args = type("Args", (), {"budget_s": 120})()
    with open(tmp_path / "log", "w") as log:
        ctx = runner.Context(args, {"binaries": []}, log)
        ctx.bin_dir = os.path.abspath(os.path.join(BUILD_DIR, "bin"))
        try:
            result = runner.StreamCost(**options).run(ctx)
            samples = os.path.join(ctx.work_dir, "stream-samples.jsonl")
            tokens = sum(len(json.loads(line)["input_ids"]) for line in open(samples)) if os.path.exists(samples) else 0
        finally:
            shutil.rmtree(ctx.work_dir, ignore_errors=True)
    return result, tokens


def test_the_stream_cost_step_measures_server_client_and_socket_pair(tmp_path):
    # On the CPU backend here (the device check runs it with --device cuda), a smaller set-up, but
    # about 64 MB a pass: the server's CPU comes from /proc in 10 ms ticks.
    result, tokens = run_stream_cost(tmp_path, device="cpu", hidden=4096, vocab=1000, samples=16, lengths=(256, 768))
    assert result["status"] == "pass", result
    measured = result["result"]
    assert measured["bytes"] == tokens * 4096 * 2 and tokens >= 16 * 256  # capture 0 of every sample, bf16
    assert measured["passes"] == 3 and measured["device"] == "cpu"
    for key in ("server", "client", "socket_sender", "socket_receiver"):
        assert measured[key + "_ns_per_byte"] > 0, key
    assert 0 <= measured["engine_ns_per_byte"] <= measured["server_ns_per_byte"]
    assert 0 <= measured["streaming_ns_per_byte"] <= measured["server_ns_per_byte"]  # whole - engine, per pass
    assert result["summary"].startswith("%.2f GB x 3 passes: server " % (measured["bytes"] / 1e9))
    assert "hsx-dump --discard" in result["summary"]


def test_the_stream_cost_step_runs_the_benchmarks_set_up():
    # The runner carries its own copy (the bundle has no bench/): it must stay bench/stream_cost.py's.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import bench_util
    step = runner.StreamCost()
    assert step.config == {**bench_util.NARROW_ATTENTION, "hidden_size": 7168, "vocab_size": 32000,
                           "n_routed_experts": 0}
    assert (step.samples, step.lengths, step.device, step.needs_gpu) == (64, (512, 2048), "cuda", True)


def test_the_stream_cost_step_reports_a_server_that_does_not_start(tmp_path):
    result, _ = run_stream_cost(tmp_path, device="tpu", hidden=64, vocab=100, samples=2, lengths=(4, 8))
    assert result["status"] == "fail" and result["summary"].startswith("hsx-server exited "), result
    assert "tpu" in result["summary"], result


def test_a_hung_step_leaves_the_later_steps_their_reserve(tmp_path):
    # A step that would hang for 100 s in a 12 s budget is cut when only the later steps'
    # reserves (6 s) are left; without them it would take the whole budget and the next step
    # would be skipped as "the run's time budget was spent".
    class Hangs(runner.Step):
        reserve_s = 1

        def run(self, ctx):
            outcome = ctx.execute(["sleep", "100"], 100, system_tool=True)
            return {"status": "timeout" if outcome.timed_out else "pass", "summary": ""}

    class Quick(runner.Step):
        reserve_s = 6

        def run(self, ctx):
            return {"status": "pass", "summary": "%.1f s left" % ctx.remaining_s()}

    args = type("Args", (), {"budget_s": 12})()
    with open(tmp_path / "log", "w") as log:
        ctx = runner.Context(args, {"binaries": []}, log)
        try:
            results = runner.run_steps([Hangs("hangs", "t"), Quick("quick", "t")], [], ctx, {"available": False})
        finally:
            shutil.rmtree(ctx.work_dir, ignore_errors=True)
    assert [r["status"] for r in results] == ["timeout", "pass"]
    assert 5.0 <= results[0]["seconds"] <= 7.5
    assert float(results[1]["summary"].split()[0]) >= 4.5


@pytest.mark.parametrize("args, message", [
    ([], "--out: no folder given and OUT is not set"),
    (["--out", "F"], "--out: cannot write to"),
    (["--out", "X", "--budget-s", "600"], "--budget-s: 600 is outside 10..540"),
    (["--out", "X", "--steps", "cpu_unit,nope"], "--steps: no step named nope"),
    (["--out", "X", "--from-report", "F"], "--from-report: cannot read"),
    (["--out", "X", "--from-report", "J"], "is not a device-check report.json (no list 'steps')"),
    (["--out", "X", "--from-report", "J", "--steps", "cpu_unit"], "--from-report and --steps: give one"),
])
def test_run_rejects_bad_arguments(bundle, tmp_path, args, message):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    (tmp_path / "F").write_text("a file, not a folder")
    (tmp_path / "J").write_text('{"date": "d"}')
    proc = run(["bash", bundle / "run.sh", *[str(tmp_path / a) if a in ("X", "F", "J") else a for a in args]], env=env)
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "X").exists()


def test_script_rejects_bad_usage(tmp_path):
    proc = run([SCRIPT, "--bogus"])
    assert proc.returncode == 2 and "say --prepare or --run (got '--bogus')" in proc.stderr
    proc = run([SCRIPT, "--run", "--bundle", tmp_path / "none", "--out", tmp_path])
    assert proc.returncode == 2 and "no bundle in" in proc.stderr and "--prepare first" in proc.stderr
    proc = run([sys.executable, REPO_ROOT / "scripts" / "device_check" / "runner.py", "--out", tmp_path])
    assert proc.returncode == 2 and "no manifest.json beside runner.py" in proc.stderr


def test_prepare_refuses_a_sanitizer_or_debug_build_and_keeps_the_old_bundle(bundle_copy, tmp_path):
    build = tmp_path / "build-debug"
    build.mkdir()
    (build / "build.ninja").write_text("")
    (build / "CMakeCache.txt").write_text("CMAKE_BUILD_TYPE:STRING=Debug\nHSX_SANITIZE:STRING=address\n")
    before = sorted(p.name for p in bundle_copy.rglob("*"))
    proc = run([SCRIPT, "--prepare", "--build-dir", build, "--bundle", bundle_copy])
    assert proc.returncode == 1
    assert "is a Debug build with HSX_SANITIZE=address" in proc.stderr and str(build) in proc.stderr
    assert sorted(p.name for p in bundle_copy.rglob("*")) == before
    assert not Path(str(bundle_copy) + ".tmp").exists()


def test_prepare_enforces_the_size_limit(bundle_copy):
    before = (bundle_copy / "manifest.json").read_text()
    proc = run([SCRIPT, "--prepare", "--build-dir", BUILD_DIR, "--bundle", bundle_copy, "--max-mib", "1"])
    assert proc.returncode == 1 and "MiB, over --max-mib 1" in proc.stderr
    assert (bundle_copy / "manifest.json").read_text() == before
    assert not Path(str(bundle_copy) + ".tmp").exists()


# --- isolation, reports written as they go, and the detail rerun ----------------------------------

ISOLATION_SCRIPT = r'''
import json, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import runner
out = sys.argv[2]

class Dies(runner.Step):
    def run(self, ctx):
        ctx.log.write("dies: halfway through\n")
        os.kill(os.getpid(), signal.SIGSEGV)

class ReadsTheReport(runner.Step):
    def run(self, ctx):
        with open(os.path.join(out, "report.json")) as f:
            steps = json.load(f)["steps"]
        return {"status": "pass", "summary": ", ".join("%s %s" % (s["name"], s["status"]) for s in steps)}

steps = [Dies("dies", "dies by SIGSEGV halfway"), ReadsTheReport("after", "the step after it")]
with open(os.path.join(out, "log"), "w", buffering=1) as log:
    ctx = runner.Context(type("Args", (), {"budget_s": 60})(), {"binaries": []}, log)
    reporter = runner.Reporter(out, {}, time.monotonic())
    results = runner.run_steps(steps, [], ctx, {"available": False}, on_result=lambda done: reporter.write(done, steps))
    reporter.write(results, steps, final=True)
print(json.dumps(results))
'''


def test_a_step_whose_process_dies_is_reported_and_the_later_steps_still_run(tmp_path):
    # The step's process dies by a signal mid-run (as a CUDA crash or the OOM killer would end it).
    proc = run([sys.executable, "-c", ISOLATION_SCRIPT, REPO_ROOT / "scripts" / "device_check", tmp_path])
    assert proc.returncode == 0, "the runner itself died: %s %s" % (proc.returncode, proc.stderr)
    dies, after = json.loads(proc.stdout.strip().splitlines()[-1])
    assert dies["status"] == "crashed" and "killed by SIGSEGV" in dies["summary"], dies
    # The later step ran, and while it ran the report on disk already named the dead step.
    assert after == {**after, "status": "pass", "summary": "dies crashed, after pending"}
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [("dies", "crashed"), ("after", "pass")]
    assert report["complete"] and report["result"] == "fail (dies)"
    assert "dies: halfway through" in (tmp_path / "log").read_text()  # written as it went
    assert "| dies: dies by SIGSEGV halfway | crashed |" in (tmp_path / "report.md").read_text()


FAKE_GTEST = r'''#!/bin/sh
# A gtest binary whose second test crashes the process, unless a filter leaves it out.
for a in "$@"; do
  case "$a" in
    --gtest_output=xml:*) xml="${a#--gtest_output=xml:}" ;;
    --gtest_filter=*) filter="${a#--gtest_filter=}" ;;
  esac
done
echo "${HSX_TEST_SHAPES:-normal} ${filter:-all}" >> %(calls)s
case "$filter" in
  *Crash.Test*|X.Y)
    echo "[ RUN      ] B.Last"; echo "[       OK ] B.Last (0 ms)"
    printf '<?xml version="1.0"?><testsuites><testsuite name="B"><testcase name="Last" classname="B" status="run" result="completed"/></testsuite></testsuites>' > "$xml"
    exit 0 ;;
esac
echo "[ RUN      ] A.First"; echo "[       OK ] A.First (1 ms)"
echo "[ RUN      ] Crash.Test"; echo "about to crash"
kill -SEGV $$
'''


def fake_unit_tests(bundle_copy, tmp_path):
    calls = tmp_path / "calls"
    binary = bundle_copy / "bin" / "hsx_unit_tests"
    binary.write_text(FAKE_GTEST % {"calls": calls})
    binary.chmod(0o755)
    return calls


def test_a_test_that_crashes_its_binary_is_named_and_the_tests_after_it_run(bundle_copy, tmp_path):
    calls = fake_unit_tests(bundle_copy, tmp_path)
    out = tmp_path / "out"
    proc, report = run_bundle(bundle_copy, out, "--steps", "cpu_unit,cpu_pipeline")
    assert proc.returncode == 1
    unit = step(report, "cpu_unit")
    assert unit["status"] == "fail"
    assert unit["counts"]["tests"] == 3 and unit["counts"]["passed"] == 2
    crashed = unit["tests"]["crashed"]
    assert [(c["name"], c["how"]) for c in crashed] == [("Crash.Test", "killed by SIGSEGV")]
    assert "about to crash" in crashed[0]["message"]
    assert "1 crashed (Crash.Test: killed by SIGSEGV)" in unit["summary"]
    # Run again without the test that finished and the one that crashed.
    assert calls.read_text().splitlines() == ["normal all", "normal *-A.First:Crash.Test"]
    assert step(report, "cpu_pipeline")["status"] == "pass"
    assert "### Crash.Test crashed (killed by SIGSEGV)" in (out / "report.md").read_text()


def test_from_report_reruns_only_the_failed_steps_and_tests_with_more_detail(bundle_copy, tmp_path):
    calls = fake_unit_tests(bundle_copy, tmp_path)
    previous = tmp_path / "first.json"
    previous.write_text(json.dumps({"date": "2026-12-02 10:00:00 UTC", "steps": [
        {"name": "bundle", "status": "pass"},
        {"name": "cpu_unit", "status": "fail", "tests": {"failed": [{"name": "X.Y", "message": "..."}], "crashed": []}},
        {"name": "cpu_pipeline", "status": "pass"}]}))
    out = tmp_path / "out"
    proc, report = run_bundle(bundle_copy, out, "--from-report", previous)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls.read_text().splitlines() == ["small X.Y"]  # only the failed test, on small shapes
    assert report["from_report"]["rerun"] == ["cpu_unit"]
    assert step(report, "cpu_unit")["status"] == "pass" and "detail rerun" in step(report, "cpu_unit")["title"]
    assert step(report, "cpu_pipeline")["status"] == "not run"
    assert "did not fail in the report of 2026-12-02 10:00:00 UTC" in step(report, "cpu_pipeline")["summary"]
    assert (out / "report.md").read_text().startswith(
        "# hsx device check (detail rerun of 2026-12-02 10:00:00 UTC's failed steps: cpu_unit)")


def test_the_detail_plan_puts_failed_cuda_tests_under_memcheck_on_small_shapes():
    previous = {"date": "d", "steps": [
        {"name": "oracle", "status": "fail",
         "tests": {"failed": [{"name": "CudaModelTest.MatchesTheCpuBackend", "message": ""}], "crashed": []}},
        {"name": "sanitize_racecheck", "status": "fail", "tests": {"failed": [], "crashed": []},
         "findings": [{"test": "Cuda/BackendConformance.Attention/cuda_bf16"}]},
        {"name": "gpu_forward", "status": "crashed"},
        {"name": "stream_cost", "status": "pass"}]}
    args = type("Args", (), {"from_report": "first.json", "previous_report": previous, "steps": []})()
    steps, selected, origin = runner.plan_steps(args)
    assert selected == ["oracle", "sanitize_racecheck", "gpu_forward"] and origin["rerun"] == sorted(selected)
    by_name = {s.name: s for s in steps}
    oracle = by_name["oracle"]
    assert isinstance(oracle, runner.SanitizerSuite) and (oracle.tool, oracle.detail) == ("memcheck", True)
    assert oracle.gtest_filter == "CudaModelTest.MatchesTheCpuBackend"
    assert oracle.env == {"HSX_TEST_SHAPES": "small"} and oracle.needs_gpu
    ctx = type("Ctx", (), {"sanitizer": lambda self: "/x/compute-sanitizer", "binary": lambda self, n: "/b/" + n})()
    argv = oracle.argv(ctx, "r.xml", oracle.gtest_filter)
    assert argv[:3] == ["/x/compute-sanitizer", "--tool", "memcheck"] and "--show-backtrace" in argv
    assert argv[-2:] == ["--gtest_output=xml:r.xml", "--gtest_filter=CudaModelTest.MatchesTheCpuBackend"]
    race = by_name["sanitize_racecheck"]
    assert (race.tool, race.detail, race.gtest_filter) == ("racecheck", True, "Cuda/BackendConformance.Attention/cuda_bf16")
    assert (by_name["gpu_forward"].tokens, by_name["gpu_forward"].layers) == ("1024", 1)
    assert by_name["stream_cost"].samples == 64  # passed: left as it is (and not selected)
