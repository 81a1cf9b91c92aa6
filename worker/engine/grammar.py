"""Grammars for constrained sampling: GBNF checks and JSON schema conversion.

A ``SamplerSpec`` may carry a GBNF grammar or a JSON schema; this module
turns a schema into GBNF (refusing schemas whose repetition counts would
make the converter write out a huge grammar), refuses grammars nested deeper
than llama.cpp's recursive parser survives, parses GBNF through llama.cpp
with its error message captured, and offers ``LlamaGrammars`` (the
``GrammarChecker`` the validators use before any chain is built). Kept apart
from ``sampling.py`` (the sampler chain itself) because validation needs only
these checks, and they are about text, not about sampling state.
``SamplerError`` lives here because the checks raise it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from functools import lru_cache
from typing import Any

import llama_cpp as ll
from llama_cpp.llama_grammar import json_schema_to_gbnf


class SamplerError(ValueError):
    """The sampling parameters cannot be built into a chain (bad grammar,
    token outside the vocabulary) or no token satisfies them."""


# llama-cpp-python's converter writes repetitions out: ``minItems: n`` (and
# maxItems, min/maxLength, a pattern's ``{n,m}``) becomes n copies of the item
# rule. Each copy is at most about the schema's length (a rule name built from
# its keys, or a literal from a pattern), so the grammar is bounded by the sum
# of the counts times the schema's length; past this many characters it is
# refused. (Measured: ``{"type": "array", "minItems": 1e9}``, 60 bytes, made
# the converter allocate 24 GB and the worker was OOM-killed.)
MAX_SCHEMA_EXPANSION = 1 << 22
_COUNT_KEYS = frozenset(
    {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"}
)
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def _repetitions(schema: Any) -> int:
    """The sum of every count the converter would write out (iterative walk)."""
    total, stack = 0, [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for key, value in item.items():
                if key in _COUNT_KEYS and isinstance(value, int | float):
                    total += int(max(value, 0)) if abs(value) < 1 << 62 else 1 << 62
                elif key == "pattern" and isinstance(value, str):
                    for numbers in _QUANTIFIER.findall(value):
                        total += max(_count(n) for n in numbers)
                else:
                    stack.append(value)
    return total


def _count(digits: str) -> int:
    """A quantifier's number; one too long to read counts as too many."""
    return int(digits or 0) if len(digits) <= 18 else 1 << 62


@lru_cache(maxsize=64)
def schema_to_grammar(schema_json: str) -> str:
    """GBNF for a JSON schema (JSON text); ``SamplerError`` when unsupported
    or when its repetitions would write out more than ``MAX_SCHEMA_EXPANSION``."""
    try:
        count = _repetitions(json.loads(schema_json))
    except ValueError as exc:
        raise SamplerError(f"the JSON schema is not JSON: {exc}") from exc
    if count * (len(schema_json) + 16) > MAX_SCHEMA_EXPANSION:
        raise SamplerError(
            f"the JSON schema's repetition counts (minItems, maxLength, pattern "
            f"{{n,m}}, ...) add up to {count}: its grammar would be too large"
        )
    try:
        return str(json_schema_to_gbnf(schema_json))
    except Exception as exc:  # the converter raises bare Exceptions
        raise SamplerError(f"cannot convert the JSON schema to a grammar: {exc}") from exc


_PARSE_ERROR = re.compile(r"error parsing grammar: (.*)")
# llama.cpp parses ( ) groups recursively on the caller's stack: measured on
# the 8 MiB main thread, 10,000 nested groups parse and 20,000 segfault the
# process (a 40 KB grammar). Deeper than this is refused before llama.cpp sees it.
MAX_GRAMMAR_NESTING = 4096
_NOT_GROUPS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\r\n]*')


def grammar_nesting(text: str) -> int:
    """The deepest nesting of ( ) groups in GBNF text (literals, character
    classes and comments left out)."""
    depth = deepest = 0
    for paren in re.findall(r"[()]", _NOT_GROUPS.sub("", text)):
        depth += 1 if paren == "(" else -1
        deepest = max(deepest, depth)
    return deepest


def _init_grammar(vocab: Any, text: str) -> tuple[Any, str]:
    """``llama_sampler_init_grammar`` with llama.cpp's parse error captured.

    The parser reports errors with ``fprintf(stderr)``; we point fd 2 at a
    temporary file for the call so the reason reaches the client instead of
    the worker's log.
    """
    if grammar_nesting(text) > MAX_GRAMMAR_NESTING:
        return None, f"groups nest deeper than {MAX_GRAMMAR_NESTING} levels"
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            ptr = ll.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if ptr:
            return ptr, ""
        tmp.seek(0)
        out = tmp.read(4096).decode("utf-8", "replace")
    match = _PARSE_ERROR.search(out)
    if match:
        return None, match.group(1).strip()
    return None, "it has no 'root' rule or is left-recursive"


def check_grammar(text: str) -> str | None:
    """Why ``text`` is not a usable GBNF grammar, or None when it parses.

    Parsed without a vocabulary, so ``<token>`` references cannot be
    resolved here: grammars using them are only checked when the chain is
    built (``SamplerError``).
    """
    ptr, why = _init_grammar(None, text)
    if ptr:
        ll.llama_sampler_free(ptr)
        return None
    if "<" in text:
        return None
    return why


class LlamaGrammars:
    """The engine's ``GrammarChecker`` (see ``worker/spec.py``), for validation."""

    def grammar_error(self, text: str) -> str | None:
        return check_grammar(text)

    def schema_error(self, schema_json: str) -> str | None:
        try:
            grammar = schema_to_grammar(schema_json)
        except SamplerError as exc:
            return str(exc)
        why = check_grammar(grammar)
        return None if why is None else f"gives an invalid grammar: {why}"
