"""The gateway's wait spins only while messages come fast (``--poll-spin-us``).

Real ZeroMQ sockets (inproc), no workers: the poller's own judgement, by
counting the waits that spun, never by timing them. The round trip it saves
is a figure (``scripts/bench_gateway.py``), not a test.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from gateway.runner import _SplitPoller


class _Service:
    def __init__(self) -> None:
        self.ready: set[Any] = set()


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx = zmq.Context()
    front, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    front.bind("inproc://spin")
    client.connect("inproc://spin")
    yield front, client
    front.close(0)
    client.close(0)
    ctx.term()


def _poller(front: zmq.Socket[Any], spin_us: int) -> _SplitPoller:
    return _SplitPoller(front, _Service(), None, spin_us)  # type: ignore[arg-type]


def test_fast_messages_make_it_spin_and_an_idle_wait_stops_it(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    front, client = pair
    poller = _poller(front, spin_us=250)
    assert poller.poll(1) == [] and poller.spun == 0  # idle: a long gap, no spin
    poller.gap_s = 0.0  # as if messages had been coming back to back
    client.send(b"x")
    while not poller.poll(1000):  # the message is there, or spinning finds it
        pass
    front.recv_multipart()
    assert poller.poll(1) == []  # nothing came: it spun, then slept out the timeout
    assert poller.spun >= 1
    for _ in range(10):  # idle waits raise the average gap past the bound
        poller.poll(2)
    assert poller.gap_s > _SplitPoller.SPIN_WHILE * poller.spin_s
    spun = poller.spun
    assert poller.poll(1) == []
    assert poller.spun == spun  # slow traffic: it sleeps at once


def test_spin_zero_never_spins(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    front, client = pair
    poller = _poller(front, spin_us=0)
    poller.gap_s = 0.0
    client.send(b"x")
    while not poller.poll(1000):
        pass
    front.recv_multipart()
    assert poller.poll(1) == []
    assert poller.spun == 0
