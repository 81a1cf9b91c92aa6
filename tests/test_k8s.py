"""deploy/k8s: every manifest is valid Kubernetes, and the files agree.

Each document is validated offline, strictly (no unknown fields), against one
fixed Kubernetes version with kubernetes-validate. Then the wiring between
files is checked: the gateway's worker list names the StatefulSet's pods
through its headless Service, every probe and annotation points at a port the
container really opens, Services select pods that exist, and every container
has requests and limits.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
# The oldest release we promise to run on; strict = unknown fields are errors.
KUBERNETES_VERSION = "1.30.0"
METRICS_PORT = 9100

Doc = dict[str, Any]


def _docs() -> list[tuple[str, Doc]]:
    out: list[tuple[str, Doc]] = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def _one(kind: str, name: str) -> Doc:
    found = [d for _, d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _config() -> dict[str, str]:
    data: dict[str, str] = _one("ConfigMap", "skiff-config")["data"]
    return data


def _container(workload: Doc) -> Doc:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: Doc = containers[0]
    return container


def _env(workload: Doc) -> dict[str, str]:
    """What the container sees: the ConfigMaps it loads, then its own env."""
    container = _container(workload)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        cm = _one("ConfigMap", source["configMapRef"]["name"])
        env.update(cm["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    return env


def _ports(workload: Doc) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in _container(workload)["ports"]}


def _ping_port(probe: Doc) -> int:
    """The port a `python -c ... Client('tcp://127.0.0.1:PORT').ping()` probe pings."""
    command = probe["exec"]["command"]
    assert command[:2] == ["python", "-c"], command
    code = command[2]
    assert "Client(" in code and ".ping()" in code, code
    return int(code.split("tcp://127.0.0.1:")[1].split("'")[0])


def _bind_port(endpoint: str) -> int:
    assert endpoint.startswith("tcp://0.0.0.0:"), endpoint
    return int(endpoint.rsplit(":", 1)[1])


def test_manifests_exist() -> None:
    names = {p.name for p in K8S.glob("*.yaml")}
    assert {"configmap.yaml", "worker.yaml", "gateway.yaml", "speech.yaml"} <= names


@pytest.mark.parametrize(
    "doc", [d for _, d in _docs()], ids=[f"{f}:{d['kind']}" for f, d in _docs()]
)
def test_every_manifest_is_valid_kubernetes(doc: Doc) -> None:
    # Raises ValidationError (with the failing path) on any schema violation.
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_rejects_an_unknown_field() -> None:
    # The strict check above must be able to fail: a typo'd field is an error.
    bad = _one("Service", "skiff-gateway")
    bad = {**bad, "spec": {**bad["spec"], "clusterIp": "None"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_gateway_lists_each_worker_pod_through_the_headless_service() -> None:
    sts = _one("StatefulSet", "skiff-worker")
    svc = _one("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"  # headless: one DNS record per pod
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    port = _ports(sts)["zmq"]
    assert _bind_port(_env(sts)["SKIFF_BIND"]) == port
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["zmq"]
    pods = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    expected = [f"tcp://{pod}.{svc['metadata']['name']}:{port}" for pod in pods]
    gateway = _one("Deployment", "skiff-gateway")
    assert _env(gateway)["SKIFF_GATEWAY_WORKERS"].split(",") == expected


def test_gateway_reaches_the_speech_service() -> None:
    speech = _one("Deployment", "skiff-speech")
    svc = _one("Service", "skiff-speech")
    port = _ports(speech)["zmq"]
    assert _bind_port(_env(speech)["SKIFF_SPEECH_BIND"]) == port
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] == "zmq"
    gateway = _one("Deployment", "skiff-gateway")
    assert _env(gateway)["SKIFF_GATEWAY_SPEECH"] == f"tcp://skiff-speech:{svc_port['port']}"


def test_gateway_service_exposes_zeromq_and_http() -> None:
    gateway = _one("Deployment", "skiff-gateway")
    env, ports = _env(gateway), _ports(gateway)
    assert _bind_port(env["SKIFF_GATEWAY_BIND"]) == ports["zmq"]
    assert env["SKIFF_GATEWAY_HTTP"] == f"0.0.0.0:{ports['http']}"
    svc = _one("Service", "skiff-gateway")
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {
        "zmq": "zmq",
        "http": "http",
    }


def test_probes_ping_the_port_each_process_binds() -> None:
    for kind, name, bind_var in (
        ("StatefulSet", "skiff-worker", "SKIFF_BIND"),
        ("Deployment", "skiff-speech", "SKIFF_SPEECH_BIND"),
    ):
        workload = _one(kind, name)
        port = _bind_port(_env(workload)[bind_var])
        container = _container(workload)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert _ping_port(container[probe]) == port, (name, probe)
            # The probe's own client timeout fits inside the kubelet's.
            code = shlex.join(container[probe]["exec"]["command"])
            assert "timeout_ms=2000" in code and container[probe]["timeoutSeconds"] >= 3


def test_gateway_probes_health_over_http() -> None:
    container = _container(_one("Deployment", "skiff-gateway"))
    ready = container["readinessProbe"]["httpGet"]
    assert ready == {"path": "/health", "port": "http"}
    # Liveness must not restart the gateway because every worker is down.
    assert "httpGet" not in container["livenessProbe"]
    assert container["livenessProbe"]["tcpSocket"]["port"] == "http"


def test_every_pod_is_scraped_on_the_metrics_port() -> None:
    assert _config()["SKIFF_METRICS_PORT"] == str(METRICS_PORT)
    workloads = [d for _, d in _docs() if d["kind"] in ("Deployment", "StatefulSet")]
    assert len(workloads) == 3
    for workload in workloads:
        notes = workload["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert notes["prometheus.io/path"] == "/metrics"
        assert int(notes["prometheus.io/port"]) == _ports(workload)["metrics"]
        assert int(_env(workload)["SKIFF_METRICS_PORT"]) == _ports(workload)["metrics"]


def test_every_container_has_requests_and_limits() -> None:
    for _, doc in _docs():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            resources = container["resources"]
            for key in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[key]), (container["name"], key)


def test_services_select_pods_by_named_ports() -> None:
    workloads = [d for _, d in _docs() if d["kind"] in ("Deployment", "StatefulSet")]
    for _, svc in _docs():
        if svc["kind"] != "Service":
            continue
        selector = svc["spec"]["selector"].items()
        matches = [
            w for w in workloads if selector <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matches) == 1, svc["metadata"]["name"]
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in _ports(matches[0]), (svc["metadata"]["name"], port)


def test_model_volume_is_filled_before_the_worker_reads_it() -> None:
    sts = _one("StatefulSet", "skiff-worker")
    pod = sts["spec"]["template"]["spec"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (init,) = pod["initContainers"]
    init_env = {e["name"]: e["value"] for e in init["env"]}
    (init_mount,) = init["volumeMounts"]
    assert init_mount["name"] == claim["metadata"]["name"]
    assert init_env["SKIFF_CACHE_DIR"] == init_mount["mountPath"]
    assert "default_model_path" in init["command"][-1]
    (mount,) = _container(sts)["volumeMounts"]
    assert mount["name"] == claim["metadata"]["name"] and mount["readOnly"] is True
    # default_model_path() writes $SKIFF_CACHE_DIR/models/<name>; the worker loads it.
    model = _env(sts)["SKIFF_MODEL"]
    assert model.startswith(f"{mount['mountPath']}/models/") and model.endswith(".gguf")
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]


def test_one_image_everywhere_and_non_root() -> None:
    images = set()
    for _, doc in _docs():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod.get("initContainers", []) + pod["containers"]:
            images.add(container["image"])
    assert len(images) == 1, images


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("StatefulSet", "skiff-worker"),
        ("Deployment", "skiff-gateway"),
        ("Deployment", "skiff-speech"),
    ],
)
def test_termination_grace_covers_the_drain(kind: str, name: str) -> None:
    """SIGTERM drains for SKIFF_DRAIN_TIMEOUT_S (30 s unless set) plus 5 s to
    send the cancellations; the kubelet must not SIGKILL before."""
    workload = _one(kind, name)
    drain = float(_env(workload).get("SKIFF_DRAIN_TIMEOUT_S", WorkerConfig().drain_timeout_s))
    assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 5
