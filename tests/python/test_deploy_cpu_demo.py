"""The cpu-demo overlay's own commands, run here (volumes as temporary directories, the server
on 127.0.0.1 with free ports, $(JOB_COMPLETION_INDEX) = each index): the init container makes
the tiny model, the server becomes SERVING on its probe port, every shard of the dump job
completes, and hsx-verify accepts the output.
"""

import json
import os
import re
import shlex
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from deploy_helpers import (DEPLOY_DOC, HSX_BINARIES, binary_path, container_argv, labels_match,
                            probe_budget)
from hsx_server import HsxServer


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
        binary_path(bin_dir, b)
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
    journal = [json.loads(ln) for path in [out / "manifest.jsonl", *sorted((out / "journal").glob("*.jsonl"))]
               if path.exists() for ln in path.read_text().splitlines() if ln.strip()]
    assert len(journal) >= len(lines), f"{len(journal)} journal lines for {len(lines)} samples"
    assert "drain" in cpu_demo_run["server_log"], "the server log shows no drain on SIGTERM"


def test_cpu_demo_output_passes_hsx_verify(bin_dir, cpu_demo_run):
    verify = Path(bin_dir) / "hsx-verify"
    if not os.access(verify, os.X_OK):
        pytest.skip(f"hsx-verify is not built in {bin_dir} yet")
    cmd = [str(verify), str(cpu_demo_run["out"]), "--input", str(cpu_demo_run["input"]), "--strict"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{shlex.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
