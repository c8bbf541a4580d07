"""Shared fixtures for the Python cross-checks of the hsx command-line tools.

The binaries are located through HSX_BIN_DIR (scripts/test.sh sets it), or
<repo>/build/bin by default. A missing binary is a test failure, never a skip:
these tests are the only independent check of the checkpoint format.
"""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BIN_DIR = REPO_ROOT / "build" / "bin"
BINARIES = ("hsx-make-model", "hsx-inspect", "hsx-dump", "hsx-server", "hsx-verify")
LAYOUTS = ("k2", "k2.5")


def _bin_dir() -> Path:
    env = os.environ.get("HSX_BIN_DIR")
    return Path(env).resolve() if env else DEFAULT_BIN_DIR


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    """Directory holding hsx-make-model and hsx-inspect; fails if they are missing."""
    d = _bin_dir()
    missing = [b for b in BINARIES if not os.access(d / b, os.X_OK)]
    if missing:
        pytest.fail(
            f"hsx binaries not found in {d}: {', '.join(missing)}. Build first "
            f"(scripts/test.sh, or `cmake -S {REPO_ROOT} -B {REPO_ROOT}/build -G Ninja"
            f" && ninja -C {REPO_ROOT}/build`), or point HSX_BIN_DIR at the directory"
            " that holds them.",
            pytrace=False,
        )
    return d


class Runner:
    """Runs an hsx binary and returns the CompletedProcess (text mode)."""

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir

    def __call__(self, name, *args, expect_ok=True, timeout=120):
        cmd = [str(self.bin_dir / name), *map(str, args)]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False
        )
        if expect_ok is True and proc.returncode != 0:
            raise AssertionError(
                f"command failed with exit status {proc.returncode}: {shlex.join(cmd)}\n"
                f"--- stderr ---\n{proc.stderr}\n--- stdout ---\n{proc.stdout[-4000:]}"
            )
        if expect_ok is False and proc.returncode == 0:
            raise AssertionError(
                f"command unexpectedly succeeded: {shlex.join(cmd)}\n"
                f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr}"
            )
        return proc


@pytest.fixture(scope="session")
def run(bin_dir) -> Runner:
    """run(binary, *args, expect_ok=True|False|None) -> CompletedProcess.

    expect_ok=True asserts exit status 0 (the message carries stderr), False
    asserts a non-zero status, None checks nothing.
    """
    return Runner(bin_dir)


@pytest.fixture(scope="session")
def make_model(run, tmp_path_factory):
    """make_model(layout="k2", seed=0, extra_args=(), preset="tiny", fresh=False) -> Path.

    Writes a checkpoint with hsx-make-model into a new temporary directory.
    Results are cached per argument set for the session unless fresh=True.
    layout=None omits --layout (the config's own layout with --config);
    preset=None omits --preset (pass --config in extra_args).
    """
    cache = {}

    def _make(layout="k2", seed=0, extra_args=(), preset="tiny", fresh=False):
        key = (layout, seed, tuple(map(str, extra_args)), preset)
        if not fresh and key in cache:
            return cache[key]
        tag = f"ckpt-{(layout or 'cfg').replace('.', '')}-s{seed}"
        out = tmp_path_factory.mktemp(tag) / "model"
        args = []
        if preset is not None:
            args += ["--preset", preset]
        if layout is not None:
            args += ["--layout", layout]
        args += ["--seed", seed, "--out", out, *extra_args]
        run("hsx-make-model", *args)
        assert (out / "config.json").is_file(), f"no config.json in {out}"
        if not fresh:
            cache[key] = out
        return out

    return _make


@pytest.fixture(scope="session")
def hsx_pb(tmp_path_factory):
    """(hsx_pb2, hsx_pb2_grpc) generated from proto/hsx/v1/hsx.proto with grpcio-tools."""
    import importlib
    import sys

    # hsx first: its native module loads Debian's libprotobuf, and grpcio-tools' protoc carries a
    # protobuf of its own; both export the same GNU "unique" symbols (function-local statics),
    # which the process binds once, to the library loaded first. Loaded after grpc_tools,
    # libprotobuf's initializer locks a mutex in grpc_tools' object of another layout and aborts
    # (glibc's tpp.c assertion); in this order both work (client/README.md).
    import hsx  # noqa: F401
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("stubs")
    proto_root = REPO_ROOT / "proto"
    rc = protoc.main(["protoc", f"-I{proto_root}", f"--python_out={out}", f"--grpc_python_out={out}",
                      str(proto_root / "hsx" / "v1" / "hsx.proto")])
    assert rc == 0, "protoc failed on proto/hsx/v1/hsx.proto"
    sys.path.insert(0, str(out))
    return (importlib.import_module("hsx.v1.hsx_pb2"), importlib.import_module("hsx.v1.hsx_pb2_grpc"))


@pytest.fixture(scope="session")
def tiny(make_model):
    """The tiny preset (K2 layout, seed 0), shared by the tests that do not need their own."""
    return make_model("k2", seed=0)


@pytest.fixture(scope="session")
def tools(bin_dir):
    """The binary directory (all of BINARIES checked present by bin_dir)."""
    return bin_dir


@pytest.fixture(scope="session")
def rendered():
    """{tree: [documents]} for base and every overlay of deploy/k8s, rendered by `kubectl kustomize`."""
    from deploy_helpers import TREES, render

    return {tree: render(tree) for tree in TREES}


@pytest.fixture(scope="session")
def trees(bin_dir, rendered):
    """{tree: deploy_helpers.Tree}: the server and the dump job of each rendered tree, with their flags."""
    from deploy_helpers import Tree

    return {name: Tree(bin_dir, name, docs) for name, docs in rendered.items()}
