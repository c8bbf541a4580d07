"""The trainers' tests' shared fixtures: the tiny verifier checkpoint with a
tokenizer and chat template beside its weights (`model`) and hsx-server serving
it on loopback (`server`), once per session."""

import re
import subprocess
import time

import pytest

from pipeline import BIN, add_tokenizer


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run([BIN / "hsx-make-model", "--preset", "tiny", "--seed", "0", "--out", out], check=True,
                   capture_output=True)
    add_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([BIN / "hsx-server", "--model", model, "--listen", "127.0.0.1:0"], stderr=sink)
    try:
        deadline = time.time() + 120
        while "ready:" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.05)
        yield re.search(r"listening on (\S+)", log.read_text()).group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
