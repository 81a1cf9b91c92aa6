#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris / libFuzzer) of the decode + validate path, in process.

    .venv/bin/python scripts/fuzz_atheris.py -runs=20000 -max_total_time=60 [CORPUS_DIR ...]

Each input is one request as the edge receives it: bytes -> ``transport.decode``
(size and depth caps) -> the envelope checks -> the op's handler from the
worker's real op table (``worker.api.ops.OPS``,
``forward_frame`` included) or the speech worker's, over a fake model
(vocabulary size, embedding width, lanes: no llama_decode runs; grammars are
parsed by llama.cpp's real parser) -> tensor frames parsed -> outputs written
during the handler (``echo``) rendered as the worker would send them. It runs
``EdgeServer._handle`` itself, so the envelope logic is the edge's, not a copy.

A crash is any exception escaping the edge, any reply that cannot be encoded,
any error code outside ``faults.ErrorCode``, and any ``internal`` reply (the
edge turns unexpected exceptions into ``internal``: for input alone that is
a bug). libFuzzer then saves the input as ``crash-*`` and exits non-zero.

An input's first byte picks the mode: raw (the rest is the header, as sent),
or structured (an op from the tables, a session or none, buffers, and the
rest decoded as the ``args`` map when it is msgpack), so the fuzzer reaches
the validators without first having to discover msgpack. ``--seed-corpus
DIR`` writes starting inputs made by ``scripts/fuzzcases.py``.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import structlog
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

N_VOCAB, N_EMBD, LANES, CTX = 262_144, 640, 4, 4096
MAX_BUFFERS = 3
_harnesses = itertools.count()


class FakeEngine:
    """What handlers and chat templates use of the engine; no model behind it."""

    n_vocab, n_embd, bos, eos = N_VOCAB, N_EMBD, 2, 1

    def metadata(self, key: str) -> str | None:
        return None

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        ids = [3 + b for b in text.encode("utf-8", "surrogatepass")[:8192]]
        return [self.bos, *ids] if add_special else ids

    def detokenize(self, tokens: list[int]) -> str:
        return "".join(chr(32 + t % 90) for t in tokens)

    def is_eog(self, token: int) -> bool:
        return token == self.eos


class _Lanes:
    n_lanes, free = LANES, LANES
    sessions: dict[str, Any] = {}

    def get(self, session: object) -> None:
        return None

    def missing(self, sessions: object) -> list[Any]:
        return []


class _Runtime:
    ctx_per_lane = CTX // LANES
    lanes = _Lanes()
    n_layer = 18
    tail = None  # a whole-model worker, not a pipeline stage
    park = None

    def known(self, session: object) -> None:
        return None

    def was_evicted(self, session: object) -> bool:
        return False

    def not_active(self, session: object) -> Exception:
        from faults import SessionNotActive

        return SessionNotActive(f"session {session!r} is not active")


class _Scheduler:
    def knows_session(self, session: object) -> bool:
        return False

    def cancel(self, peer: object, target: object) -> bool:
        return False

    def suspend(self, peer: object, target: object) -> bool:
        return False


class FakeApp:
    """The ``handlers.App`` protocol over a fake engine; submitted jobs are dropped."""

    def __init__(self) -> None:
        from worker.config import WorkerConfig
        from worker.core.chat import ChatTemplate
        from worker.core.jobs.base import Outbox
        from worker.engine import LlamaGrammars

        self.cfg = WorkerConfig(lanes=LANES, ctx=CTX)
        self.engine = FakeEngine()
        self.n_vocab = N_VOCAB
        self.grammars = LlamaGrammars()  # llama.cpp's GBNF parser: no model needed
        self.rt = _Runtime()
        self.sched = _Scheduler()
        self.chat = ChatTemplate.load("", self.engine)
        self.draft = None
        self.projector = None  # no --mmproj: media ops answer unsupported
        self.chunk = 128
        self.draining = False
        self.speculate_streams: int | None = 2  # the worker's default --speculate auto
        self.span_rows = 33
        try:
            from worker.limits import Limits

            self.limits = Limits().resolved(self.rt.ctx_per_lane)
        except ImportError:  # a tree without configurable limits
            pass
        try:
            from worker.api.validate import Context

            self.context = Context(self.limits, self.n_vocab, self.grammars, self.rt.ctx_per_lane)
            most = self.limits.max_request_tokens
            self.prompt_limit = most if most < self.rt.ctx_per_lane else 0
        except ImportError:  # a tree that reads requests field by field
            pass
        self.outbox = Outbox()
        self.jobs = 0

    def ticket(self, req: Any) -> Any:
        from worker.core.jobs.base import Ticket

        return Ticket(owner=req.peer, id=req.id, op=req.op, outbox=self.outbox)

    def submit(self, job: Any) -> None:
        self.jobs += 1

    def info(self) -> dict[str, Any]:
        return {"pong": True}

    stats = info

    def handoff(self, done: bool) -> list[str]:
        return []


class FakeVoice:
    name, sample_rate = "joe", 22050

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "sample_rate": self.sample_rate, "language": "en"}


class FakeSpeech:
    """What ``SpeechService`` validation reads of its engine."""

    voices = {"joe": FakeVoice()}
    default_voice = "joe"

    def voice(self, name: str | None) -> FakeVoice:
        return self.voices["joe"]


class _Service:
    """The edge's ``Service``, reduced to the op table (turns never run here)."""

    def __init__(self, handlers: Mapping[str, Callable[..., Any]]) -> None:
        self.handlers = handlers
        self.drain_ops: frozenset[str] = frozenset()


class Harness:
    """One request through the real edge path; ``check`` raises on a finding."""

    def __init__(self, quiet: bool = False) -> None:
        from edge import EdgeConfig, EdgeServer
        from worker.api.ops import OPS

        tables: dict[str, Any] = dict(OPS)

        if quiet:  # the edge logs every refusal; libFuzzer's output is what matters here
            structlog.configure(logger_factory=lambda *a: structlog.ReturnLogger())
        self.app = FakeApp()
        table = {op: functools.partial(fn, self.app) for op, fn in tables.items()}
        self.services: list[tuple[Any, list[str]]] = []
        ctx: zmq.Context[Any] = zmq.Context.instance()
        name = f"fuzz-{os.getpid()}-{next(_harnesses)}"
        llm = EdgeServer(EdgeConfig(bind=f"inproc://{name}-llm"), _Service(table), ctx)  # type: ignore[arg-type]
        self.services.append((llm, sorted(table)))
        try:
            from speech.server import SpeechService

            speech = SpeechService(FakeSpeech())  # type: ignore[arg-type]
            cap = speech.max_header_bytes
            edge_cfg = EdgeConfig(bind=f"inproc://{name}-speech", max_header_bytes=cap)
            edge = EdgeServer(edge_cfg, speech, ctx)
            self.services.append((edge, sorted(speech.handlers)))
            self.speech: Any = speech
        except ImportError:  # no piper: the LLM worker alone
            self.speech = None
        self.replies: list[Any] = []
        for edge, _ in self.services:
            edge.deliver = self.replies.extend
        from faults import ErrorCode

        self.codes = {c.value for c in ErrorCode}
        self.runs = 0

    def request(self, data: bytes) -> tuple[int, list[bytes]]:
        """(service index, frames) for one fuzz input (see the module doc)."""
        if len(data) < 2 or data[0] < 64:
            return (data[0] % len(self.services) if data else 0), [data[1:]]
        mode, data = data[0], data[1:]
        index = mode % len(self.services)
        ops = self.services[index][1]
        op = ops[data[0] % len(ops)]
        n_buffers = (mode >> 2) % (MAX_BUFFERS + 1)
        buffers, rest = [], data[1:]
        for _ in range(n_buffers):
            size = rest[0] * 4 if rest else 0
            buffers.append(bytes(rest[1 : 1 + size]))
            rest = rest[1 + size :]
        try:
            args = msgpack.unpackb(rest, raw=False, strict_map_key=False)
        except Exception:
            args = {"text": rest.decode("utf-8", "replace")}
        header = {"v": 1, "id": 7, "op": op, "args": args}
        if mode & 0x40 and mode & 0x2:
            header["session"] = "s" + str(mode)
        return index, [msgpack.packb(header, use_bin_type=True), *buffers]

    def check(self, data: bytes) -> None:
        """One fuzz input (libFuzzer's entry point)."""
        self.check_message(*self.request(data))

    def check_message(self, index: int, frames: list[bytes]) -> None:
        """One message ``[header, *buffers]`` to service ``index`` (0: the LLM worker)."""
        self.runs += 1
        edge = self.services[index][0]
        self.replies.clear()
        edge._handle(b"\x00peer", [zmq.Frame(f) for f in frames])  # raises only on an edge bug
        outputs = self.app.outbox.take()
        if outputs:  # echo answers during its handler: render as the worker does
            from worker import service

            render = getattr(service, "render_or_fail", service.render)
            self.replies.extend(render(t, o) for t, o in outputs)
        if self.speech is not None:
            self.speech.queue.clear()
            self.speech.jobs.clear()
        for out in self.replies:
            msgpack.packb(out.header, use_bin_type=True)  # every reply must encode
            error = out.header.get("error")
            if out.header.get("ok") is False:
                code = error.get("code") if isinstance(error, dict) else None
                if code not in self.codes or code == "internal":
                    raise AssertionError(f"{code}: {error} for {frames[0][:200]!r}")


def seed_corpus(directory: Path, count: int = 300) -> None:
    """Starting inputs: raw-mode copies of what ``scripts/fuzz.py`` sends."""
    from _fuzz_draws import Target
    from fuzzcases import Generator

    directory.mkdir(parents=True, exist_ok=True)
    ops = (
        "ping",
        "tokenize",
        "detokenize",
        "prefill",
        "decode",
        "decode_batch",
        "iteration_batch",
        "generate",
        "chat",
        "verify",
        "trim",
        "signal_window",
        "cancel",
        "embed",
        "echo",
        "import_state",
        "forward_frame",
    )
    target = Target("worker", ops, 4 << 20, N_VOCAB, N_EMBD, CTX // LANES, LANES)
    gen = Generator(target, 0)
    for i in range(count):
        raw = gen.case(i).messages[0].frames[0]
        if len(raw) < 4096:
            (directory / f"seed-{i}").write_bytes(b"\x00" + raw)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--seed-corpus":
        seed_corpus(Path(sys.argv[2]))
        return
    import atheris

    with atheris.instrument_imports(include=["protocol", "edge", "worker", "faults"]):
        harness = Harness(quiet=True)
    atheris.Setup(sys.argv, harness.check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
