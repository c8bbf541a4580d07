#!/usr/bin/env python3
"""Makes the device check's bundle: the binaries its steps need (runner.STEPS), stripped, plus
every shared library they load that a bare GPU machine lacks, and the runner.

Guarantees: the bundle is replaced whole or not at all (built beside it, then renamed); it is
at most --max-mib; each binary finds its libraries through RPATH $ORIGIN/../lib, so it runs
from any folder; a library that cannot be resolved here is an error, never a silent gap.
Libraries not carried (runner.carried): glibc's, the NVIDIA driver's, and the CUDA libraries
the GPU machine has (cuBLAS, cuBLASLt, cuDNN, NCCL), which the runner finds there by path.
compute-sanitizer (PyPI nvidia-cuda-sanitizer-api in the test venv) is carried as one xz archive.
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import runner  # noqa: E402  (the steps and the library rules are the runner's)
import sanitizer  # noqa: E402

# The runner's own modules, copied beside it (run.py) into the bundle.
RUNNER_MODULES = ("gtest_output.py", "isolated.py", "sanitizer.py")


class PrepareError(Exception):
    pass


def output_of(argv, **kwargs):
    result = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise PrepareError("%s failed (exit %d): %s" % (" ".join(argv), result.returncode,
                                                         result.stderr.strip()[-500:]))
    return result.stdout


def cmake_cache(build):
    values = {}
    path = os.path.join(build, "CMakeCache.txt")
    with open(path) as f:
        for line in f:
            match = re.match(r"^([A-Za-z_][\w-]*):\w+=(.*)$", line.rstrip("\n"))
            if match:
                values[match.group(1)] = match.group(2)
    return values


def configure_and_build(build, names, jobs):
    """Builds the targets among names that the build defines; returns (built, missing: reason)."""
    if not os.path.exists(os.path.join(build, "build.ninja")):
        print("prepare: configuring %s (RelWithDebInfo)" % build, flush=True)
        output_of(["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=RelWithDebInfo"])
    cache = cmake_cache(build)
    if cache.get("CMAKE_BUILD_TYPE") not in ("Release", "RelWithDebInfo") or cache.get("HSX_SANITIZE"):
        raise PrepareError("%s is a %s build%s; the device check needs Release or RelWithDebInfo without "
                           "sanitizers (HSX_BUILD_DIR=... or --build-dir)" % (
                               build, cache.get("CMAKE_BUILD_TYPE") or "untyped",
                               " with HSX_SANITIZE=" + cache["HSX_SANITIZE"] if cache.get("HSX_SANITIZE") else ""))
    targets = {line.split(":")[0] for line in output_of(["ninja", "-C", build, "-t", "targets", "all"]).splitlines()}
    has_cuda = "hsx_kernels_cuda" in targets
    built = [n for n in names if n in targets]
    missing = {}
    for name in names:
        if name in built:
            continue
        if has_cuda:
            raise PrepareError("%s: no target %s in %s" % (os.path.join(HERE, "runner.py"), name, build))
        missing[name] = "not built: %s was configured without CUDA (no nvcc, or HSX_ENABLE_CUDA=OFF)" % (
            os.path.relpath(build, ROOT))
    print("prepare: building %s in %s" % (" ".join(built), build), flush=True)
    result = subprocess.run(["cmake", "--build", build, "-j", str(jobs), "--target"] + built,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise PrepareError("building in %s failed:\n%s" % (build, result.stdout[-4000:]))
    return built, missing, cache


def shared_libraries(binaries):
    """soname -> path of every library the binaries load (ldd: the whole closure), and the
    sonames not carried but needed from the GPU machine's CUDA."""
    carry, from_gpu_machine = {}, set()
    for binary in binaries:
        for soname, path in runner.parse_ldd(output_of(["ldd", binary])):
            if runner.GPU_MACHINE_CUDA.match(soname):
                from_gpu_machine.add(soname)
            elif not runner.carried(soname):
                continue
            elif path is None:
                raise PrepareError("%s: %s not found here (ldd), so it cannot be carried" % (binary, soname))
            else:
                carry[soname] = path
    return carry, sorted(from_gpu_machine)


def newest_symbol_version(files, prefix):
    """The highest PREFIX_x.y symbol version the files import, e.g. the glibc they need."""
    versions = set()
    for path in files:
        versions.update(re.findall(prefix + r"_([\d.]+)", output_of(["objdump", "-T", path])))
    return max(versions, key=runner.version_tuple) if versions else ""


def cuda_archs(files):
    """The SASS architectures embedded in the binaries' CUDA fat binaries."""
    archs = set()
    for path in files:
        with open(path, "rb") as f:
            archs.update(m.decode() for m in re.findall(rb"-arch (sm_\w+)", f.read()))
    return sorted(archs)


def nvcc_version(cache):
    nvcc = cache.get("CMAKE_CUDA_COMPILER", "")
    if not nvcc or nvcc.endswith("NOTFOUND"):
        return ""
    match = re.search(r"release ([\d.]+), (V[\d.]+)", output_of([nvcc, "--version"]))
    return "%s (%s)" % match.groups() if match else ""


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def find_sanitizer(venv):
    """The files of the pinned nvidia-cuda-sanitizer-api package in the test venv that the
    sanitizer runs from (its bin/ and lib/ under nvidia/cu13), as listed by the package's own
    RECORD (other nvidia-* packages share those folders), and its version:
    ([(path, name in the archive)], version). Raises PrepareError naming the fix."""
    records = sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages",
                                            "nvidia_cuda_sanitizer_api-*.dist-info", "RECORD")))
    if not records:
        raise PrepareError("compute-sanitizer not found in %s (the PyPI package nvidia-cuda-sanitizer-api, pinned "
                           "in tests/python/requirements.txt): run scripts/setup.sh --python, or set HSX_VENV" % venv)
    site = os.path.dirname(os.path.dirname(records[-1]))
    version = re.search(r"nvidia_cuda_sanitizer_api-([\w.]+)\.dist-info", records[-1]).group(1)
    members = []
    with open(records[-1]) as f:
        for line in f:
            path = line.split(",")[0]
            match = re.match(r"^nvidia/(cu\d+)/(bin|lib)/([^/]+)$", path)
            if match:
                members.append((os.path.join(site, path), "%s/%s/%s" % match.groups()))
    if not any(name.endswith("/bin/compute-sanitizer") for _, name in members):
        raise PrepareError("%s lists no bin/compute-sanitizer" % records[-1])
    return sorted(members, key=lambda m: m[1]), version


def pack_sanitizer(staging, found):
    """compute-sanitizer's files as one xz archive in the bundle, under cu13/bin and cu13/lib as
    the wheel has them (the runner unpacks it where a step needs it; sanitizer.py)."""
    members, version = found
    archive = os.path.join(staging, sanitizer.ARCHIVE)
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for path, arcname in members:
            tar.add(path, arcname=arcname)
    return {"version": version, "archive": sanitizer.ARCHIVE,
            "unpacked_bytes": sum(os.path.getsize(p) for p, _ in members), "bytes": os.path.getsize(archive)}


def assemble(staging, build, built, missing, cache, sanitizer_files):
    bin_dir, lib_dir = os.path.join(staging, "bin"), os.path.join(staging, "lib")
    os.makedirs(bin_dir)
    os.makedirs(lib_dir)
    sources = [os.path.join(build, "bin", name) for name in built]
    for name, source in zip(built, sources):
        output_of(["strip", "--strip-all", "-o", os.path.join(bin_dir, name), source])
        # DT_RPATH (not RUNPATH): it also serves the libraries' own dependencies.
        output_of(["patchelf", "--force-rpath", "--set-rpath", "$ORIGIN/../lib", os.path.join(bin_dir, name)])
    libraries, from_gpu_machine = shared_libraries(sources)
    for soname, path in sorted(libraries.items()):
        output_of(["strip", "--strip-unneeded", "-o", os.path.join(lib_dir, soname), os.path.realpath(path)])
    shutil.copy2(os.path.join(HERE, "runner.py"), os.path.join(staging, "run.py"))
    for module in RUNNER_MODULES:
        shutil.copy2(os.path.join(HERE, module), os.path.join(staging, module))
    shutil.copy2(os.path.join(HERE, "run.sh"), os.path.join(staging, "run.sh"))
    sanitizer_facts = pack_sanitizer(staging, sanitizer_files)
    files = [os.path.join(bin_dir, n) for n in built] + [os.path.join(lib_dir, s) for s in libraries]
    commit = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    manifest = {
        "commit": commit or "unknown",
        "built": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "build_dir": os.path.relpath(build, ROOT),
        "build_type": cache.get("CMAKE_BUILD_TYPE"),
        "nvcc": nvcc_version(cache),
        "cuda_archs": cuda_archs(files[:len(built)]),
        "glibc_required": newest_symbol_version(files, "GLIBC"),
        "binaries": built,
        "missing_binaries": missing,
        "libraries": sorted(libraries),
        "gpu_machine_libraries": from_gpu_machine,
        "sanitizer": sanitizer_facts,
    }
    with open(os.path.join(staging, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return manifest


def main(argv):
    parser = argparse.ArgumentParser(prog="device-check.sh --prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", default=os.environ.get("HSX_BUILD_DIR", "build"),
                        help="build tree to build in and take binaries from (default $HSX_BUILD_DIR or build)")
    parser.add_argument("--bundle", default=".device-bundle",
                        help="where to put the bundle, relative to the repository root (default .device-bundle)")
    parser.add_argument("--max-mib", type=float, default=64, help="size limit of the bundle (default 64: what the "
                        "device tool carries)")
    parser.add_argument("--venv", default=os.environ.get("HSX_VENV", os.path.expanduser("~/.cache/hsx/venv")),
                        help="the test venv holding nvidia-cuda-sanitizer-api (default $HSX_VENV or ~/.cache/hsx/venv)")
    args = parser.parse_args(argv)
    if shutil.which("patchelf") is None:
        parser.error("patchelf not found: install it (scripts/setup.sh does, or apt-get install patchelf)")
    build = os.path.join(ROOT, args.build_dir)
    bundle = os.path.join(ROOT, args.bundle)
    staging = bundle + ".tmp"
    start = time.monotonic()
    try:
        sanitizer_files = find_sanitizer(args.venv)
        built, missing, cache = configure_and_build(build, runner.required_binaries(), os.cpu_count() or 2)
        shutil.rmtree(staging, ignore_errors=True)
        manifest = assemble(staging, build, built, missing, cache, sanitizer_files)
        size = folder_bytes(staging)
        if size > args.max_mib * 2**20:
            raise PrepareError("the bundle is %.1f MiB, over --max-mib %g" % (size / 2**20, args.max_mib))
    except PrepareError as error:
        shutil.rmtree(staging, ignore_errors=True)
        print("device-check --prepare: %s" % error, file=sys.stderr)
        return 1
    shutil.rmtree(bundle, ignore_errors=True)
    os.rename(staging, bundle)
    print("prepare: %s: %.1f MiB (bin %.1f, lib %.1f, compute-sanitizer %s %.1f packed from %.1f), %d binaries, "
          "%d libraries, needs glibc >= %s; %.0f s"
          % (args.bundle, size / 2**20, folder_bytes(os.path.join(bundle, "bin")) / 2**20,
             folder_bytes(os.path.join(bundle, "lib")) / 2**20, manifest["sanitizer"]["version"],
             manifest["sanitizer"]["bytes"] / 2**20, manifest["sanitizer"]["unpacked_bytes"] / 2**20,
             len(manifest["binaries"]), len(manifest["libraries"]), manifest["glibc_required"],
             time.monotonic() - start))
    for name, why in sorted(missing.items()):
        print("prepare: %s %s" % (name, why))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
