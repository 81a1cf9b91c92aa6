"""Clients for skiff workers: ``Client`` (blocking) here, ``AsyncClient``
(asyncio) in ``protocol/async_client.py``.

Both speak over one DEALER socket and may have many requests in flight:
replies are matched to requests by id, so a gateway can stream a generation
and send ``cancel`` on the same connection. The per-op methods live in
``_Ops`` and are shared; each client only supplies ``_invoke``.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import zmq
import zmq.asyncio

from . import frames, sockets, transport
from .reply import (
    Extract,
    Reply,
    SkiffError,
    client_options,
    parse_reply,
    request_frames,
    result_of,
)


class _Ops:
    """One method per op. ``_invoke`` returns the value (sync) or an awaitable."""

    def _invoke(
        self,
        op: str,
        session: str | None,
        args: dict[str, Any] | None,
        extract: Extract,
        buffers: Sequence[Any] = (),
    ) -> Any:
        raise NotImplementedError

    def ping(self) -> Any:
        return self._invoke("ping", None, None, result_of)

    def info(self) -> Any:
        return self._invoke("info", None, None, result_of)

    def stats(self) -> Any:
        return self._invoke("stats", None, None, result_of)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> Any:
        args = {"text": text, "add_special": add_special, "parse_special": parse_special}
        return self._invoke("tokenize", None, args, lambda r: r.result["tokens"])

    def detokenize(self, tokens: Sequence[int]) -> Any:
        return self._invoke(
            "detokenize", None, {"tokens": list(tokens)}, lambda r: r.result["text"]
        )

    def prefill(
        self, session: str, tokens: Sequence[int], output: Sequence[str] | None = None
    ) -> Any:
        """The new position; with ``output``, the whole ``Reply`` (its ``frame``)."""
        args: dict[str, Any] = {"tokens": list(tokens)}
        if output:
            args["output"] = list(output)
            return self._invoke("prefill", session, args, _keep_reply)
        return self._invoke("prefill", session, args, lambda r: r.result["position"])

    def prefill_embd(
        self,
        session: str,
        embd: Any,
        positions: Sequence[int] | None = None,
        output: Sequence[str] | None = None,
    ) -> Any:
        """Prefill input embeddings ``[tokens, n_embd]`` f32 instead of tokens."""
        frame = frames.make_frame([("embd", embd, 0)], positions=positions)
        buffers: list[Any] = []
        args: dict[str, Any] = {"input": frames.attach(frame, buffers)}
        if output:
            args["output"] = list(output)
        return self._invoke("prefill", session, args, _keep_reply, buffers)

    def embed(
        self, text: str | None = None, tokens: Sequence[int] | None = None, pooling: str = "mean"
    ) -> Any:
        """The final hidden states of a prompt (``Reply``; ``reply.frame``)."""
        args: dict[str, Any] = {"pooling": pooling}
        if text is not None:
            args["text"] = text
        if tokens is not None:
            args["tokens"] = list(tokens)
        return self._invoke("embed", None, args, _keep_reply)

    def export_state(self, session: str) -> Any:
        """``Reply`` with ``result["session_state"]`` and a ``kv_state`` frame."""
        return self._invoke("export_state", session, None, _keep_reply)

    def import_state(self, session: str, exported: Reply) -> Any:
        """Load what ``export_state`` returned (on any worker of the same model)."""
        args = {
            "session_state": exported.result["session_state"],
            "frame": exported.result["frame"],
        }
        return self._invoke(
            "import_state", session, args, lambda r: r.result["position"], exported.buffers
        )

    def echo(self, frame: frames.Frame) -> Any:
        """Send a frame and get it back (``Reply``): a check of the frame path."""
        buffers: list[Any] = []
        args = {"frame": frames.attach(frame, buffers)}
        return self._invoke("echo", None, args, _keep_reply, buffers)

    def prefill_sampled(
        self, session: str, tokens: Sequence[int], sampling: dict[str, Any] | None = None
    ) -> Any:
        args: dict[str, Any] = {"tokens": list(tokens)}
        if sampling is not None:
            args["sampling"] = sampling
        return self._invoke("prefill_sampled", session, args, result_of)

    def prefill_media(
        self,
        session: str,
        prompt: str,
        media: Sequence[Any],
        sampling: dict[str, Any] | None = None,
        output: Sequence[str] | None = None,
        **args: Any,
    ) -> Any:
        """A prompt with one marker (``info.media.marker``) per item of
        ``media``: encoded PNG / JPEG bytes each, sent as buffers. The result
        map; with ``output`` the ``Reply`` (its ``frame``)."""
        items = [{"buffer": i} for i in range(len(media))]
        args = {**args, "prompt": prompt, "media": items}
        if sampling is not None:
            args["sampling"] = sampling
        if output:
            args["output"] = list(output)
        extract = _keep_reply if output else result_of
        return self._invoke("prefill_media", session, args, extract, list(media))

    def decode(
        self,
        session: str,
        token: int,
        sampling: dict[str, Any] | None = None,
        return_logits: bool = False,
        output: Sequence[str] | None = None,
    ) -> Any:
        """The result map; with ``return_logits`` or ``output`` the ``Reply``."""
        args: dict[str, Any] = {"token": token}
        if sampling is not None:
            args["sampling"] = sampling
        wanted = list(output) if output else (["logits"] if return_logits else [])
        if wanted:
            args["output"] = wanted
        return self._invoke("decode", session, args, _keep_reply if wanted else result_of)

    def decode_batch(
        self,
        requests: Sequence[dict[str, Any]],
        return_logits: bool = False,
        output: Sequence[str] | None = None,
    ) -> Any:
        args: dict[str, Any] = {"requests": list(requests)}
        wanted = list(output) if output else (["logits"] if return_logits else [])
        if wanted:
            args["output"] = wanted
        extract = _keep_reply if wanted else (lambda r: r.result["tokens"])
        return self._invoke("decode_batch", None, args, extract)

    def iteration_batch(self, requests: Sequence[dict[str, Any]]) -> Any:
        args = {"requests": list(requests)}
        return self._invoke("iteration_batch", None, args, lambda r: r.result["samples"])

    def trim(self, session: str, token_count: int) -> Any:
        args = {"token_count": token_count}
        return self._invoke("trim", session, args, lambda r: r.result["position"])

    def align(self, session: str, token_count: int) -> Any:
        return self._invoke("align", session, {"token_count": token_count}, result_of)

    def drop(self, session: str) -> Any:
        return self._invoke("drop", session, None, result_of)

    def cancel(self, request_id: int) -> Any:
        return self._invoke("cancel", None, {"id": request_id}, lambda r: r.result["cancelled"])

    def chat(
        self, messages: Sequence[dict[str, Any]], session: str | None = None, **args: Any
    ) -> Any:
        """One chat turn, not streamed: ``{"text", "tokens", "finish_reason", ...}``."""
        args = {**args, "messages": list(messages), "stream": False}
        return self._invoke("chat", session, args, result_of)


def _keep_reply(reply: Reply) -> Reply:
    return reply


class Client(_Ops):
    """Blocking client. Not thread-safe: use one per thread.

    ``curve`` (own key pair and the server's public key) makes the
    connection CURVE-encrypted; a server that does not know the key, or a
    CURVE server dialled without one, never answers (calls time out)."""

    def __init__(
        self,
        endpoint: str,
        timeout_ms: int = 120_000,
        context: zmq.Context[Any] | None = None,
        options: sockets.SocketOptions | None = None,
        curve: sockets.Curve | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket[Any] = sockets.dealer(
            self._ctx, endpoint, client_options(options, curve)
        )
        self.timeout_ms = timeout_ms
        self._ids = itertools.count(1)
        self._stash: dict[int, deque[Reply]] = {}

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(
        self,
        op: str,
        session: str | None = None,
        args: dict[str, Any] | None = None,
        buffers: Sequence[Any] = (),
        deadline_ms: int | None = None,
    ) -> int:
        """Send a request without waiting for its reply; returns its id.

        Waits at most ``timeout_ms`` for room to send: a DEALER has nowhere
        to queue once its connection is gone for good, as when a CURVE
        server refused the handshake (libzmq does not retry that), and a
        plain send would then block forever."""
        req_id = next(self._ids)
        frames = request_frames(transport.request(req_id, op, session, args, deadline_ms), buffers)
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if not self._sock.poll(self.timeout_ms, zmq.POLLOUT):
                raise SkiffError("timeout", f"could not send within {self.timeout_ms} ms") from None
            self._sock.send_multipart(frames, copy=False)
        return req_id

    def wait_ready(self, timeout_s: float = 60.0, alive: Callable[[], bool] | None = None) -> None:
        """Ping until the worker answers (it may still be loading its model).

        Raises ``SkiffError("timeout")`` after ``timeout_s``, or at once when
        ``alive()`` says the worker process has exited.
        """
        deadline = time.monotonic() + timeout_s
        saved, self.timeout_ms = self.timeout_ms, 500
        try:
            while True:
                try:
                    self.ping()
                    return
                except SkiffError:
                    if (alive is not None and not alive()) or time.monotonic() > deadline:
                        raise SkiffError("timeout", "worker did not answer ping") from None
        finally:
            self.timeout_ms = saved

    def send_raw(self, frames: Sequence[Any]) -> None:
        """Send frames exactly as given (tests use this for malformed input)."""
        self._sock.send_multipart(list(frames))

    def recv_any(self, timeout_ms: int | None = None) -> Reply:
        """Receive the next reply whatever its id."""
        wait = self.timeout_ms if timeout_ms is None else timeout_ms
        if not self._sock.poll(wait):
            raise SkiffError("timeout", f"no reply within {wait} ms")
        return parse_reply(self._sock.recv_multipart(copy=False))

    def recv(self, req_id: int, timeout_ms: int | None = None) -> Reply:
        """Receive the next reply for ``req_id``, stashing others."""
        queued = self._stash.get(req_id)
        if queued:
            return queued.popleft()
        deadline = time.monotonic() + (self.timeout_ms if timeout_ms is None else timeout_ms) / 1e3
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            reply = self.recv_any(left)
            rid = reply.header.get("id")
            if rid == req_id:
                return reply
            if isinstance(rid, int):
                self._stash.setdefault(rid, deque()).append(reply)

    def call(
        self,
        op: str,
        session: str | None = None,
        args: dict[str, Any] | None = None,
        buffers: Sequence[Any] = (),
        deadline_ms: int | None = None,
    ) -> Reply:
        """Send one request and wait for its (first) reply; raise on error."""
        req_id = self.send(op, session, args, buffers, deadline_ms)
        return self.recv(req_id).raise_for_error()

    def stream(
        self,
        op: str,
        session: str | None = None,
        args: dict[str, Any] | None = None,
        deadline_ms: int | None = None,
        buffers: Sequence[Any] = (),
    ) -> Iterator[Reply]:
        """Yield every reply of a streaming request until the one with ``done``."""
        req_id = self.send(op, session, args, buffers, deadline_ms)
        yield from self.follow(req_id)

    def follow(self, req_id: int) -> Iterator[Reply]:
        """Yield replies of an already-sent streaming request until done."""
        while True:
            reply = self.recv(req_id).raise_for_error()
            yield reply
            if reply.done:
                return

    def generate(self, args: dict[str, Any], session: str | None = None) -> Iterator[Reply]:
        """Stream a generation: token events, then the final ``done`` event."""
        yield from self.stream("generate", session, {**args, "stream": True})

    def _invoke(
        self,
        op: str,
        session: str | None,
        args: dict[str, Any] | None,
        extract: Extract,
        buffers: Sequence[Any] = (),
    ) -> Any:
        return extract(self.call(op, session, args, buffers))

    def migrate(self, session: str, to: Client) -> int:
        """Move a session to the worker behind ``to``: export here, import
        there, drop here. Returns its position on the destination. The
        state's buffers pass through this process without a copy; on a
        failed import the session stays here untouched."""
        reply = self.export_state(session)
        position = int(to.import_state(session, reply))
        self.drop(session)
        return position
