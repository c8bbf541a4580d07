"""deploy/k8s/overlays/fleet: N servers with a per-node staged checkpoint, and a dump job whose
shard count is one number. Proves that
- changing `completions` in the overlay's dump-job.yaml (and nothing else) changes parallelism
  and hsx-dump's --shard N consistently (rendered from a copy of deploy/k8s);
- the servers are spread one per node, each with its own local volume, filled by an init container
  that runs the overlay's stage-model.sh (the ConfigMap holds that file) from the shared claim;
- stage-model.sh itself, run here against a generated tiny model and the real hsx-inspect: copies
  and verifies, keeps a staged copy, replaces one of another checkpoint, and refuses (exit 1,
  naming the cause, destination untouched) a missing digest file, a changed byte, a truncated shard.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy_helpers import K8S, KUSTOMIZE_MAJOR, NEEDS_KUSTOMIZE_4, OVERLAYS, Tree, render, shellcheck

FLEET = K8S / "overlays" / "fleet"
STAGE = FLEET / "stage-model.sh"


def test_fleet_overlay_is_rendered():
    if "fleet" not in OVERLAYS:
        pytest.skip(f"kubectl's kustomize is v{KUSTOMIZE_MAJOR}; {NEEDS_KUSTOMIZE_4} need kustomize v4 or later")


def fleet_with_shards(tmp_path, shards):
    """A copy of deploy/k8s whose fleet dump-job.yaml says `completions: shards`, rendered."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    job = copy / "overlays" / "fleet" / "dump-job.yaml"
    text, n = re.subn(r"(?m)^  completions: \d+$", f"  completions: {shards}", job.read_text())
    assert n == 1, "fleet/dump-job.yaml: no single `  completions: N` line"
    job.write_text(text)
    return render("fleet", copy)


@pytest.mark.parametrize("shards", [7, 64, 1])
def test_fleet_shard_count_is_one_number(bin_dir, tmp_path, shards):
    if "fleet" not in OVERLAYS:
        pytest.skip("needs kustomize v4 or later")
    docs = fleet_with_shards(tmp_path, shards)
    t = Tree(bin_dir, "fleet", docs)
    job = t.job[0]
    assert job["spec"]["completions"] == shards
    assert job["spec"]["parallelism"] == shards and isinstance(job["spec"]["parallelism"], int)
    assert t.dump_flags["shard"] == f"$(JOB_COMPLETION_INDEX)/{shards}"
    text = repr(docs)
    assert "$(HSX_SHARDS)" not in text, "an unresolved $(HSX_SHARDS) is left in the rendered fleet overlay"


def test_fleet_servers_and_staging(trees):
    if "fleet" not in trees:
        pytest.skip("needs kustomize v4 or later")
    t = trees["fleet"]
    sts, spec, meta, c = t.server
    assert sts["kind"] == "StatefulSet" and sts["spec"]["replicas"] >= 2, "fleet: several server replicas"
    anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(term["topologyKey"] == "kubernetes.io/hostname"
               and term["labelSelector"]["matchLabels"].items() <= meta["labels"].items() for term in anti), \
        "fleet: at most one server pod per node"
    # The checkpoint: a per-pod ReadWriteOnce volume, no longer the shared hsx-models claim.
    vcts = {v["metadata"]["name"]: v for v in sts["spec"].get("volumeClaimTemplates", [])}
    assert "models" in vcts and vcts["models"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "models" not in {v["name"] for v in spec["volumes"]}, "fleet: the base's shared models volume is left"
    model = t.server_flags["model"]
    mount = next(vm for vm in c["volumeMounts"] if vm["name"] == "models")
    assert mount["readOnly"] is True and model.startswith(mount["mountPath"] + "/")

    # The init container runs the overlay's stage-model.sh from the shared source claim into --model.
    stage = next(ic for ic in spec["initContainers"] if ic["name"] == "stage-model")
    argv = stage["command"] + stage.get("args", [])
    assert argv[0] == "/bin/sh" and len(argv) == 4, argv
    mounts = {vm["name"]: vm for vm in stage["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    script_vol = next(n for n, vm in mounts.items() if argv[1].startswith(vm["mountPath"] + "/"))
    cm_name = volumes[script_vol]["configMap"]["name"]
    cm = next(d for d in t.of_kind("ConfigMap") if d["metadata"]["name"] == cm_name)
    assert cm["data"][Path(argv[1]).name] == STAGE.read_text(), "the ConfigMap is not stage-model.sh"
    src_vol = next(n for n, vm in mounts.items() if argv[2].startswith(vm["mountPath"] + "/"))
    assert mounts[src_vol].get("readOnly") and volumes[src_vol]["persistentVolumeClaim"]["readOnly"]
    claims = {d["metadata"]["name"] for d in t.of_kind("PersistentVolumeClaim")}
    assert volumes[src_vol]["persistentVolumeClaim"]["claimName"] in claims
    assert argv[3] == model, f"stage-model.sh writes {argv[3]}, the server reads --model={model}"
    assert not mounts["models"].get("readOnly"), "stage-model needs the local volume writable"


def test_fleet_quarantine_and_connection_age(trees):
    """A shard that ends with samples in quarantine (hsx-dump exits 3) is marked failed at once, not
    restarted into the same exit forever; other failures are retried per shard; the servers age
    their connections so that the dump pods re-resolve hsx-headless."""
    if "fleet" not in trees:
        pytest.skip("needs kustomize v4 or later")
    t = trees["fleet"]
    job = t.job[0]
    assert int(t.dump_flags["max_failures"]) > 0
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never", "a restart in place would rerun into exit 3 again"
    rules = job["spec"]["podFailurePolicy"]["rules"]
    exit3 = [r for r in rules if 3 in r.get("onExitCodes", {}).get("values", [])]
    assert [r["action"] for r in exit3] == ["FailIndex"] and exit3[0]["onExitCodes"]["operator"] == "In"
    assert job["spec"]["backoffLimitPerIndex"] >= 1 and job["spec"]["completionMode"] == "Indexed"
    assert t.server_flags["max_connection_age"] == "5m"


# ----------------------------------------------------------------------------------------------
# stage-model.sh against a real (tiny) checkpoint


@pytest.fixture()
def staged_env(bin_dir, tmp_path):
    src = tmp_path / "shared" / "tiny"
    subprocess.run([str(bin_dir / "hsx-make-model"), "--preset", "tiny", "--out", str(src)], check=True,
                   capture_output=True, timeout=120)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", HSX_STAGE_JOBS="3")
    return src, tmp_path / "local" / "tiny", env


def stage(src, dst, env):
    return subprocess.run(["sh", str(STAGE), str(src), str(dst)], capture_output=True, text=True, env=env,
                          timeout=120)


def write_digest(bin_dir, src):
    out = subprocess.run([str(bin_dir / "hsx-inspect"), "--model", str(src), "--full-digest"], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    (src / "hsx-full-digest.txt").write_text(out)
    return out.split()[0]


def test_stage_model_copies_verifies_and_keeps(bin_dir, staged_env):
    src, dst, env = staged_env
    proc = stage(src, dst, env)
    assert proc.returncode == 1 and "hsx-full-digest.txt: missing" in proc.stderr, proc.stderr
    assert not dst.exists()

    digest = write_digest(bin_dir, src)
    proc = stage(src, dst, env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in src.iterdir())
    for f in src.iterdir():
        assert (dst / f.name).read_bytes() == f.read_bytes(), f.name
    assert not Path(f"{dst}.partial").exists()

    # Staged already: nothing copied again (the files are the same inodes).
    inode = (dst / "model.safetensors").stat().st_ino
    proc = stage(src, dst, env)
    assert proc.returncode == 0 and f"already holds checkpoint {digest}" in proc.stdout, proc.stdout
    assert (dst / "model.safetensors").stat().st_ino == inode

    # A new checkpoint at the source replaces the staged one.
    shutil.rmtree(src)
    subprocess.run([str(bin_dir / "hsx-make-model"), "--preset", "tiny", "--seed", "7", "--out", str(src)],
                   check=True, capture_output=True, timeout=120)
    new = write_digest(bin_dir, src)
    assert new != digest
    proc = stage(src, dst, env)
    assert proc.returncode == 0, proc.stderr
    assert (dst / "hsx-full-digest.txt").read_text().split()[0] == new
    assert (dst / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


@pytest.mark.parametrize("damage", ["flip", "truncate", "bad-digest-file"])
def test_stage_model_refuses_a_bad_copy(bin_dir, staged_env, damage):
    src, dst, env = staged_env
    write_digest(bin_dir, src)
    shard = src / "model.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "flip":  # the last byte: a weight, not the header
        data[-1] ^= 0x01
        shard.write_bytes(bytes(data))
        expect = "but " + str(src / "hsx-full-digest.txt") + " says"
    elif damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
        expect = "--full-digest failed"
    else:
        (src / "hsx-full-digest.txt").write_text("not-a-digest\n")
        expect = "is not an XXH64 digest"
    proc = stage(src, dst, env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert expect in proc.stderr, proc.stderr
    assert not dst.exists() and not Path(f"{dst}.partial").exists()


def test_stage_model_passes_shellcheck():
    shellcheck(STAGE, shell="sh")
