"""deploy/Dockerfile and the container image it builds, checked without Docker:
- deploy/Dockerfile parsed: base images as build arguments defaulting to a CUDA devel build
  stage and the matching CUDA runtime stage, the build as scripts/setup.sh's packages +
  cmake/ninja without tests, runtime packages derived from the binaries, the five binaries
  copied, a numeric non-root USER, no HEALTHCHECK, ENTRYPOINT hsx-server; the ignore file keeps
  build trees out and the sources in;
- when the CPU image of scripts/image.sh is here (buildah storage; HSX_IMAGE_TESTS=required
  makes its absence a failure instead of a skip): every flag of the Dockerfile and the manifests
  is accepted by the binaries inside the image, the cpu-demo overlay deploys that image, its
  user/entrypoint/command are the Dockerfile's, the derived runtime libraries are installed and
  no compiler or -dev package is; the fleet overlay's stage-model.sh runs in it.
"""

import fnmatch
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy_helpers import (BUILDAH, DOCKERIGNORE, HSX_BINARIES, K8S, REPO_ROOT, ImageBinaries, apt_packages,
                            check_every_flag_is_accepted, dockerfile_args, dockerfile_instructions,
                            entrypoint_and_cmd, pod_templates, setup_sh_packages, stages, substitute)

# Packages of scripts/setup.sh the image build does not need: the test, fuzz and Python tools
# (HSX_BUILD_TESTS=OFF), kubectl for these tests, and git. A package added to setup.sh must be
# added to the Dockerfile's build stage or to this list.
# Test and tooling packages of scripts/setup.sh that the image's build does not use (patchelf sets
# the device-check bundle's RPATHs).
NOT_FOR_THE_IMAGE = {"git", "clang", "libclang-rt-14-dev", "python3-venv", "libgtest-dev", "libgmock-dev",
                     "kubernetes-client", "patchelf",
                     "pybind11-dev", "python3-dev"}  # the Python client's native module: not in the server image


def test_dockerfile_stages_base_images_and_build():
    ins = dockerfile_instructions()
    st = stages(ins)
    assert len(st) >= 2, "a multi-stage Dockerfile: a build stage and a runtime stage"
    args = dockerfile_args(ins)
    build, runtime = st[0], st[-1]
    build_image, runtime_image = substitute(build["from"], args), substitute(runtime["from"], args)
    image_re = re.compile(r"^nvidia/cuda:(\d+\.\d+\.\d+)-(devel|runtime|base)-(ubuntu\d+\.\d+)$")
    mb, mr = image_re.match(build_image), image_re.match(runtime_image)
    assert mb and mb.group(2) == "devel", f"build stage on an NVIDIA CUDA devel image, not {build_image}"
    assert mr and mr.group(2) == "runtime", f"runtime stage on an NVIDIA CUDA runtime image, not {runtime_image}"
    assert (mb.group(1), mb.group(3)) == (mr.group(1), mr.group(3)), (
        f"build and runtime stages must use the same CUDA version and OS: {build_image} vs {runtime_image}")
    assert int(mb.group(1).split(".")[0]) >= 13, "CUDA 13 (what hsx is built and tested with)"
    assert build["name"], "the build stage is named (COPY --from=<name>)"

    runs = " && ".join(r for w, r in build["ins"] if w == "RUN")
    assert re.search(r"\bcmake\b[^&;]*-G\s*Ninja", runs), "configure with cmake -G Ninja"
    assert "-DHSX_BUILD_TESTS=OFF" in runs, "build without the unit tests"
    assert "-DHSX_ENABLE_CUDA=${HSX_ENABLE_CUDA}" in runs, "the CUDA kernels follow the HSX_ENABLE_CUDA build argument"
    cuda_arg = [r for w, r in build["ins"] if w == "ARG" and r.startswith("HSX_ENABLE_CUDA")]
    assert cuda_arg == ["HSX_ENABLE_CUDA=ON"], f"production builds the CUDA kernels by default: {cuda_arg}"
    for stage, arg in ((build, "BUILD_IMAGE"), (runtime, "RUNTIME_IMAGE")):
        assert stage["from"] == "${" + arg + "}", f"FROM {stage['from']}: the base image is the {arg} build argument"
    assert re.search(r"\bninja\b", runs), "build with ninja"
    installed = set(apt_packages(runs))
    needed = [p for p in setup_sh_packages() if p not in NOT_FOR_THE_IMAGE]
    missing = [p for p in needed if p not in installed]
    assert not missing, f"the build stage lacks packages scripts/setup.sh installs: {missing}"
    assert any(w == "COPY" for w, _ in build["ins"]), "the build stage copies the sources"


def test_dockerfile_runtime_stage():
    ins = dockerfile_instructions()
    st = stages(ins)
    build, runtime = st[0], st[-1]
    assert not any(word == "HEALTHCHECK" for _, word, _ in ins), "no HEALTHCHECK: Kubernetes probes check health"

    packages = [p for w, r in runtime["ins"] if w == "RUN" for p in apt_packages(r)]
    dev = [p for p in packages if p.endswith("-dev") or p in ("build-essential", "cmake", "ninja-build",
                                                                "protobuf-compiler", "protobuf-compiler-grpc")]
    assert not dev, f"the runtime stage installs build packages: {dev}"
    # The runtime packages are the ones the build stage derived from its binaries (ldd + dpkg,
    # deploy/runtime-packages.sh), not a hand-written list: test_image_* check the result.
    build_runs = " && ".join(r for w, r in build["ins"] if w == "RUN")
    assert re.search(r"deploy/runtime-packages\.sh [^&;]*> */out/runtime-packages\.txt", build_runs), \
        "the build stage derives the runtime packages with deploy/runtime-packages.sh"
    copies = [r for w, r in runtime["ins"] if w == "COPY" and f"--from={build['name']}" in r]
    assert any("/out/runtime-packages.txt" in r for r in copies), "the runtime stage copies the derived package list"
    assert any("$(cat /usr/local/share/hsx/runtime-packages.txt)" in r for w, r in runtime["ins"] if w == "RUN"), \
        "the runtime stage installs the derived package list"

    copied = set()
    for word, rest in runtime["ins"]:
        if word == "COPY" and f"--from={build['name']}" in rest:
            sources = [w for w in rest.split() if not w.startswith("--")][:-1]
            copied |= {Path(s).name for s in sources}
    assert set(HSX_BINARIES) <= copied, f"binaries not copied from the build stage: {set(HSX_BINARIES) - copied}"

    users = [r for w, r in runtime["ins"] if w == "USER"]
    assert users, "the runtime stage sets a USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), f"USER {users[-1]}: numeric, so that runAsNonRoot can verify it"
    assert int(uid) == 10001, f"USER {users[-1]}: uid 10001 expected"
    gid = users[-1].partition(":")[2]
    assert not gid or (gid.isdigit() and int(gid) != 0), f"USER {users[-1]}: a non-root group"

    entry, cmd = entrypoint_and_cmd(ins)
    assert entry and Path(entry[0]).name == "hsx-server", f"ENTRYPOINT runs hsx-server: {entry}"


def test_dockerignore_keeps_build_trees_out_and_sources_in():
    assert DOCKERIGNORE.is_file(), f"{DOCKERIGNORE.relative_to(REPO_ROOT)} missing"
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()
                if ln.strip() and not ln.strip().startswith("#")]

    def ignored(path):
        result = False
        for p in patterns:
            negate = p.startswith("!")
            p = p.lstrip("!").strip("/")
            if fnmatch.fnmatchcase(path, p) or path.startswith(p + "/"):
                result = not negate
        return result

    for path in (".git", "build", "build-server", "build-asan", "build-client/bin/hsx-dump"):
        assert ignored(path), f"{path} would be sent to the Docker build context"
    top = (REPO_ROOT / "CMakeLists.txt").read_text()
    needed = ["CMakeLists.txt", "proto", "kernels", "server", "client", "bench", "cmake"]
    needed += re.findall(r"add_subdirectory\((\w+)\)", top)
    for path in needed:
        if (REPO_ROOT / path).exists():
            assert not ignored(path), f"{path} is needed by the build but ignored"


# ----------------------------------------------------------------------------------------------
# The CPU image built by scripts/image.sh (buildah, Debian bookworm base), when it is here


CPU_DEMO_KUSTOMIZATION = K8S / "overlays" / "cpu-demo" / "kustomization.yaml"


def cpu_demo_image():
    """The image the cpu-demo overlay deploys ("name:tag" from its `images:`); scripts/image.sh
    reads the same entry and builds localhost/<name:tag>."""
    kustomization = yaml.safe_load(CPU_DEMO_KUSTOMIZATION.read_text())
    entries = [i for i in kustomization.get("images", []) if i.get("name") == "hsx"]
    assert len(entries) == 1, f"{CPU_DEMO_KUSTOMIZATION}: one images: entry for hsx expected: {entries}"
    return f"{entries[0]['newName']}:{entries[0]['newTag']}"


@pytest.fixture(scope="module")
def image_bins():
    """The binaries of localhost/<cpu-demo image>. Skips, saying why, where buildah or the image
    is missing; fails instead with HSX_IMAGE_TESTS=required (scripts/test.sh, after building it)."""
    image = "localhost/" + cpu_demo_image()
    required = os.environ.get("HSX_IMAGE_TESTS") == "required"

    def unavailable(reason):
        if required:
            pytest.fail(f"{reason} (HSX_IMAGE_TESTS=required)", pytrace=False)
        pytest.skip(reason)

    if not shutil.which("buildah"):
        unavailable("buildah is not installed; scripts/image.sh installs it and builds the CPU image")
    proc = subprocess.run(BUILDAH + ["inspect", "--type", "image", image], capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0:
        unavailable(f"no image {image} in buildah's storage; build it with scripts/image.sh "
                    f"({proc.stderr.strip()[:200]})")
    bins = ImageBinaries(image)
    yield bins
    bins.close()


def test_image_accepts_every_flag(image_bins, rendered):
    """The flag-drift check of test_every_flag_is_accepted_by_its_binary, against the binaries
    inside the image rather than the local build."""
    check_every_flag_is_accepted(image_bins, rendered, where_prefix="cpu-demo:")


def test_image_is_what_the_cpu_demo_overlay_deploys(image_bins, rendered):
    images = {c["image"] for _, spec, _ in pod_templates(rendered["cpu-demo"])
              for c in spec.get("initContainers", []) + spec["containers"]}
    assert images == {cpu_demo_image()}, f"cpu-demo runs {images}, scripts/image.sh builds {cpu_demo_image()}"
    config = image_bins.config()
    assert config.get("User") == "10001:10001", config
    assert (config.get("Entrypoint"), config.get("Cmd")) == entrypoint_and_cmd(), config
    proc = image_bins.run("id", "-u")
    assert proc.returncode == 0 and proc.stdout.strip() == "10001", proc.stdout + proc.stderr


# Build tools that must not be in the runtime image (Debian package names).
BUILD_PACKAGES = {"gcc", "g++", "cpp", "clang", "cmake", "ninja-build", "make", "binutils", "build-essential",
                  "protobuf-compiler", "protobuf-compiler-grpc", "nvidia-cuda-toolkit"}


def test_image_has_its_runtime_libraries_and_no_compiler(image_bins):
    proc = image_bins.run("cat", "/usr/local/share/hsx/runtime-packages.txt")
    assert proc.returncode == 0, proc.stderr
    derived = proc.stdout.split()
    for lib in ("libgrpc++", "libprotobuf", "libabsl", "libprometheus-cpp-core", "libprometheus-cpp-pull",
                "libxxhash"):
        assert any(p.startswith(lib) for p in derived), f"{lib}* is not among the derived runtime packages {derived}"
    proc = image_bins.run("dpkg-query", "-W", "-f", "${Package} ${Status}\n")
    assert proc.returncode == 0, proc.stderr
    installed = {line.split()[0] for line in proc.stdout.splitlines() if line.endswith(" installed")}
    assert set(derived) <= installed, f"derived but not installed: {set(derived) - installed}"
    build_tools = sorted(p for p in installed if p.endswith("-dev") or p in BUILD_PACKAGES
                         or re.fullmatch(r"(gcc|g\+\+|cpp|clang)-\d+", p))
    assert not build_tools, f"the runtime image holds build packages: {build_tools}"
    proc = image_bins.run("sh", "-c", "for c in gcc cc c++ g++ clang nvcc ld; do command -v $c; done; true")
    assert proc.stdout.strip() == "", f"compilers in the runtime image: {proc.stdout.split()}"
    for b in HSX_BINARIES:
        proc = image_bins.run("ldd", f"/usr/local/bin/{b}")
        assert proc.returncode == 0 and "not found" not in proc.stdout, f"{b} in the image:\n{proc.stdout}"


def test_image_runs_the_fleet_staging_script(image_bins):
    """overlays/fleet/stage-model.sh, run inside the image as its user (as the fleet's init
    container runs it): every tool it calls (find, xargs, cp --parents, cut, du, hsx-inspect) is in
    the runtime image, and it stages and verifies a generated checkpoint there."""
    script = (K8S / "overlays" / "fleet" / "stage-model.sh").read_text()
    setup = ("rm -rf /tmp/stage && hsx-make-model --preset tiny --out /tmp/stage/src >/dev/null && "
             "hsx-inspect --model /tmp/stage/src --full-digest > /tmp/stage/src/hsx-full-digest.txt")
    proc = image_bins.run("sh", "-c", setup)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = image_bins.run("sh", "-c", script, "stage-model.sh", "/tmp/stage/src", "/tmp/stage/local/tiny")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "/tmp/stage/local/tiny holds checkpoint" in proc.stdout, proc.stdout
    proc = image_bins.run("cmp", "/tmp/stage/src/model.safetensors", "/tmp/stage/local/tiny/model.safetensors")
    assert proc.returncode == 0, proc.stdout + proc.stderr
