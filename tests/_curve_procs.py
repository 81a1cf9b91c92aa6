"""What the CURVE tests share (test_curve_workers, test_curve_keys): a key
directory (``server``, ``gateway``, ``client`` and ``stranger`` pairs and an
allow-list holding ``client`` and ``gateway``), skiff processes on loopback
TCP, and the check that a client gets no reply at all.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, WAIT_S, stop_worker
from protocol import Client, SkiffError
from protocol.keys import create
from protocol.sockets import Curve

DENIED_WAIT_MS = 1000  # a reply would come in a few ms; nothing comes at all
WAIT_MS = int(WAIT_S * 1000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tcp() -> str:
    return f"tcp://127.0.0.1:{_free_port()}"


class Keys:
    """The module's key pairs and allow-list."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for name in ("server", "gateway", "client", "stranger"):
            create(root, name)
        self.authorized = root / "authorized"
        self.authorized.mkdir()
        for name in ("client", "gateway"):
            shutil.copy(root / f"{name}.key", self.authorized)

    def secret(self, name: str) -> str:
        return str(self.root / f"{name}.key_secret")

    def public(self, name: str) -> str:
        return str(self.root / f"{name}.key")

    def curve(self, name: str, server: str = "server") -> Curve:
        """``name``'s pair dialling ``server``."""
        return Curve.load(self.secret(name), self.public(server))

    def server_flags(self, name: str = "server", authorized: Path | None = None) -> list[str]:
        allowed = authorized or self.authorized
        return ["--curve-secret-key", self.secret(name), "--curve-authorized", str(allowed)]


class Proc:
    """A skiff process started with ``python -m MODULE``, its log in tmp."""

    def __init__(self, tmp: Path, name: str, module: str, endpoint: str, *args: str) -> None:
        self.name, self.endpoint = name, endpoint
        self.log_path = tmp / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, "--bind", endpoint, *args],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait(self, curve: Curve | None, timeout_s: float = 90.0) -> Proc:
        with Client(self.endpoint, curve=curve) as c:
            try:
                c.wait_ready(timeout_s, alive=lambda: self.proc.poll() is None)
            except SkiffError:
                self.proc.kill()
                raise RuntimeError(f"{self.name} did not start:\n{self.log()}") from None
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_worker(self.proc)


def _denied(endpoint: str, curve: Curve | None, session: str | None = None) -> None:
    """A client that must get no reply at all (not even an error): to
    ``ping``, and with ``session`` to a ``prefill`` that would open it."""
    with Client(endpoint, timeout_ms=DENIED_WAIT_MS, curve=curve) as c:
        calls = [("ping", None)] + ([("prefill", {"tokens": [2, 3, 4]})] if session else [])
        for op, args in calls:
            with pytest.raises(SkiffError) as err:
                c.call(op, session if args else None, args)
            assert err.value.code == "timeout"
