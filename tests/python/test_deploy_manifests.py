"""deploy/k8s: the Kubernetes manifests, checked against the real binaries without a cluster:
- every overlay (and the base) rendered with `kubectl kustomize` (kubectl from HSX_KUBECTL or
  PATH; Debian's kubernetes-client 1.20 and current kubectl both render these) and every
  document validated strictly against the Kubernetes 1.30 schemas (kubernetes-validate);
- every flag given to hsx-server / hsx-dump / hsx-make-model / hsx-verify / hsx-inspect in the
  Dockerfile, the manifests and docs/deploy.md is one the binary accepts (its --helpfull);
- ports, probes, Services, the NetworkPolicy and the Job agree with the server's own flags;
  terminationGracePeriodSeconds exceeds --drain-timeout; the 8-GPU start-up budget.
"""

import re

import pytest

from deploy_helpers import (API_SERVICE, DUMP_DEFAULT_CONCURRENCY, KUBERNETES_VERSION, OVERLAYS,
                            SERVER_DEFAULT_MAX_CONCURRENT, TREES, check_every_flag_is_accepted, container_argv,
                            flags_of, hsx_invocations, labels_match, pod_templates, probe_budget, resolve_target)


# ----------------------------------------------------------------------------------------------
# Rendering and schema validation


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
# Every flag the deployment gives a binary


def test_every_flag_is_accepted_by_its_binary(bin_dir, rendered):
    check_every_flag_is_accepted(bin_dir, rendered)


def test_defaults_assumed_here_are_the_binaries(bin_dir):
    assert flags_of(bin_dir, "hsx-server")["max_concurrent_requests"] == str(SERVER_DEFAULT_MAX_CONCURRENT)
    assert flags_of(bin_dir, "hsx-dump")["concurrency"] == str(DUMP_DEFAULT_CONCURRENCY)


# ----------------------------------------------------------------------------------------------
# Consistency of ports, probes, services, policy and job with the server's flags


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

    # All pods together stay within the servers' admission limit; with several replicas, within
    # that of all but one (the job keeps fitting while one server restarts or drains).
    concurrency = int(t.dump_flags.get("concurrency", DUMP_DEFAULT_CONCURRENCY))
    limit = int(t.server_flags.get("max_concurrent_requests", SERVER_DEFAULT_MAX_CONCURRENT))
    replicas = t.server[0]["spec"].get("replicas", 1)
    serving = max(1, replicas - 1)
    assert parallelism * concurrency <= serving * limit, (
        f"{tree}: {parallelism} pods x --concurrency {concurrency} exceed {serving} of {replicas} servers x "
        f"--max-concurrent-requests {limit}")


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
        # A StatefulSet's volumeClaimTemplates are volumes of its pods too.
        names |= {vct["metadata"]["name"] for vct in doc["spec"].get("volumeClaimTemplates", [])}
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
OVERLAY_HIDDEN = {"cpu-demo": 128, "gpu-8": 7168, "fleet": 7168}


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
