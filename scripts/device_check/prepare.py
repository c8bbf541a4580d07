#!/usr/bin/env python3
"""Makes the device check's bundle: the binaries its steps need (runner.STEPS), stripped, plus
every shared library they load that a bare GPU machine lacks, and the runner.

Guarantees: the bundle is replaced whole or not at all (built beside it, then renamed); it is
at most --max-mib; each binary finds its libraries through RPATH $ORIGIN/../lib, so it runs
from any folder; a library that cannot be resolved here is an error, never a silent gap.
Libraries not carried (runner.carried): glibc's, the NVIDIA driver's, and the CUDA libraries
the GPU machine has (cuBLAS, cuBLASLt, cuDNN, NCCL), which the runner finds there by path.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import runner  # noqa: E402  (the steps and the library rules are the runner's)


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


def assemble(staging, build, built, missing, cache):
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
    shutil.copy2(os.path.join(HERE, "run.sh"), os.path.join(staging, "run.sh"))
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
    parser.add_argument("--max-mib", type=float, default=60, help="size limit of the bundle (default 60)")
    args = parser.parse_args(argv)
    if shutil.which("patchelf") is None:
        parser.error("patchelf not found: install it (scripts/setup.sh does, or apt-get install patchelf)")
    build = os.path.join(ROOT, args.build_dir)
    bundle = os.path.join(ROOT, args.bundle)
    staging = bundle + ".tmp"
    start = time.monotonic()
    try:
        built, missing, cache = configure_and_build(build, runner.required_binaries(), os.cpu_count() or 2)
        shutil.rmtree(staging, ignore_errors=True)
        manifest = assemble(staging, build, built, missing, cache)
        size = folder_bytes(staging)
        if size > args.max_mib * 2**20:
            raise PrepareError("the bundle is %.1f MiB, over --max-mib %g" % (size / 2**20, args.max_mib))
    except PrepareError as error:
        shutil.rmtree(staging, ignore_errors=True)
        print("device-check --prepare: %s" % error, file=sys.stderr)
        return 1
    shutil.rmtree(bundle, ignore_errors=True)
    os.rename(staging, bundle)
    print("prepare: %s: %.1f MiB (bin %.1f, lib %.1f), %d binaries, %d libraries, needs glibc >= %s; %.0f s"
          % (args.bundle, size / 2**20, folder_bytes(os.path.join(bundle, "bin")) / 2**20,
             folder_bytes(os.path.join(bundle, "lib")) / 2**20, len(manifest["binaries"]),
             len(manifest["libraries"]), manifest["glibc_required"], time.monotonic() - start))
    for name, why in sorted(missing.items()):
        print("prepare: %s %s" % (name, why))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
