"""Prompts for load tests: a deterministic built-in set, or a file.

The built-in text is natural-ish English assembled from a fixed vocabulary by
a seeded RNG, so every run (and every system in a benchmark) sees exactly the
same prompts. This prose runs at about 1.15 tokens per word with Gemma's
tokenizer (a little more with others); the target lengths below are in tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

Prompt = str | list[int]

# Approximate prompt lengths (tokens) of the built-in set: short, ~50, ~200, ~500.
BUILTIN_LENGTHS = (8, 50, 200, 500)
TOKENS_PER_WORD = 1.15

_SUBJECTS = (
    "the old lighthouse keeper",
    "a quiet engineer",
    "the river",
    "our small team",
    "the city council",
    "a curious student",
    "the morning train",
    "every sailor",
    "the northern wind",
    "a patient gardener",
    "the market",
    "my neighbour",
)
_VERBS = (
    "watched",
    "repaired",
    "described",
    "followed",
    "measured",
    "painted",
    "remembered",
    "carried",
    "studied",
    "explained",
    "crossed",
    "questioned",
)
_OBJECTS = (
    "the harbour at dawn",
    "a broken compass",
    "the long winter",
    "the village library",
    "a map of the coast",
    "the distant mountains",
    "an unfinished letter",
    "the evening tide",
    "a box of old photographs",
    "the bridge over the canal",
    "the results of the survey",
    "a forgotten recipe",
)
_TAILS = (
    "with great care",
    "before the storm arrived",
    "for the third time",
    "without saying a word",
    "while the others slept",
    "as the bells rang",
    "in the fading light",
    "after a long discussion",
    "during the festival",
    "because nobody else would",
)
_JOINS = ("Later,", "Meanwhile,", "Afterwards,", "Still,", "Then", "By noon,", "In the end,")
_QUESTIONS = (
    "Summarise the story above in two sentences.",
    "What happens next? Continue the story.",
    "Explain why the characters acted as they did.",
    "Write a short poem inspired by this passage.",
)


def make_text(n_words: int, seed: int = 0) -> str:
    """About ``n_words`` words of deterministic natural-ish prose."""
    rng = random.Random(seed)
    words: list[str] = []
    first = True
    while len(words) < n_words:
        parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.6:
            parts.append(rng.choice(_TAILS))
        sentence = " ".join(parts)
        if not first and rng.random() < 0.35:
            sentence = f"{rng.choice(_JOINS)} {sentence}"
        first = False
        words.extend((sentence[0].upper() + sentence[1:] + ".").split())
    text = " ".join(words[:n_words]).rstrip(",")
    return text if text.endswith(".") else text + "."


def prompt_of_tokens(approx_tokens: int, seed: int = 0) -> str:
    """A prompt of roughly ``approx_tokens`` tokens: prose and a question."""
    question = _QUESTIONS[seed % len(_QUESTIONS)]
    body_words = max(1, round(approx_tokens / TOKENS_PER_WORD) - len(question.split()))
    return f"{make_text(body_words, seed)}\n\n{question}"


def builtin_prompts(count_per_length: int = 4) -> list[str]:
    """The built-in set: ``count_per_length`` prompts of each length, interleaved."""
    out: list[str] = []
    for i in range(count_per_length):
        for j, length in enumerate(BUILTIN_LENGTHS):
            seed = 1000 * j + i
            if length <= 10:
                out.append(_QUESTIONS[seed % len(_QUESTIONS)])
            else:
                out.append(prompt_of_tokens(length, seed))
    return out


def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a file: one per line, or JSONL objects with ``prompt``.

    A JSONL object may carry ``tokens`` (a list of token ids) instead. Blank
    lines are skipped. Raises ``ValueError`` for a line that looks like JSON
    but is not a usable object, and for a file with no prompts.
    """
    out: list[Prompt] = []
    for n, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: invalid JSON: {exc}") from exc
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                out.append(obj["prompt"])
            elif isinstance(obj, dict) and isinstance(obj.get("tokens"), list):
                out.append([int(t) for t in obj["tokens"]])
            else:
                raise ValueError(f'{path}:{n}: JSON line needs a "prompt" string')
        else:
            out.append(raw.rstrip("\n"))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out
