"""``edge/flags.py``: flag over variable over default, the same for every process."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from edge.flags import Flag, Flags
from gateway import config as gateway_config
from speech import cli as speech_cli
from worker import config as worker_config

FLAGS = Flags(
    [
        Flag("lanes", int, "lanes", 4),
        Flag("port", int, "port", 0, env=("SKIFF_T_OWN_PORT", "SKIFF_T_PORT")),
        Flag("mode", str, "mode", "a", choices=("a", "b")),
        Flag("peer", str, "peers", (), repeat=True),
    ],
    prefix="SKIFF_T_",
)


def _parse(argv: list[str]) -> argparse.Namespace:
    return FLAGS.parse(argparse.ArgumentParser(prog="t"), argv)


def test_flag_over_variable_over_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parse([]).lanes == 4
    monkeypatch.setenv("SKIFF_T_LANES", "6")
    assert _parse([]).lanes == 6
    assert _parse(["--lanes", "8"]).lanes == 8


def test_variables_are_tried_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKIFF_T_PORT", "9100")
    assert _parse([]).port == 9100
    monkeypatch.setenv("SKIFF_T_OWN_PORT", "9200")
    assert _parse([]).port == 9200


def test_a_bad_variable_stops_with_its_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SKIFF_T_LANES", "many")
    with pytest.raises(SystemExit) as stop:
        _parse([])
    assert stop.value.code == 2
    assert "SKIFF_T_LANES='many'" in capsys.readouterr().err
    monkeypatch.delenv("SKIFF_T_LANES")
    monkeypatch.setenv("SKIFF_T_MODE", "c")
    with pytest.raises(SystemExit):
        _parse([])
    assert "SKIFF_T_MODE='c': choose from a, b" in capsys.readouterr().err


def test_repeat_flags_replace_their_variable_list(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parse([]).peer == []
    monkeypatch.setenv("SKIFF_T_PEER", "x, y,")
    assert _parse([]).peer == ["x", "y"]
    assert _parse(["--peer", "z"]).peer == ["z"]


def test_every_process_reads_its_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKIFF_LANES", "3")
    assert worker_config.parse([]).lanes == 3
    monkeypatch.setenv("SKIFF_GATEWAY_WORKERS", "tcp://a:1,tcp://b:2")
    parser = argparse.ArgumentParser()
    gateway_config.add_serve_arguments(parser)
    cfg = gateway_config.from_namespace(parser.parse_args([]))
    assert cfg.workers == ("tcp://a:1", "tcp://b:2")
    monkeypatch.setenv("SKIFF_METRICS_PORT", "9100")  # shared by every process
    monkeypatch.setenv("SKIFF_SPEECH_THREADS", "1")
    args = speech_cli.parse([])
    assert (args.metrics_port, args.threads, args.voice) == (9100, 1, ["joe"])
    monkeypatch.setenv("SKIFF_SPEECH_METRICS_PORT", "70000")
    with pytest.raises(SystemExit):
        speech_cli.parse([])


def test_cpus_are_parsed_and_checked_against_the_cores_here() -> None:
    import os

    from worker.config import parse_cpus

    here = sorted(os.sched_getaffinity(0))
    assert parse_cpus("") == set()
    assert parse_cpus(str(here[0])) == {here[0]}
    if len(here) > 1:
        assert parse_cpus(f"{here[0]}-{here[1]}") >= {here[0], here[1]}
    for bad in ("a", "1-", "3-1", "0;1", str(max(here) + 64)):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_a_pinned_worker_runs_on_its_cores(tmp_path: Path) -> None:
    """``--cpus`` pins the process before llama.cpp starts its threads; its
    threads default to that many, and ``info`` says where it runs."""
    import os

    from conftest import start_worker, stop_worker
    from protocol import Client

    core = sorted(os.sched_getaffinity(0))[-1]
    proc, endpoint, _ = start_worker(tmp_path, "--lanes", "1", "--ctx", "256", "--cpus", str(core))
    try:
        with Client(endpoint) as c:
            info = c.info()
        assert info["cpus"] == [core]
        status = Path(f"/proc/{proc.pid}/status").read_text()
        allowed = next(line for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
        assert allowed.split()[-1] == str(core)
    finally:
        stop_worker(proc)
