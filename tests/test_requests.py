"""Typed requests: a generation's header read once into a ``Generation``, and
a stage's sampling map checked once per distinct map."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from edge import Request
from faults import BadRequest, Unsupported
from worker import service
from worker.api import generate, tensors
from worker.api.app import App
from worker.api.requests import Generation, Speculation
from worker.api.validate import Context
from worker.limits import Limits
from worker.runtime.steps import PromptLookup


def _app() -> App:
    limits = Limits().resolved(1024)
    context = Context(limits, n_vocab=100)
    fields = {"limits": limits, "n_vocab": 100, "grammars": None, "context": context}
    return cast(App, SimpleNamespace(**fields, projector=None))


def _req(args: dict[str, Any], session: str | None = None) -> Request:
    return Request(b"p", 1, "generate", session, args, [], 0.0, None)


def test_a_generation_is_read_into_typed_fields() -> None:
    gen = generate.read_generation(
        _app(),
        _req(
            {
                "prompt": "x",
                "max_tokens": 7,
                "stop": ["x"],
                "stop_tokens": [3, 4],
                "logprobs": True,
                "top_logprobs": 2,
                "stream": False,
                "speculative": {"mode": "prompt_lookup", "ngram": 2},
            },
            session="s",
        ),
    )
    assert (gen.session, gen.max_tokens, gen.stop, gen.stop_tokens) == ("s", 7, ("x",), {3, 4})
    assert (gen.top_logprobs, gen.stream, gen.spec) == (2, False, None)
    assert gen.speculation == Speculation("prompt_lookup", 8, 2)
    with pytest.raises(BadRequest, match=r"speculative\.path"):
        bad = {"prompt": "x", "speculative": {"mode": "draft_model", "path": 1}}
        generate.read_generation(_app(), _req(bad))


def _gen(speculation: Speculation | None, outputs: tuple[str, ...] = ()) -> Generation:
    return cast(Generation, SimpleNamespace(speculation=speculation, outputs=outputs))


def test_the_worker_decides_what_a_typed_request_may_use() -> None:
    fake = SimpleNamespace(draft=None, speculate_streams=2)
    app = cast(App, fake)
    with pytest.raises(Unsupported, match="no draft model"):
        service._drafter(app, _gen(Speculation("draft_model", 4)))
    auto = service._drafter(app, _gen(None))  # asked nothing: the worker's prompt lookup
    assert isinstance(auto, PromptLookup) and auto.max_streams == 2
    asked = service._drafter(app, _gen(Speculation("prompt_lookup", 4, 2)))
    assert isinstance(asked, PromptLookup) and asked.max_streams is None  # drafts at any load
    assert service._drafter(app, _gen(Speculation("off", 0))) is None
    assert service._drafter(app, _gen(None, ("logits",))) is None  # outputs: never speculates
    fake.speculate_streams = None  # --speculate off
    assert service._drafter(app, _gen(None)) is None


def test_a_stage_checks_each_sampling_map_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    real = tensors.get_sampling

    def counting(entry: dict[str, Any], *a: Any, **kw: Any) -> Any:
        calls.append(entry)
        return real(entry, *a, **kw)

    monkeypatch.setattr(tensors, "get_sampling", counting)
    monkeypatch.setattr(tensors, "_STAGE_SPECS", type(tensors._STAGE_SPECS)())
    app = cast(App, SimpleNamespace(grammars=None, limits=Limits()))
    hot = {"sampling": {"temperature": 0.7, "seed": 5}}
    first = tensors._stage_spec(app, hot)
    again = tensors._stage_spec(app, {"sampling": {"seed": 5, "temperature": 0.7}})
    assert first is again and first is not None and len(calls) == 1
    with pytest.raises(BadRequest):
        tensors._stage_spec(app, {"sampling": {"temperature": "hot"}})
    with pytest.raises(BadRequest):  # a refused map is not remembered
        tensors._stage_spec(app, {"sampling": {"temperature": "hot"}})
    assert len(calls) == 3


def test_a_map_checked_under_one_workers_limits_is_not_reused_under_anothers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from faults import LimitExceeded

    monkeypatch.setattr(tensors, "_STAGE_SPECS", type(tensors._STAGE_SPECS)())
    bias = [{"token": 1, "bias": 1.0}, {"token": 2, "bias": 1.0}]
    entry = {"sampling": {"temperature": 0.5, "logit_bias": bias}}
    loose = cast(App, SimpleNamespace(grammars=None, limits=Limits()))
    tight = cast(App, SimpleNamespace(grammars=None, limits=Limits(max_logit_bias=1)))
    assert tensors._stage_spec(loose, entry) is not None
    with pytest.raises(LimitExceeded):
        tensors._stage_spec(tight, entry)


@pytest.mark.parametrize("mode", [[1], {"a": 1}, 3, None, "beam"])
def test_a_speculative_mode_of_any_other_type_is_a_bad_request(mode: Any) -> None:
    """Found by the fuzzer: a list as ``mode`` met a dict lookup (unhashable)."""
    with pytest.raises(BadRequest, match=r"speculative\.mode"):
        generate.read_generation(_app(), _req({"prompt": "x", "speculative": {"mode": mode}}))
