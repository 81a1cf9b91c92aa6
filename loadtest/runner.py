"""Driving ``generate`` streams at workers: closed loop or open (Poisson) loop.

Closed loop: ``concurrency`` virtual users, each sending its next request as
soon as the previous one finished. Open loop: requests arrive at Poisson
times of mean ``rate`` per second whatever is still in flight. Both stop by
themselves: after ``requests`` requests and/or once ``duration_s`` passed
(no new request starts after that; those in flight finish, each bounded by
``timeout_ms``). Requests go round-robin over the endpoints, one shared
``AsyncClient`` per ZeroMQ endpoint; an ``http://`` endpoint is an
OpenAI-compatible front (the gateway's ``--http``), driven with streamed
``/v1/completions`` through one shared aiohttp session (``loadtest.http``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm  # type: ignore[import-untyped]

from protocol import AsyncClient, SkiffError
from protocol.sockets import Curve

from .http import completion_body, one_http_request
from .prompts import Prompt, builtin_prompts
from .stats import RequestRecord, poisson_arrivals, summarize

# Grace added to the client-side guard on top of the worker's deadline_ms.
_CLIENT_SLACK_S = 5.0


@dataclass
class LoadConfig:
    endpoints: Sequence[str]
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # open loop, requests per second
    requests: int | None = None
    duration_s: float | None = None
    max_tokens: int = 128
    ignore_eos: bool = False
    timeout_ms: int = 60_000  # 0 = no deadline (the client still waits at most 120 s a reply)
    prompts: Sequence[Prompt] | None = None  # None = built-in set
    sampling: dict[str, Any] | None = None  # None = greedy
    seed: int = 0
    progress: bool = False
    stagger_s: float = 0.0  # closed loop: user u starts u * stagger_s after the first
    extra_args: dict[str, Any] = field(default_factory=dict)
    curve: Curve | None = field(default=None, repr=False)  # CURVE keys toward ZeroMQ endpoints

    def validate(self) -> None:
        if not self.endpoints:
            raise ValueError("at least one endpoint is needed")
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive")
        if self.requests is None and self.duration_s is None:
            raise ValueError("give requests and/or duration_s so the run is bounded")
        if self.requests is not None and self.requests < 0:
            raise ValueError("requests must not be negative")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be positive")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.timeout_ms < 0:
            raise ValueError("timeout_ms must not be negative")
        if self.prompts is not None and not self.prompts:
            raise ValueError("prompts must not be empty")

    def describe(self) -> dict[str, Any]:
        return {
            "mode": "closed" if self.concurrency is not None else "open",
            "endpoints": list(self.endpoints),
            "concurrency": self.concurrency,
            "rate": self.rate,
            "requests": self.requests,
            "duration_s": self.duration_s,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "timeout_ms": self.timeout_ms,
            "n_prompts": len(self.prompts) if self.prompts is not None else None,
            "seed": self.seed,
        }


def _request_args(cfg: LoadConfig, prompt: Prompt) -> dict[str, Any]:
    args: dict[str, Any] = {**cfg.extra_args, "max_tokens": cfg.max_tokens, "stream": True}
    if isinstance(prompt, str):
        args["prompt"] = prompt
    else:
        args["tokens"] = list(prompt)
    if cfg.ignore_eos:
        args["ignore_eos"] = True
    if cfg.sampling is not None:
        args["sampling"] = cfg.sampling
    return args


def _absorb_final(rec: RequestRecord, header: dict[str, Any]) -> None:
    """Usage, timings and finish reason of the final reply (stream or not)."""
    result = header.get("result")
    body = result if isinstance(result, dict) and "finish_reason" in result else header
    usage = body.get("usage") or {}
    if isinstance(usage.get("prompt_tokens"), int):
        rec.prompt_tokens = usage["prompt_tokens"]
    timings = body.get("timings") or {}
    rec.server_timings = {
        k: float(v) for k, v in timings.items() if isinstance(v, int | float) and v is not None
    }
    reason = body.get("finish_reason")
    rec.finish_reason = str(reason) if reason is not None else None
    if rec.finish_reason in ("error", "cancelled"):
        rec.error = rec.finish_reason


async def one_request(
    client: AsyncClient, cfg: LoadConfig, index: int, endpoint: str, prompt: Prompt, t0: float
) -> RequestRecord:
    """Send one streaming ``generate`` and record when each reply arrived."""
    rec = RequestRecord(index=index, endpoint=endpoint, t_send=time.perf_counter() - t0)
    args = _request_args(cfg, prompt)
    deadline = cfg.timeout_ms or None
    guard = None if deadline is None else deadline / 1e3 + _CLIENT_SLACK_S
    try:
        async with asyncio.timeout(guard):
            async for reply in client.stream("generate", None, args, deadline_ms=deadline):
                now = time.perf_counter() - t0
                header = reply.header
                if header.get("event") == "token":
                    if rec.t_first is None:
                        rec.t_first = now
                    rec.token_times.append(now)
                    rec.n_tokens += 1
                if reply.done:
                    _absorb_final(rec, header)
                    if "event" not in header and rec.n_tokens == 0:
                        # Non-streaming reply: every token arrived at once.
                        tokens = (header.get("result") or {}).get("tokens") or []
                        rec.n_tokens = len(tokens)
                        rec.t_first = now if tokens else None
                        rec.token_times = [now] * len(tokens)
    except SkiffError as exc:
        rec.error = exc.code
    except TimeoutError:
        rec.error = "timeout"
    except Exception:  # a client-side failure must not end the whole run
        rec.error = "client_error"
    rec.t_end = time.perf_counter() - t0
    return rec


async def run_load_async(cfg: LoadConfig) -> dict[str, Any]:
    """Run the load described by ``cfg``; return ``stats.summarize``'s dict."""
    cfg.validate()
    prompts: Sequence[Prompt] = cfg.prompts if cfg.prompts is not None else builtin_prompts()
    slack_ms = int(_CLIENT_SLACK_S * 1e3)
    timeout_ms = cfg.timeout_ms + slack_ms if cfg.timeout_ms else 120_000
    clients = [
        None if is_http(ep) else AsyncClient(ep, timeout_ms=timeout_ms, curve=cfg.curve)
        for ep in cfg.endpoints
    ]
    http = (
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )
        if any(c is None for c in clients)
        else None
    )
    records: list[RequestRecord] = []
    bar = tqdm(
        total=cfg.requests,
        disable=not cfg.progress,
        unit="req",
        desc="loadtest",
        file=sys.stderr,
        dynamic_ncols=True,
    )
    errors = tokens = 0

    def finished(rec: RequestRecord) -> None:
        nonlocal errors, tokens
        records.append(rec)
        errors += 0 if rec.ok else 1
        tokens += rec.n_tokens
        if cfg.progress:
            bar.set_postfix(errors=errors, tokens=tokens, refresh=False)
        bar.update(1)

    def start(i: int, t0: float) -> asyncio.Task[RequestRecord]:
        k = i % len(clients)
        client, prompt = clients[k], prompts[i % len(prompts)]
        if client is None:
            assert http is not None
            body = completion_body(prompt, cfg.max_tokens, cfg.ignore_eos, cfg.sampling)
            return asyncio.create_task(
                one_http_request(http, body, i, cfg.endpoints[k], t0, cfg.timeout_ms)
            )
        return asyncio.create_task(one_request(client, cfg, i, cfg.endpoints[k], prompt, t0))

    t0 = time.perf_counter()
    stop_at = None if cfg.duration_s is None else t0 + cfg.duration_s
    try:
        if cfg.concurrency is not None:
            issued = 0

            async def user(u: int) -> None:
                nonlocal issued
                if cfg.stagger_s > 0:
                    await asyncio.sleep(u * cfg.stagger_s)
                while True:
                    if cfg.requests is not None and issued >= cfg.requests:
                        return
                    if stop_at is not None and time.perf_counter() >= stop_at:
                        return
                    i = issued
                    issued += 1
                    finished(await start(i, t0))

            await asyncio.gather(*(user(u) for u in range(cfg.concurrency)))
        else:
            assert cfg.rate is not None
            arrivals = poisson_arrivals(cfg.rate, cfg.requests, cfg.duration_s, cfg.seed)
            tasks: list[asyncio.Task[RequestRecord]] = []
            for i, at in enumerate(arrivals):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = start(i, t0)
                task.add_done_callback(lambda t: finished(t.result()))
                tasks.append(task)
            if tasks:
                await asyncio.gather(*tasks)
        wall = max(r.t_end for r in records) if records else time.perf_counter() - t0
    finally:
        bar.close()
        for client in clients:
            if client is not None:
                await client.close()
        if http is not None:
            await http.close()
    records.sort(key=lambda r: r.index)
    return summarize(records, wall, cfg.describe())


def is_http(endpoint: str) -> bool:
    """An OpenAI-compatible HTTP front rather than a ZeroMQ endpoint."""
    return endpoint.startswith(("http://", "https://"))


def run_load(cfg: LoadConfig | None = None, /, **kwargs: Any) -> dict[str, Any]:
    """Blocking ``run_load_async``: ``run_load(LoadConfig(...))`` or ``run_load(endpoints=..)``."""
    return asyncio.run(run_load_async(cfg if cfg is not None else LoadConfig(**kwargs)))
