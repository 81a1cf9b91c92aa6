"""CURVE keys, flags and warnings without a model: the head of a chain dials
the last stage with the key that stage reports (toy CURVE servers stand in
for the stages), ``skiff-keys``, the startup checks of the CURVE flags, the
warnings of a plain exposed bind, and which endpoints are loopback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from _curve_procs import Keys, _tcp

from conftest import ROOT, WAIT_S, wait_until
from protocol.keys import main as keys_main
from protocol.sockets import Curve, CurveKeyError, is_loopback


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"))


# -- pipeline stages: the head's direct return ------------------------------------------


class _Toy:
    """A service answering ``ping`` and a fixed ``info``."""

    def __init__(self, info: dict[str, object]) -> None:
        self.handlers = {"ping": lambda r: {"pong": True}, "info": lambda r: info}
        self.drain_ops: frozenset[str] = frozenset()

    def has_work(self) -> bool:
        return False

    def turn(self) -> list[object]:
        return []

    def peer_lost(self, peer: bytes, reason: str) -> int:
        return 0

    def housekeeping(self, now: float) -> None:
        return None


def test_head_dials_the_last_stage_with_the_key_it_reports(keys: Keys) -> None:
    """The direct-return socket (3+ stages) uses the last stage's own public
    key from the chain info: toy CURVE servers stand in for the stages."""
    import zmq

    from edge import EdgeConfig, EdgeServer
    from faults import StageUnavailable
    from protocol.sockets import SocketOptions
    from worker.chain.link import StageLink

    def serve(name: str, info: dict[str, object]) -> tuple[EdgeServer, threading.Thread]:
        cfg = EdgeConfig(
            bind=_tcp(),
            socket=SocketOptions(curve=Curve.load(keys.secret(name))),
            authorized=str(keys.authorized),
            idle_poll_ms=20,
        )
        server = EdgeServer(cfg, _Toy(info), zmq.Context())  # type: ignore[arg-type]
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        return server, thread

    last, last_thread = serve("gateway", {})  # any pair but the next stage's
    last_key = Curve.load(keys.secret("gateway")).public_key.decode()
    servers = [(last, last_thread)]
    try:
        for reported, ok in ((last_key, True), (None, False)):
            chain = [{"next": last.endpoint}, {"curve_key": reported} if reported else {}]
            nxt, thread = serve("server", {"chain": chain})
            servers.append((nxt, thread))
            link = StageLink(nxt.endpoint, head=True, curve=keys.curve("client"))
            try:

                def set_up(link: StageLink = link) -> bool:
                    """True once the direct return is up; False while the link
                    cannot send yet (connected is not enough, its CURVE
                    handshake must be done too) or the set-up, which never
                    waits, is under way: the chain asked, the last stage pinged."""
                    link.poll(20)  # takes in the chain's answer
                    try:
                        link._direct_socket()
                    except StageUnavailable as exc:
                        if "is not connected" in exc.message:
                            return False
                        raise
                    return link.direct_endpoint is not None

                if ok:
                    wait_until(set_up, what="the direct-return socket set up")
                    assert link.direct_endpoint == last.endpoint
                else:
                    with pytest.raises(StageUnavailable, match="CURVE key"):
                        wait_until(set_up, what="the last stage's key refused")
            finally:
                link.close()
    finally:
        for server, thread in servers:
            server.stop()
            thread.join(WAIT_S)
            server.close()


# -- keys, flags and warnings (no model) -------------------------------------------------


def test_skiff_keys_writes_a_private_pair_and_never_overwrites(tmp_path: Path) -> None:
    assert keys_main([str(tmp_path / "k"), "alice"]) == 0
    public, secret = tmp_path / "k" / "alice.key", tmp_path / "k" / "alice.key_secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert public.stat().st_mode & 0o777 == 0o644
    before = secret.read_bytes()
    assert keys_main([str(tmp_path / "k"), "alice"]) == 1
    assert secret.read_bytes() == before
    assert keys_main([str(tmp_path / "k"), "../evil"]) == 1
    pair = Curve.load(secret, public)
    assert pair.server_key == pair.public_key and len(pair.secret_key) == 40
    assert "secret_key" not in repr(pair)
    with pytest.raises(CurveKeyError, match="key_secret"):
        Curve.load(public)  # a public certificate is not a key pair


def test_curve_flags_are_checked_at_startup(keys: Keys, tmp_path: Path) -> None:
    from gateway.cli import serve as gateway_serve
    from worker.config import parse

    secret, allowed = keys.secret("server"), str(keys.authorized)
    cases: list[tuple[list[str], str]] = [
        (["--curve-secret-key", secret], "go together"),
        (["--curve-authorized", allowed], "go together"),
        (["--curve-server-key", keys.public("server")], "needs --curve-secret-key"),
        (["--curve-secret-key", secret, "--curve-authorized", str(tmp_path / "no")], "directory"),
        (["--curve-secret-key", keys.public("server"), "--curve-authorized", allowed], "secret"),
    ]
    stage = ["--curve-secret-key", secret, "--curve-authorized", allowed, "--layers", "0:9"]
    cases.append(([*stage, "--next", "tcp://127.0.0.1:1"], "--curve-server-key"))
    for argv, why in cases:
        with pytest.raises(SystemExit, match=why):
            parse(argv)
    assert parse(["--curve-secret-key", secret, "--curve-authorized", allowed]).curve_authorized
    with pytest.raises(SystemExit, match="--curve-server-key"):  # a gateway always dials
        gateway_serve(["--worker", "tcp://127.0.0.1:1", *stage[:4]])


_WARNINGS = """
import sys, tempfile, zmq
from edge import EdgeConfig, EdgeServer, logs
from protocol.sockets import Curve, SocketOptions
logs.configure("json", "info")
class Toy:
    handlers = {}
    def has_work(self): return False
ctx = zmq.Context()
EdgeServer(EdgeConfig(bind="tcp://0.0.0.0:0"), Toy(), ctx).close()
EdgeServer(EdgeConfig(bind="tcp://127.0.0.1:0"), Toy(), ctx).close()
EdgeServer(EdgeConfig(bind="ipc://" + tempfile.mktemp()), Toy(), ctx).close()
curve = Curve.load(sys.argv[1])
opts = SocketOptions(curve=curve)
cfg = EdgeConfig(bind="tcp://0.0.0.0:0", socket=opts, authorized=sys.argv[2])
server = EdgeServer(cfg, Toy(), ctx)
try:
    EdgeServer(EdgeConfig(bind="tcp://127.0.0.1:0", socket=opts), Toy(), ctx)
except ValueError as exc:
    print("refused:", exc)
"""


def test_plain_exposed_bind_warns_and_curve_without_a_list_is_refused(
    keys: Keys, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", _WARNINGS, keys.secret("server"), str(empty)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    logged = (out.stdout + out.stderr).splitlines()
    events = [json.loads(line) for line in logged if line.startswith("{")]
    exposed = [e for e in events if e["event"] == "curve_off_non_loopback"]
    assert [e["endpoint"] for e in exposed] == ["tcp://0.0.0.0:0"]  # not 127.0.0.1, not ipc
    assert [e["level"] for e in events if e["event"] == "curve_no_authorized_keys"] == ["warning"]
    assert "refused: a CURVE server needs an allow-list" in out.stdout


def test_loopback_endpoints() -> None:
    local = ["tcp://127.0.0.1:5555", "tcp://127.1.2.3:1", "tcp://[::1]:5", "tcp://localhost:5"]
    local += ["ipc:///tmp/x.sock", "inproc://x"]
    exposed = ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.5:1", "tcp://eth0:1"]
    exposed += ["tcp://[::]:5", "tcp://example.com:5", "udp://127.0.0.1:5"]
    assert all(is_loopback(e) for e in local)
    assert not any(is_loopback(e) for e in exposed)
