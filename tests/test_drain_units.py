"""Drain bookkeeping with fakes: a move's lane is counted once, whatever the
order in which the import's reply and a ``stats`` reply reach the gateway."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from gateway.affinity import AffinityTable
from gateway.drain import Call, Drainer
from gateway.host import Host
from gateway.pool import LLM, WorkerConn


def _worker(name: str, idle: int) -> WorkerConn:
    w = WorkerConn(name=name, kind=LLM, peer=cast(Any, None), up=True)
    asked = w.mark_stats_sent(0.0)
    w.apply_stats({"lanes": {"total": 4, "idle": idle}, "running": 0, "queued": 0}, asked)
    return w


def _drainer(src: WorkerConn, dst: WorkerConn) -> Drainer:
    svc = SimpleNamespace(pool=SimpleNamespace(workers={w.name: w for w in (src, dst)}))
    svc.affinity = AffinityTable()
    return Drainer(cast(Host, svc))


def _to_import(steps: Any) -> Call:
    call = next(steps)
    assert isinstance(call, Call) and call.op == "export_state"
    call = steps.send(({"ok": True, "result": {}}, []))
    assert isinstance(call, Call) and call.op == "import_state"
    return call


def test_a_stats_reply_overtaking_the_import_counts_the_lane_once() -> None:
    src, dst = _worker("src", 2), _worker("dst", 2)
    steps = _drainer(src, dst)._move(src, "s")
    call = _to_import(steps)
    assert call.worker is dst
    # stats asked while the import is on its way; the worker answers it after the
    # import (same connection), so its idle count already leaves the lane out
    asked = dst.mark_stats_sent(1.0)
    drop = steps.send(({"ok": True, "result": {"position": 3}}, []))
    assert isinstance(drop, Call) and drop.op == "drop"
    dst.apply_stats({"lanes": {"total": 4, "idle": 1}, "running": 0, "queued": 0}, asked)
    assert dst.candidate().free_lanes == 1


def test_a_stats_reply_before_the_import_counts_the_lane_once() -> None:
    src, dst = _worker("src", 2), _worker("dst", 2)
    steps = _drainer(src, dst)._move(src, "s")
    asked = dst.mark_stats_sent(1.0)
    dst.apply_stats({"lanes": {"total": 4, "idle": 2}, "running": 0, "queued": 0}, asked)
    _to_import(steps)
    assert dst.candidate().free_lanes == 1  # taken from the send on
    steps.send(({"ok": True, "result": {"position": 3}}, []))
    assert dst.candidate().free_lanes == 1


def test_a_refused_import_gives_the_lane_back() -> None:
    src, dst = _worker("src", 2), _worker("dst", 2)
    steps = _drainer(src, dst)._move(src, "s")
    _to_import(steps)
    try:
        steps.send(({"ok": False, "error": {"code": "lanes_busy", "message": "full"}}, []))
    except StopIteration as stop:
        error, where = stop.value
    else:
        raise AssertionError("the move went on after a refused import")
    assert error.startswith("import_state on dst: lanes_busy") and where == {}
    assert dst.candidate().free_lanes == 2
