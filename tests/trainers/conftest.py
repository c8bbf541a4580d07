"""The trainers' tests' shared fixtures: the tiny verifier checkpoint with a
tokenizer and chat template beside its weights (`model`) and hsx-server serving
it on loopback (`server`), once per session."""

import subprocess

import pytest

from pipeline import BIN, add_tokenizer
from hsx_server import HsxServer  # tests/python, on the path through pipeline


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run([BIN / "hsx-make-model", "--preset", "tiny", "--seed", "0", "--out", out], check=True,
                   capture_output=True)
    add_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def server(model):
    proc = HsxServer(BIN, model, metrics=False).start(timeout=120, wait_serving=False)
    try:
        proc.wait_ready(120)
        yield proc.address
    finally:
        proc.stop()
