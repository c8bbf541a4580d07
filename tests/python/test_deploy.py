"""deploy/: the container image and the Kubernetes manifests, checked against the real binaries.

Docker and a cluster are not available to the tests, so they check what can be checked without
them:
- deploy/Dockerfile parsed: base images as build arguments defaulting to a CUDA devel build
  stage and the matching CUDA runtime stage, the build as scripts/setup.sh's packages +
  cmake/ninja without tests, runtime packages derived from the binaries, the five binaries
  copied, a numeric non-root USER, no HEALTHCHECK, ENTRYPOINT hsx-server; the ignore file keeps
  build trees out and the sources in;
- when the CPU image of scripts/image.sh is here (buildah storage; HSX_IMAGE_TESTS=required
  makes its absence a failure instead of a skip): every flag below is accepted by the binaries
  inside the image, the cpu-demo overlay deploys that image, its user/entrypoint/command are the
  Dockerfile's, the derived runtime libraries are installed and no compiler or -dev package is;
- every overlay (and the base) rendered with `kubectl kustomize` (kubectl from HSX_KUBECTL or
  PATH; Debian's kubernetes-client 1.20 and current kubectl both render these) and every
  document validated strictly against the Kubernetes 1.30 schemas (kubernetes-validate);
- every flag given to hsx-server / hsx-dump / hsx-make-model / hsx-verify / hsx-inspect in the
  Dockerfile, the manifests and docs/deploy.md is one the binary accepts (its --helpfull);
- ports, probes, Services, the NetworkPolicy and the Job agree with the server's own flags;
  terminationGracePeriodSeconds exceeds --drain-timeout; the 8-GPU start-up budget;
- the cpu-demo overlay's own commands, run here (volumes as temporary directories, the server
  on 127.0.0.1 with free ports, $(JOB_COMPLETION_INDEX) = each index): the init container makes
  the tiny model, the server becomes SERVING on its probe port, every shard of the dump job
  completes, and hsx-verify accepts the output.
"""

import fnmatch
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from hsx_server import HsxServer

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
K8S = DEPLOY / "k8s"
DEPLOY_DOC = REPO_ROOT / "docs" / "deploy.md"
OVERLAYS = ("cpu-demo", "gpu-8")
TREES = ("base",) + OVERLAYS
KUBERNETES_VERSION = "1.30"
HSX_BINARIES = ("hsx-server", "hsx-dump", "hsx-verify", "hsx-inspect", "hsx-make-model")
API_SERVICE = "hsx.v1.HiddenStates"
# hsx-server's and hsx-dump's defaults where a manifest leaves a flag out (checked against
# --helpfull in test_defaults_assumed_here_are_the_binaries).
SERVER_DEFAULT_MAX_CONCURRENT = 256
DUMP_DEFAULT_CONCURRENCY = 64


# ----------------------------------------------------------------------------------------------
# The binaries' flags


def _bin(bin_dir, name):
    path = Path(bin_dir) / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{name} not found in {bin_dir}: build it, or point HSX_BIN_DIR at a directory "
                    "holding all of " + ", ".join(HSX_BINARIES), pytrace=False)
    return path


_HELP_CACHE = {}


def help_text(bin_dir, name):
    """`name --helpfull` of the binaries in bin_dir: a directory, or an ImageBinaries (the
    binaries inside the built container image)."""
    if isinstance(bin_dir, ImageBinaries):
        return bin_dir.helpfull(name)
    proc = subprocess.run([str(_bin(bin_dir, name)), "--helpfull"], capture_output=True, text=True,
                          timeout=60, check=False)
    return proc.stdout + proc.stderr


def flags_of(bin_dir, name):
    """{flag name with underscores: default text} from `name --helpfull` (absl)."""
    key = (str(bin_dir), name)
    if key not in _HELP_CACHE:
        text = help_text(bin_dir, name)
        starts = list(re.finditer(r"^\s+--([A-Za-z0-9_]+) \(", text, re.M))
        flags = {}
        for i, m in enumerate(starts):
            end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
            d = re.search(r"default: (.*?);\s*$", text[m.end():end], re.M | re.S)
            flags[m.group(1)] = d.group(1).strip() if d else ""
        assert len(flags) > 4, f"could not read the flags of {name} from --helpfull:\n{text[:2000]}"
        _HELP_CACHE[key] = flags
    return _HELP_CACHE[key]


def norm(flag):
    return flag.replace("-", "_")


def parse_flags(bin_dir, binary, argv):
    """(flags {name: value}, unknown [names]) for argv (after the program name), absl rules:
    --name=value, --name value, -name, --bool, --nobool; positional arguments are skipped."""
    known = flags_of(bin_dir, binary)
    flags, unknown = {}, []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            break
        if not token.startswith("-") or token == "-":
            continue
        name, eq, value = token.lstrip("-").partition("=")
        name = norm(name)
        if name not in known and name.startswith("no") and known.get(name[2:]) in ("true", "false"):
            flags[name[2:]] = "false"
            continue
        if name not in known:
            unknown.append(token.split("=")[0])
            continue
        if not eq:
            if known[name] in ("true", "false"):
                value = "true"
            elif i < len(argv):
                value = argv[i]
                i += 1
        flags[name] = value
    return flags, unknown


# ----------------------------------------------------------------------------------------------
# The Dockerfile


def dockerfile_instructions(path=DOCKERFILE):
    """[(stage index, INSTRUCTION, arguments)], continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        if current.strip():
            lines.append(current.strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    out, stage = [], -1
    for line in lines:
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stage += 1
        out.append((stage, word, rest.strip()))
    return out


def dockerfile_args(instructions):
    """Global ARGs (before the first FROM) with their defaults."""
    args = {}
    for stage, word, rest in instructions:
        if stage == -1 and word == "ARG":
            name, _, default = rest.partition("=")
            # A default may use the ARGs before it (BUILD_IMAGE=nvidia/cuda:${CUDA_VERSION}-...).
            args[name.strip()] = substitute(default.strip(), args)
    return args


def substitute(text, variables):
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def exec_form(rest):
    """The list of an exec-form (JSON) ENTRYPOINT/CMD; fails on the shell form."""
    try:
        value = json.loads(rest)
    except json.JSONDecodeError:
        pytest.fail(f"not in exec (JSON) form: {rest}")
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def apt_packages(run_text):
    """Packages named by `apt-get install` commands in one RUN instruction."""
    packages = []
    for command in re.split(r"&&|;|\|\|", run_text):
        words = shlex.split(command)
        if "apt-get" in words and "install" in words:
            for w in words[words.index("install") + 1:]:
                if not w.startswith("-"):
                    packages.append(w)
    return packages


def stages(instructions):
    """[{'from': image, 'name': alias, 'ins': [(word, rest)]}]"""
    result = []
    for stage, word, rest in instructions:
        if word == "FROM":
            parts = rest.split()
            parts = [p for p in parts if not p.startswith("--platform")]
            alias = parts[2] if len(parts) >= 3 and parts[1].lower() == "as" else None
            result.append({"from": parts[0], "name": alias, "ins": []})
        elif stage >= 0:
            result[stage]["ins"].append((word, rest))
    return result


def entrypoint_and_cmd(instructions=None):
    st = stages(instructions or dockerfile_instructions())[-1]
    entry = [exec_form(r) for w, r in st["ins"] if w == "ENTRYPOINT"]
    cmd = [exec_form(r) for w, r in st["ins"] if w == "CMD"]
    return (entry[-1] if entry else []), (cmd[-1] if cmd else [])


def setup_sh_packages():
    text = (REPO_ROOT / "scripts" / "setup.sh").read_text()
    m = re.search(r"^packages=\((.*?)\)", text, re.M | re.S)
    assert m, "scripts/setup.sh: no packages=( ... ) list"
    return [w for line in m.group(1).splitlines() for w in line.split("#", 1)[0].split()]


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
# Rendering and schema validation


def _kubectl():
    exe = os.environ.get("HSX_KUBECTL") or shutil.which("kubectl")
    if not exe:
        pytest.fail("kubectl not found (set HSX_KUBECTL or install it: apt-get install -y kubernetes-client)",
                    pytrace=False)
    return exe


@pytest.fixture(scope="module")
def rendered():
    """{tree: [documents]} for base and every overlay, rendered by `kubectl kustomize`."""
    kubectl = _kubectl()
    result = {}
    for tree in TREES:
        path = K8S / "base" if tree == "base" else K8S / "overlays" / tree
        proc = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        assert docs, f"kubectl kustomize {path} rendered nothing"
        result[tree] = docs
    return result


def test_every_document_is_valid_kubernetes_1_30(rendered):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is missing: pip install -r tests/python/requirements.txt", pytrace=False)
    errors = []
    for tree, docs in rendered.items():
        for doc in docs:
            # Every document has to carry what a server checks first.
            assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), doc
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except Exception as e:  # ValidationError, SchemaNotFoundError, ...
                errors.append(f"{tree}: {doc['kind']}/{doc['metadata']['name']}: {type(e).__name__}: {e}"[:1500])
    assert not errors, "\n\n".join(errors)


def test_overlays_render_what_they_promise(rendered):
    for tree in OVERLAYS:
        kinds = sorted(d["kind"] for d in rendered[tree])
        for kind in ("StatefulSet", "Service", "Job", "NetworkPolicy", "PersistentVolumeClaim", "Namespace"):
            assert kind in kinds, f"{tree}: no {kind} rendered ({kinds})"
        ns = {d["metadata"].get("namespace") for d in rendered[tree] if d["kind"] != "Namespace"}
        namespaces = [d["metadata"]["name"] for d in rendered[tree] if d["kind"] == "Namespace"]
        assert len(ns) == 1 and ns == set(namespaces), f"{tree}: one namespace, created by the overlay: {ns}"


# ----------------------------------------------------------------------------------------------
# The containers of the rendered manifests, and the commands they run


def pod_templates(docs):
    """[(doc, pod spec, pod metadata)] of StatefulSets, Deployments, Jobs, Pods."""
    out = []
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "Job"):
            t = d["spec"]["template"]
            out.append((d, t["spec"], t.get("metadata", {})))
        elif d["kind"] == "Pod":
            out.append((d, d["spec"], d["metadata"]))
    return out


def container_argv(container):
    """What the container runs: command + args, or the image's ENTRYPOINT + (args or CMD)."""
    if container.get("command"):
        return list(container["command"]) + list(container.get("args", []))
    entry, cmd = entrypoint_and_cmd()
    return entry + list(container["args"] if "args" in container else cmd)


SHELLS = {"sh", "bash", "dash"}
SHELL_OPERATORS = {";", "&&", "||", "|", "&", "(", ")", "{", "}", ";;"}


def hsx_invocations(argv):
    """[(binary, args)] for the hsx binaries argv runs, directly or in an `sh -c` script."""
    if not argv:
        return []
    if Path(argv[0]).name in SHELLS and "-c" in argv[1:]:
        return script_invocations(argv[argv.index("-c") + 1])
    name = Path(argv[0]).name
    return [(name, list(argv[1:]))] if name in HSX_BINARIES else []


def script_invocations(script):
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|(){}")
    lexer.whitespace_split = True
    words = list(lexer)
    out, simple = [], []
    for w in words + [";"]:
        if w in SHELL_OPERATORS:
            while simple and (simple[0] in ("exec", "then", "do", "else", "!", "time")
                              or re.match(r"^\w+=", simple[0])):
                simple.pop(0)
            if simple and Path(simple[0]).name in HSX_BINARIES:
                out.append((Path(simple[0]).name, simple[1:]))
            simple = []
        else:
            simple.append(w)
    return out


DOCKER_OPTIONS_WITH_VALUES = {"-v", "--volume", "-p", "--publish", "-e", "--env", "-u", "--user", "-w", "--workdir",
                              "--name", "--network", "--gpus", "--mount", "--shm-size", "--ipc", "--platform",
                              "--entrypoint", "--env-file", "-l", "--label"}


def docker_run_invocation(words):
    """(binary, args) of `docker run [options] <hsx image> args...`: the image's ENTRYPOINT
    (hsx-server) or --entrypoint, with the arguments after the image; None otherwise."""
    if len(words) < 3 or words[0] != "docker" or words[1] != "run":
        return None
    entry, i = None, 2
    while i < len(words):
        w = words[i]
        if w.startswith("-"):
            name = w.split("=")[0]
            if name == "--entrypoint":
                entry = w.split("=", 1)[1] if "=" in w else words[i + 1]
            i += 2 if (name in DOCKER_OPTIONS_WITH_VALUES and "=" not in w) else 1
            continue
        if re.search(r"(^|/)hsx(:|@|$)", w):
            binary = Path(entry).name if entry else Path(entrypoint_and_cmd()[0][0]).name
            return (binary, words[i + 1:]) if binary in HSX_BINARIES else None
        return None
    return None


def doc_invocations():
    """[(binary, args, line)] of hsx commands in docs/deploy.md's code blocks (shell lines,
    `docker run` of the image, and `- --flag` args in yaml snippets, which are hsx-server's)."""
    if not DEPLOY_DOC.is_file():
        return []
    out = []
    in_code = False
    fence = ""
    logical = ""
    for raw in DEPLOY_DOC.read_text().splitlines():
        if raw.strip().startswith("```"):
            in_code = not in_code
            fence = raw.strip()[3:].strip() if in_code else ""
            logical = ""
            continue
        if not in_code:
            continue
        if fence == "yaml":
            # Container args in a manifest snippet: the server's (the snippets patch its args).
            m = re.match(r"^\s*- (--[\w-]+(?:=\S*)?)", raw)
            if m:
                out.append(("hsx-server", [m.group(1)], raw.strip()))
            continue
        line = raw.rstrip()
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        text = logical.split(" #", 1)[0] if not logical.lstrip().startswith("#") else ""
        logical = ""
        if "hsx" not in text:
            continue
        try:
            lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()")
            lexer.whitespace_split = True
            words = list(lexer)
        except ValueError:
            continue
        docker = docker_run_invocation(words)
        if docker:
            out.append((*docker, text.strip()))
            continue
        for i, w in enumerate(words):
            if Path(w).name in HSX_BINARIES and (i == 0 or words[i - 1] in SHELL_OPERATORS | {"--", "exec"}
                                                 or Path(words[i - 1]).name in ("sudo", "env", "timeout")):
                args = []
                for a in words[i + 1:]:
                    if a in SHELL_OPERATORS:
                        break
                    args.append(a)
                out.append((Path(w).name, args, text.strip()))
    return out


def all_invocations(rendered):
    """[(where, binary, args)] over the Dockerfile, the rendered manifests and docs/deploy.md."""
    out = []
    entry, cmd = entrypoint_and_cmd()
    for binary, args in hsx_invocations(entry + cmd):
        out.append(("deploy/Dockerfile ENTRYPOINT+CMD", binary, args))
    for tree, docs in rendered.items():
        for doc, spec, _ in pod_templates(docs):
            for c in spec.get("initContainers", []) + spec["containers"]:
                for binary, args in hsx_invocations(container_argv(c)):
                    out.append((f"{tree}: {doc['kind']}/{doc['metadata']['name']} container {c['name']}", binary, args))
    for binary, args, line in doc_invocations():
        out.append((f"docs/deploy.md: {line}", binary, args))
    return out


def check_every_flag_is_accepted(bin_dir, rendered, where_prefix=""):
    """Every hsx command of all_invocations is accepted by the binaries of bin_dir (a directory
    or an ImageBinaries); those of where_prefix ("" = anywhere) include the three main tools."""
    invocations = all_invocations(rendered)
    used = {b for where, b, _ in invocations if where.startswith(where_prefix)}
    for needed in ("hsx-server", "hsx-dump", "hsx-make-model"):
        assert needed in used, f"no {needed} command found in {where_prefix or 'the Dockerfile or the manifests'}"
    problems = []
    for where, binary, args in invocations:
        _, unknown = parse_flags(bin_dir, binary, args)
        if unknown:
            problems.append(f"{where}: {binary} ({bin_dir}) does not accept {', '.join(unknown)}")
    assert not problems, "\n".join(problems)


def test_every_flag_is_accepted_by_its_binary(bin_dir, rendered):
    check_every_flag_is_accepted(bin_dir, rendered)


def test_defaults_assumed_here_are_the_binaries(bin_dir):
    assert flags_of(bin_dir, "hsx-server")["max_concurrent_requests"] == str(SERVER_DEFAULT_MAX_CONCURRENT)
    assert flags_of(bin_dir, "hsx-dump")["concurrency"] == str(DUMP_DEFAULT_CONCURRENCY)


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


# buildah as scripts/image.sh runs it: as root (sudo -n when the tests are not root), so that it
# sees the same (rootful) storage.
BUILDAH = ["buildah"] if os.geteuid() == 0 else ["sudo", "-n", "buildah"]


class ImageBinaries:
    """The hsx binaries inside a built image, run in one working container of it with
    `buildah run --isolation chroot` (podman run does not work on these machines) as the image's
    user, uid/gid 10001."""

    def __init__(self, image):
        self.image = image
        proc = subprocess.run(BUILDAH + ["from", "--pull=never", image], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, f"buildah from {image}:\n{proc.stderr}"
        self.container = proc.stdout.strip().splitlines()[-1]

    def __str__(self):
        return f"image {self.image}"

    def run(self, *argv, timeout=120):
        return subprocess.run(BUILDAH + ["run", "--isolation", "chroot", "--user", "10001:10001", self.container,
                               "--", *argv], capture_output=True, text=True, timeout=timeout)

    def helpfull(self, name):
        proc = self.run(f"/usr/local/bin/{name}", "--helpfull")
        return proc.stdout + proc.stderr

    def config(self):
        """The image's OCI configuration (User, Entrypoint, Cmd, ...)."""
        proc = subprocess.run(BUILDAH + ["inspect", "--type", "image", self.image], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["OCIv1"]["config"]

    def close(self):
        subprocess.run(BUILDAH + ["rm", self.container], capture_output=True, timeout=120)


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


# ----------------------------------------------------------------------------------------------
# Consistency of ports, probes, services, policy and job with the server's flags


class Tree:
    """The server and the dump job of one rendered tree, with their parsed flags."""

    def __init__(self, bin_dir, name, docs):
        self.name, self.docs = name, docs
        self.server = self.job = None
        for doc, spec, meta in pod_templates(docs):
            for c in spec["containers"]:
                for binary, args in hsx_invocations(container_argv(c)):
                    if binary == "hsx-server":
                        assert self.server is None, f"{name}: more than one hsx-server container"
                        self.server = (doc, spec, meta, c)
                        self.server_flags = parse_flags(bin_dir, binary, args)[0]
                    elif binary == "hsx-dump":
                        assert self.job is None, f"{name}: more than one hsx-dump container"
                        self.job = (doc, spec, meta, c)
                        self.dump_flags = parse_flags(bin_dir, binary, args)[0]
        assert self.server, f"{name}: no container runs hsx-server"
        assert self.job, f"{name}: no container runs hsx-dump"

    def of_kind(self, kind):
        return [d for d in self.docs if d["kind"] == kind]

    @staticmethod
    def port_of(address, flag):
        m = re.fullmatch(r"(.*):(\d+)", address or "")
        assert m, f"{flag}={address!r}: HOST:PORT expected"
        return m.group(1), int(m.group(2))

    def server_ports(self):
        f = self.server_flags
        ports = {"grpc": self.port_of(f.get("listen", "0.0.0.0:50051"), "--listen")}
        if f.get("health_listen"):
            ports["health"] = self.port_of(f["health_listen"], "--health-listen")
        if f.get("metrics_listen"):
            ports["metrics"] = self.port_of(f["metrics_listen"], "--metrics-listen")
        return ports


def labels_match(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def resolve_target(target, container):
    """A Service/NetworkPolicy port (number or name) -> the container port number."""
    if isinstance(target, int):
        return target
    for p in container.get("ports", []):
        if p.get("name") == target:
            return p["containerPort"]
    return None


@pytest.fixture(scope="module")
def trees(bin_dir, rendered):
    return {name: Tree(bin_dir, name, docs) for name, docs in rendered.items()}


@pytest.mark.parametrize("tree", TREES)
def test_ports_and_probes_match_the_server_flags(trees, tree):
    t = trees[tree]
    doc, spec, meta, c = t.server
    ports = t.server_ports()
    for what, (host, _) in ports.items():
        assert host in ("0.0.0.0", "[::]", ""), \
            f"{tree}: the {what} port listens on {host}, unreachable from the kubelet and other pods"
    assert "health" in ports, f"{tree}: --health-listen (plaintext probes, also with TLS) is not set"
    assert "metrics" in ports, f"{tree}: --metrics-listen is not set"
    named = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
    for name, (_, port) in ports.items():
        assert named.get(name) == port, \
            f"{tree}: container port '{name}' is {named.get(name)}, the server's flag says {port}"

    health_port = ports["health"][1]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        assert p and "grpc" in p, f"{tree}: {probe} is not a native gRPC probe"
        assert p["grpc"]["port"] == health_port, \
            f"{tree}: {probe} probes port {p['grpc']['port']}, --health-listen is {health_port}"
        service = p["grpc"].get("service", "")
        assert service in ("", API_SERVICE), f"{tree}: {probe} asks for service {service!r}, which the server lacks"
    assert c["readinessProbe"]["grpc"].get("service") == API_SERVICE, f"{tree}: readiness should follow {API_SERVICE}"
    # A lost device turns "" NOT_SERVING for good (docs/api.md): liveness on "" restarts the pod.
    assert c["livenessProbe"]["grpc"].get("service", "") == "", \
        f"{tree}: liveness should follow \"\" so that a server that lost a device is restarted"

    ann = meta.get("annotations", {})
    assert ann.get("prometheus.io/scrape") == "true", f"{tree}: prometheus.io/scrape"
    assert ann.get("prometheus.io/port") == str(ports["metrics"][1]), \
        f"{tree}: prometheus.io/port is not --metrics-listen's port"
    assert ann.get("prometheus.io/path") == "/metrics", f"{tree}: prometheus.io/path"

    pod_labels = meta.get("labels", {})
    services = [s for s in t.of_kind("Service")
                if s["spec"].get("selector") and labels_match(s["spec"]["selector"], pod_labels)]
    headless = {s["metadata"]["name"] for s in services if s["spec"].get("clusterIP") == "None"}
    assert headless, f"{tree}: no headless Service selects the server"
    assert any(s["spec"].get("clusterIP") != "None" for s in services), \
        f"{tree}: no ClusterIP Service selects the server"
    assert doc["spec"].get("serviceName") in headless, \
        f"{tree}: the StatefulSet's serviceName is not its headless Service"
    server_port_numbers = {p for _, p in ports.values()}
    for s in services:
        name = s["metadata"]["name"]
        for sp in s["spec"]["ports"]:
            target = resolve_target(sp.get("targetPort", sp["port"]), c)
            assert target in server_port_numbers, \
                f"{tree}: Service {name} port {sp['port']} -> {sp.get('targetPort')} is no server port"
            if sp.get("name") in ports:
                assert target == ports[sp["name"]][1], f"{tree}: Service {name} port '{sp['name']}' targets {target}"
            assert target != health_port, f"{tree}: Service {name} exposes the health port; probes reach pods directly"


@pytest.mark.parametrize("tree", TREES)
def test_network_policy(trees, tree):
    t = trees[tree]
    _, _, server_meta, c = t.server
    _, _, job_meta, _ = t.job
    ports = {name: port for name, (_, port) in t.server_ports().items()}
    policies = [p for p in t.of_kind("NetworkPolicy")
                if labels_match(p["spec"]["podSelector"].get("matchLabels"), server_meta.get("labels", {}))]
    assert policies, f"{tree}: no NetworkPolicy selects the server pods"
    covered = set()
    for pol in policies:
        assert "Ingress" in pol["spec"].get("policyTypes", ["Ingress"])
        for rule in pol["spec"].get("ingress", []):
            sources = rule.get("from")
            assert sources, f"{tree}: an ingress rule without `from` admits every source"
            rule_ports = {resolve_target(p.get("port"), c) for p in rule.get("ports", [])}
            assert rule_ports and None not in rule_ports, f"{tree}: an ingress rule without (resolvable) ports: {rule}"
            assert ports["health"] not in rule_ports, f"{tree}: the health port needs no ingress rule (kubelet)"
            covered |= rule_ports
            if ports["grpc"] in rule_ports:
                for src in sources:
                    assert set(src) == {"podSelector"}, f"{tree}: gRPC ingress from more than a pod selector: {src}"
                    selector = src["podSelector"]
                    assert selector.get("matchLabels") or selector.get("matchExpressions"), \
                        f"{tree}: gRPC ingress from an empty pod selector admits every pod"
                    assert labels_match(selector.get("matchLabels"), job_meta.get("labels", {})), \
                        f"{tree}: gRPC ingress does not admit the dump job's pods ({job_meta.get('labels')})"
            if ports["metrics"] in rule_ports:
                assert rule_ports == {ports["metrics"]}, f"{tree}: the metrics rule opens other ports too"
                for src in sources:
                    assert src.get("namespaceSelector", {}).get("matchLabels"), \
                        f"{tree}: metrics ingress should come from a monitoring namespace: {src}"
    assert ports["grpc"] in covered and ports["metrics"] in covered, f"{tree}: gRPC and metrics ingress rules"


def on_mount(path, container):
    """The volumeMount of container that holds path (the longest mountPath), or None."""
    mounts = sorted(container.get("volumeMounts", []), key=lambda vm: -len(vm["mountPath"]))
    return next((vm for vm in mounts
                 if path == vm["mountPath"] or path.startswith(vm["mountPath"].rstrip("/") + "/")), None)


@pytest.mark.parametrize("tree", TREES)
def test_dump_job(trees, tree):
    t = trees[tree]
    job, spec, meta, c = t.job
    assert job["kind"] == "Job" and job["spec"].get("completionMode") == "Indexed", f"{tree}: an Indexed Job"
    completions = job["spec"]["completions"]
    parallelism = job["spec"].get("parallelism", 1)
    assert 1 <= parallelism <= completions
    shard = t.dump_flags.get("shard", "")
    assert shard == f"$(JOB_COMPLETION_INDEX)/{completions}", \
        f"{tree}: --shard={shard}, expected $(JOB_COMPLETION_INDEX)/{completions}"

    # --server: dns:/// of the headless Service, on the port that leads to --listen's.
    server = t.dump_flags.get("server", "")
    m = re.fullmatch(r"dns:///([a-z0-9.-]+):(\d+)", server)
    assert m, f"{tree}: --server={server!r}, expected dns:///<headless service>:<port> (client-side round robin)"
    host, port = m.group(1), int(m.group(2))
    headless = {s["metadata"]["name"]: s for s in t.of_kind("Service") if s["spec"].get("clusterIP") == "None"}
    name = host.split(".")[0]
    assert name in headless, f"{tree}: --server host {host} is not a headless Service ({sorted(headless)})"
    svc_ports = [p for p in headless[name]["spec"]["ports"] if p["port"] == port]
    assert svc_ports, f"{tree}: Service {name} has no port {port}"
    assert resolve_target(svc_ports[0].get("targetPort", port), t.server[3]) == t.server_ports()["grpc"][1], \
        f"{tree}: {server} does not lead to the server's --listen port"

    # The output goes to a ReadWriteMany claim shared by the pods.
    out = t.dump_flags.get("out", "")
    mount = on_mount(out, c)
    assert mount and not mount.get("readOnly"), f"{tree}: --out={out} is not on a writable volume"
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    claim = volume.get("persistentVolumeClaim", {}).get("claimName")
    assert claim, f"{tree}: --out is on volume {mount['name']}, not a PersistentVolumeClaim"
    pvcs = {p["metadata"]["name"]: p for p in t.of_kind("PersistentVolumeClaim")}
    assert claim in pvcs and "ReadWriteMany" in pvcs[claim]["spec"]["accessModes"], \
        f"{tree}: claim {claim} is not ReadWriteMany"

    # All pods together stay within the server's admission limit.
    concurrency = int(t.dump_flags.get("concurrency", DUMP_DEFAULT_CONCURRENCY))
    limit = int(t.server_flags.get("max_concurrent_requests", SERVER_DEFAULT_MAX_CONCURRENT))
    assert parallelism * concurrency <= limit, (
        f"{tree}: {parallelism} pods x --concurrency {concurrency} exceed --max-concurrent-requests {limit}")


@pytest.mark.parametrize("tree", OVERLAYS)
def test_every_referenced_volume_exists(trees, tree):
    t = trees[tree]
    pvcs = {d["metadata"]["name"] for d in t.of_kind("PersistentVolumeClaim")}
    cms = {d["metadata"]["name"] for d in t.of_kind("ConfigMap")}
    for doc, spec, _ in pod_templates(t.docs):
        where = f"{tree}: {doc['kind']}/{doc['metadata']['name']}"
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, f"{where}: no such claim: {v}"
            if "configMap" in v:
                assert v["configMap"]["name"] in cms, f"{where}: no such ConfigMap: {v}"
        names = {v["name"] for v in spec.get("volumes", [])}
        for c in spec.get("initContainers", []) + spec["containers"]:
            for vm in c.get("volumeMounts", []):
                assert vm["name"] in names, f"{where}: {c['name']} mounts an undefined volume {vm['name']}"
    # The checkpoint is mounted read-only and --model is on it.
    _, spec, _, c = t.server
    model = t.server_flags["model"]
    mount = on_mount(model, c)
    assert mount and mount.get("readOnly") is True, f"{tree}: --model={model} is not on a read-only mount"


def parse_duration(text):
    total, pos = 0.0, 0
    for m in re.finditer(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text):
        assert m.start() == pos, f"bad duration {text!r}"
        total += float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]
        pos = m.end()
    assert pos == len(text) and pos > 0, f"bad duration {text!r}"
    return total


def probe_budget(probe):
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


@pytest.mark.parametrize("tree", TREES)
def test_grace_period_exceeds_drain_timeout(bin_dir, trees, tree):
    t = trees[tree]
    _, spec, _, _ = t.server
    drain = parse_duration(t.server_flags.get("drain_timeout") or flags_of(bin_dir, "hsx-server")["drain_timeout"])
    grace = spec.get("terminationGracePeriodSeconds", 30)
    # The server stops (and logs) after the drain; leave it some seconds beyond --drain-timeout.
    assert grace >= drain + 10, \
        f"{tree}: terminationGracePeriodSeconds {grace} must exceed --drain-timeout {drain:g}s (+10 s)"


def parse_quantity(text):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(text))
    assert m, f"unexpected quantity {text!r}"
    scale = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    return float(m.group(1)) * scale[m.group(2)]


# Hidden size of the model each overlay serves (tiny preset; Kimi-K2).
OVERLAY_HIDDEN = {"cpu-demo": 128, "gpu-8": 7168}


@pytest.mark.parametrize("tree", OVERLAYS)
def test_server_memory_limit_covers_its_worst_case(bin_dir, trees, tree):
    """docs/api.md's bound on held states, for requests with the default (eagle3) capture set:
    every admitted stream holding a finished sample of the longest length as float32, plus one
    batch's captured layers."""
    t = trees[tree]
    f, defaults = t.server_flags, flags_of(bin_dir, "hsx-server")
    hidden = OVERLAY_HIDDEN[tree]
    layers = 4 + (1 if f.get("final_norm") == "true" else 0)
    batch = int(f.get("max_batch_tokens") or defaults["max_batch_tokens"])
    tokens = int(f.get("max_tokens_per_sample") or 0) or batch
    streams = int(f.get("max_concurrent_requests") or defaults["max_concurrent_requests"])
    bound = streams * 4 * tokens * layers * hidden + 4 * batch * (layers + 1) * hidden
    limit = parse_quantity(t.server[3]["resources"]["limits"]["memory"])
    assert bound < limit, (f"{tree}: {streams} streams x {tokens} tokens may hold {bound / 2**30:.1f} GiB of states, "
                           f"more than the memory limit {limit / 2**30:.1f} GiB")


def test_gpu8_sizing(trees):
    t = trees["gpu-8"]
    _, spec, _, c = t.server
    assert t.server_flags.get("device") == "cuda" and t.server_flags.get("tp") == "8"
    for kind in ("requests", "limits"):
        assert str(c["resources"][kind].get("nvidia.com/gpu")) == "8", f"gpu-8: nvidia.com/gpu: 8 in {kind}"
    budget = probe_budget(c["startupProbe"])
    assert budget >= 30 * 60, f"gpu-8: the startupProbe allows {budget} s to load ~600 GB; at least 30 min"
    job = t.job[0]
    assert job["spec"]["completions"] == 16 and job["spec"].get("parallelism") == 16, "gpu-8: a 16-way dump job"


def test_cpu_demo_shape(trees):
    t = trees["cpu-demo"]
    _, spec, _, c = t.server
    assert t.server_flags.get("device", "cpu") == "cpu"
    for kind in ("requests", "limits"):
        assert "nvidia.com/gpu" not in c["resources"].get(kind, {}), "cpu-demo asks for no GPU"
    makers = [(b, a) for ic in spec.get("initContainers", []) for b, a in hsx_invocations(container_argv(ic))
              if b == "hsx-make-model"]
    assert makers, "cpu-demo: an init container runs hsx-make-model"
    vol = next(v for v in spec["volumes"] if v["name"] == "models")
    assert "emptyDir" in vol and "persistentVolumeClaim" not in vol, f"cpu-demo: the model volume is an emptyDir: {vol}"
    assert t.job[0]["spec"]["completions"] == 2, "cpu-demo: a 2-way dump job"


# ----------------------------------------------------------------------------------------------
# The cpu-demo overlay, run here


def free_ports(n):
    """n distinct free ports on 127.0.0.1 (all bound at once, so that none repeats)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def grpc_health(address, service, timeout=5):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


class LocalPod:
    """Runs a rendered pod template's containers here: each volume a directory (claims shared by
    name between pods, ConfigMaps written out), each server container port a free local port,
    Service names -> 127.0.0.1, $(VAR) expanded from the container's env."""

    def __init__(self, tmp, docs, spec, env_values, ports, claim_dirs, pod_name):
        self.docs, self.spec, self.env_values = docs, spec, env_values
        self.named_ports, self.port_map = ports
        self.volume_dirs = {}
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                name = v["persistentVolumeClaim"]["claimName"]
                d = claim_dirs.setdefault(name, tmp / "pvc" / name)
            else:
                d = tmp / pod_name / v["name"]
            d.mkdir(parents=True, exist_ok=True)
            if "configMap" in v:
                cm = next(x for x in docs
                          if x["kind"] == "ConfigMap" and x["metadata"]["name"] == v["configMap"]["name"])
                for key, value in cm.get("data", {}).items():
                    (d / key).write_text(value)
            self.volume_dirs[v["name"]] = d

    def env(self, container):
        env = dict(self.env_values)
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
        return env

    def host_path(self, container, path):
        for vm in sorted(container.get("volumeMounts", []), key=lambda vm: -len(vm["mountPath"])):
            mp = vm["mountPath"].rstrip("/")
            if path == mp or path.startswith(mp + "/"):
                return self.volume_dirs[vm["name"]] / path[len(mp):].lstrip("/")
        raise AssertionError(f"{path} is on no volume of container {container['name']}")

    def service_port(self, name, port):
        service = next(s for s in self.docs if s["kind"] == "Service" and s["metadata"]["name"] == name)
        for sp in service["spec"]["ports"]:
            if sp["port"] == port:
                target = sp.get("targetPort", port)
                return self.port_map[self.named_ports[target] if isinstance(target, str) else target]
        raise AssertionError(f"Service {name} has no port {port}")

    def argv(self, container, bin_dir):
        env = self.env(container)
        mounts = container.get("volumeMounts", [])
        services = [s["metadata"]["name"] for s in self.docs if s["kind"] == "Service"]

        by_length = sorted(mounts, key=lambda vm: -len(vm["mountPath"].rstrip("/")))
        mount_re = re.compile(r"(?<![\w.\-/])(" + "|".join(re.escape(vm["mountPath"].rstrip("/")) for vm in by_length)
                              + r")(?=/|$|[^\w.\-])") if mounts else None
        mount_dirs = {vm["mountPath"].rstrip("/"): str(self.volume_dirs[vm["name"]]) for vm in mounts}

        def rewrite(token):
            token = re.sub(r"\$\$|\$\((\w+)\)",
                           lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), token)
            for name in services:
                # NAME, NAME.ns.svc..., NAME:PORT, dns:///NAME:PORT; not inside a path or another name
                token = re.sub(r"(?:(?<=dns:///)|(?<![\w.\-/]))" + re.escape(name)
                               + r"(?:\.[a-z0-9.\-]+)?(?::(\d+))?(?![\w\-/])",
                               lambda m: "127.0.0.1" + (f":{self.service_port(name, int(m.group(1)))}"
                                                        if m.group(1) else ""), token)
            token = re.sub(r"(?:0\.0\.0\.0|\[::\])?:(\d+)\b",
                           lambda m: f"127.0.0.1:{self.port_map[int(m.group(1))]}" if int(m.group(1)) in self.port_map
                           else m.group(0), token)
            if mount_re:  # one pass: a replacement is never rewritten again
                token = mount_re.sub(lambda m: mount_dirs[m.group(1)], token)
            return token.replace("/usr/local/bin/hsx-", f"{bin_dir}/hsx-")

        argv = [rewrite(a) for a in container_argv(container)]
        if Path(argv[0]).name in HSX_BINARIES:
            argv[0] = str(Path(bin_dir) / Path(argv[0]).name)
        unexpanded = [a for a in argv if re.search(r"\$\(\w+\)", a)]
        assert not unexpanded, f"container {container['name']}: variables not defined in its env: {unexpanded}"
        return argv


def doc_grpcurl_requests():
    """[(method, request JSON)] of the grpcurl calls of hsx.v1.HiddenStates in docs/deploy.md."""
    text = re.sub(r"\\\n\s*", " ", DEPLOY_DOC.read_text())
    calls = []
    for line in text.splitlines():
        m = re.search(r"grpcurl\b.*?(hsx\.v1\.HiddenStates/\w+)", line)
        if m and "-plaintext" in line:
            d = re.search(r"-d '([^']*)'", line)
            calls.append((m.group(1).split("/")[1], d.group(1) if d else "{}"))
    return calls


def check_doc_grpcurl_calls(hsx_pb, pod, tree):
    """The grpcurl calls of docs/deploy.md, made through the ClusterIP Service's gRPC port."""
    import grpc
    from google.protobuf import json_format

    hsx_pb2, hsx_pb2_grpc = hsx_pb
    calls = doc_grpcurl_requests()
    assert {"GetModelInfo", "Extract"} <= {m for m, _ in calls}, "docs/deploy.md: no grpcurl GetModelInfo/Extract"
    _, _, meta, c = tree.server
    service = next(s for s in tree.of_kind("Service") if s["spec"].get("clusterIP") != "None"
                   and labels_match(s["spec"].get("selector"), meta.get("labels", {})))
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p.get("name") == "grpc")
    address = f"127.0.0.1:{pod.service_port(service['metadata']['name'], grpc_port)}"
    with grpc.insecure_channel(address) as channel:
        stub = hsx_pb2_grpc.HiddenStatesStub(channel)
        for method, body in calls:
            if method == "GetModelInfo":
                info = stub.GetModelInfo(json_format.Parse(body, hsx_pb2.GetModelInfoRequest()), timeout=10)
                assert info.num_layers > 0 and info.device == tree.server_flags.get("device", "cpu"), info
            elif method == "Extract":
                request = json_format.Parse(body, hsx_pb2.ExtractRequest())
                parts = [m.WhichOneof("part") for m in stub.Extract(request, timeout=60)]
                if request.summary:
                    assert parts == ["header", "summary", "trailer"], f"docs/deploy.md Extract {body}: {parts}"
                else:
                    assert parts[0] == "header" and parts[-1] == "trailer", parts
            else:
                pytest.fail(f"docs/deploy.md calls an unknown method hsx.v1.HiddenStates/{method}")


def process_env(bin_dir):
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def cpu_demo_run(bin_dir, rendered, trees, hsx_pb, tmp_path_factory):
    """Runs cpu-demo's server (init containers first) and every shard of its dump job, then
    stops the server with SIGTERM; returns the output and input paths and the server log."""
    from grpc_health.v1 import health_pb2

    for b in ("hsx-server", "hsx-dump", "hsx-make-model"):
        _bin(bin_dir, b)
    docs = rendered["cpu-demo"]
    t = trees["cpu-demo"]
    tmp = tmp_path_factory.mktemp("cpu-demo")
    claim_dirs = {}
    _, server_spec, _, server_c = t.server
    named = {p["name"]: p["containerPort"] for p in server_c.get("ports", []) if "name" in p}
    ports = (named, dict(zip(named.values(), free_ports(len(named)))))
    env = process_env(bin_dir)

    server_pod = LocalPod(tmp, docs, server_spec, {}, ports, claim_dirs, "server")
    for ic in server_spec.get("initContainers", []):
        argv = server_pod.argv(ic, bin_dir)
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, f"init container {ic['name']} failed: {shlex.join(argv)}\n{proc.stderr}"
    # Twice, as after a pod sandbox restart (the emptyDir keeps the first run's files).
    for ic in server_spec.get("initContainers", []):
        proc = subprocess.run(server_pod.argv(ic, bin_dir), capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, f"init container {ic['name']} fails when it runs again:\n{proc.stderr}"

    server = HsxServer(bin_dir, "unused", metrics=False)
    server.cmd = server_pod.argv(server_c, bin_dir)
    server.env = env
    assert Path(server.cmd[0]).name == "hsx-server"
    runs = []
    server.start(timeout=min(probe_budget(server_c["startupProbe"]), 300))
    try:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            address = f"127.0.0.1:{ports[1][server_c[probe]['grpc']['port']]}"
            service = server_c[probe]["grpc"].get("service", "")
            assert grpc_health(address, service) == health_pb2.HealthCheckResponse.SERVING, \
                f"{probe} (service {service!r}) on {address} is not SERVING"
        metrics = ports[1][t.server_ports()["metrics"][1]]
        path = t.server[2]["annotations"]["prometheus.io/path"]
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}{path}", timeout=10) as r:
            assert r.status == 200 and b"# TYPE" in r.read(), f"no Prometheus text on {path}"

        check_doc_grpcurl_calls(hsx_pb, server_pod, t)

        job, job_spec, _, job_c = t.job
        completions = job["spec"]["completions"]
        for index in range(completions):
            pod = LocalPod(tmp, docs, job_spec, {"JOB_COMPLETION_INDEX": str(index)}, ports, claim_dirs,
                           f"dump-{index}")
            for ic in job_spec.get("initContainers", []):
                argv = pod.argv(ic, bin_dir)
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
                assert proc.returncode == 0, \
                    f"dump {index}: init container {ic['name']} failed: {shlex.join(argv)}\n{proc.stderr}"
            argv = pod.argv(job_c, bin_dir)
            assert f"--shard={index}/{completions}" in argv, argv
            runs.append((index, argv, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                       text=True, env=env)))
        for index, argv, proc in runs:
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, \
                f"dump shard {index} failed ({proc.returncode}): {shlex.join(argv)}\n{err[-4000:]}"
        rc = server.stop(timeout=server_spec.get("terminationGracePeriodSeconds", 30))
        assert rc == 0, f"hsx-server did not drain and exit 0 on SIGTERM (status {rc}):\n{server.text()[-4000:]}"
    finally:
        server.kill()
        for _, _, proc in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    return {"out": pod.host_path(job_c, t.dump_flags["out"]),
            "input": pod.host_path(job_c, t.dump_flags["input"]),
            "server_log": server.text()}


def test_cpu_demo_runs_end_to_end(cpu_demo_run):
    out, inputs = cpu_demo_run["out"], cpu_demo_run["input"]
    lines = [ln for ln in inputs.read_text().splitlines() if ln.strip()]
    assert lines, f"no input samples in {inputs}"
    files = sorted(p.name for p in out.glob("hs_*.safetensors"))
    assert files == sorted(f"hs_{i}.safetensors" for i in range(len(lines))), f"output files: {files}"
    journal = [json.loads(ln) for ln in (out / "manifest.jsonl").read_text().splitlines() if ln.strip()]
    assert len(journal) >= len(lines), f"{len(journal)} journal lines for {len(lines)} samples"
    assert "drain" in cpu_demo_run["server_log"], "the server log shows no drain on SIGTERM"


def test_cpu_demo_output_passes_hsx_verify(bin_dir, cpu_demo_run):
    verify = Path(bin_dir) / "hsx-verify"
    if not os.access(verify, os.X_OK):
        pytest.skip(f"hsx-verify is not built in {bin_dir} yet")
    cmd = [str(verify), str(cpu_demo_run["out"]), "--input", str(cpu_demo_run["input"]), "--strict"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{shlex.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
