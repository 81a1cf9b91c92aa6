"""The full sampler set on the real model: effects, reproducibility, validation.

Most tests run in-process (one module engine, a ``RuntimeState`` per test);
a few go through the shared worker socket. Every sampling key either shows
a visible effect on the tokens or has a validation test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from faults import BadRequest
from protocol import Client, SkiffError
from worker.api.sampling import get_sampling
from worker.engine import Engine, EngineConfig
from worker.engine.grammar import LlamaGrammars, SamplerError, check_grammar
from worker.engine.sampling import Sampler, eog_tokens
from worker.runtime import RuntimeState, Step
from worker.spec import SamplerSpec

PROMPT = "The capital of France is"
REPEAT = "one one one one one one one one one one"
CYCLE = "one two three one two three one two three one two"


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Engine]:
    # one thread: with two, an oversubscribed machine makes ggml's barriers crawl
    eng = Engine(EngineConfig(model_path, n_ctx=2048, n_seq=2, n_threads=1))
    yield eng
    eng.close()


@pytest.fixture()
def rt(engine: Engine) -> Iterator[RuntimeState]:
    for lane in range(engine.n_seq):
        engine.seq_clear(lane)
    state = RuntimeState(engine)
    yield state
    for sid in list(state.lanes.sessions):
        state.drop(sid)


def spec(**sampling: Any) -> SamplerSpec | None:
    return get_sampling({"sampling": sampling})


def run(
    rt: RuntimeState, s: SamplerSpec | None, n: int, prompt: str = PROMPT, sid: str = "a"
) -> list[int]:
    """``n`` tokens in a fresh session (prompt forward, then one per forward)."""
    if rt.lanes.get(sid) is not None:
        rt.drop(sid)
    (session,) = rt.admit([sid])
    out = [rt.forward([Step(session, rt.engine.tokenize(prompt), sample=True, spec=s)])[0].token]
    while len(out) < n:
        out.append(rt.forward([Step(session, [out[-1]], sample=True, spec=s)])[0].token)
    rt.drop(sid)
    return [t for t in out if t is not None]


# -- visible effects ------------------------------------------------------------


def test_top_k_1_through_the_chain_equals_greedy(rt: RuntimeState) -> None:
    greedy = run(rt, None, 6)
    assert spec(top_k=1, temperature=1.5).greedy  # fast path
    # a zero bias forces the llama.cpp chain without changing any logit
    s = spec(top_k=1, temperature=1.5, seed=3, logit_bias=[{"token": 5, "bias": 0.0}])
    assert s is not None and not s.greedy
    assert run(rt, s, 6) == greedy


def test_logit_bias_forbids_and_forces(rt: RuntimeState) -> None:
    first = run(rt, None, 1)[0]
    banned = run(rt, spec(temperature=0, logit_bias=[{"token": first, "bias": float("-inf")}]), 3)
    assert first not in banned
    forced = run(rt, spec(temperature=0, logit_bias=[{"token": 1437, "bias": 100.0}]), 3)
    assert forced == [1437, 1437, 1437]


def test_ignore_eos_never_samples_an_end_token(rt: RuntimeState) -> None:
    eog = eog_tokens(rt.engine)
    assert rt.engine.eos in eog and all(rt.engine.is_eog(t) for t in eog)
    push = [{"token": t, "bias": 50.0} for t in eog]  # make an end token the argmax
    assert rt.engine.is_eog(run(rt, spec(temperature=0, logit_bias=push), 1)[0])
    for s in (spec(temperature=0, logit_bias=push, ignore_eos=True), spec(ignore_eos=True, seed=1)):
        assert not any(rt.engine.is_eog(t) for t in run(rt, s, 4))


def test_grammar_restricts_output_to_digits(rt: RuntimeState) -> None:
    assert not rt.engine.detokenize(run(rt, None, 4)).strip().isdigit()
    for s in (
        spec(grammar="root ::= [0-9]+", seed=3),
        spec(grammar="root ::= [0-9]+", temperature=0),
    ):
        toks = run(rt, s, 8)
        text = rt.engine.detokenize([t for t in toks if not rt.engine.is_eog(t)])
        assert text and text.isdigit(), text


def test_json_schema_output_parses_and_validates(rt: RuntimeState) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer"},
            "adult": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        },
        "required": ["name", "age", "adult", "tags"],
        "additionalProperties": False,
    }
    engine = rt.engine
    for s in (spec(json_schema=schema, temperature=0), spec(json_schema=schema, seed=5)):
        (session,) = rt.admit(["j"])
        prompt = engine.tokenize("Describe a person as JSON:")
        out = [rt.forward([Step(session, prompt, sample=True, spec=s)])[0].token]
        while not engine.is_eog(out[-1]) and len(out) < 80:
            out.append(rt.forward([Step(session, [out[-1]], sample=True, spec=s)])[0].token)
        rt.drop("j")
        assert engine.is_eog(out[-1])  # the grammar completed and allowed only the end
        value = json.loads(engine.detokenize(out[:-1]))
        assert set(value) == {"name", "age", "adult", "tags"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert isinstance(value["age"], int) and isinstance(value["adult"], bool)
        assert isinstance(value["tags"], list) and len(value["tags"]) <= 2
        assert all(isinstance(t, str) and len(t) <= 8 for t in value["tags"])


@pytest.mark.parametrize(
    "params",
    [{"repeat_penalty": 1.5}, {"presence_penalty": 8.0}, {"frequency_penalty": 4.0}],
    ids=lambda p: next(iter(p)),
)
def test_penalties_change_a_repetitive_continuation(
    rt: RuntimeState, params: dict[str, float]
) -> None:
    greedy = run(rt, None, 6, REPEAT)
    penalised = run(rt, spec(temperature=0, **params), 6, REPEAT)
    assert greedy[0] == penalised[0]  # prompt tokens are not in the history
    assert penalised != greedy
    # penalty_last_n = 0 disables the penalty
    assert run(rt, spec(temperature=0, penalty_last_n=0, **params), 6, REPEAT) == greedy


def test_accepting_the_prompt_feeds_the_penalty_history(rt: RuntimeState) -> None:
    engine = rt.engine
    prompt = engine.tokenize(REPEAT)
    (session,) = rt.admit(["p"])
    rt.forward([Step(session, prompt)])
    greedy_first = run(rt, None, 1, REPEAT, sid="g")[0]
    assert greedy_first in prompt
    s = spec(temperature=0, repeat_penalty=3.0)
    assert s is not None
    sampler = rt.rows.sampler_for(session, s)
    sampler.accept(prompt)
    # re-run the last prompt token to get a fresh row for this session
    rt.trim("p", len(prompt) - 1)
    tok = rt.forward([Step(session, prompt[-1:], sample=True, spec=s)])[0].token
    assert tok != greedy_first


def test_dry_changes_a_repetitive_continuation(rt: RuntimeState) -> None:
    greedy = run(rt, None, 12, CYCLE)
    dry = run(rt, spec(temperature=0, dry_multiplier=0.8), 12, CYCLE)
    assert dry != greedy
    same = spec(temperature=0, dry_multiplier=0.8, samplers=["top_k", "temperature"])
    assert same is not None and same.greedy  # dry not in the order: off
    breakers = spec(temperature=0, dry_multiplier=0.8, dry_sequence_breakers=[" one"])
    assert run(rt, breakers, 12, CYCLE) != dry


@pytest.mark.parametrize("mirostat", [1, 2])
def test_mirostat_runs_and_is_seed_reproducible(rt: RuntimeState, mirostat: int) -> None:
    a = run(rt, spec(mirostat=mirostat, seed=11), 8)
    assert a == run(rt, spec(mirostat=mirostat, seed=11), 8)
    assert a != run(rt, spec(mirostat=mirostat, seed=12, mirostat_tau=9.0), 8)


def test_truncation_samplers_run_and_act(rt: RuntimeState) -> None:
    greedy = run(rt, None, 6)
    wide = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    # a tiny sigma keeps only the maximum: greedy whatever the seed
    assert run(rt, spec(top_n_sigma=1e-6, seed=1, **wide), 6) == greedy
    # a tiny typical mass keeps one token: the seed no longer matters
    typ = run(rt, spec(typical_p=1e-6, seed=1, **wide), 6)
    assert typ == run(rt, spec(typical_p=1e-6, seed=2, **wide), 6)
    # without them the two seeds diverge
    assert run(rt, spec(seed=1, **wide), 6) != run(rt, spec(seed=2, **wide), 6)
    # xtc with probability 1 always cuts the top choices
    xtc = run(rt, spec(xtc_probability=1.0, xtc_threshold=0.01, seed=1), 6)
    assert xtc != run(rt, spec(seed=1), 6) and xtc[0] != greedy[0]
    dyn = spec(dynatemp_range=0.7, dynatemp_exponent=2.0, seed=4)
    assert run(rt, dyn, 6) == run(rt, dyn, 6)


def test_samplers_order(rt: RuntimeState) -> None:
    greedy = run(rt, None, 6)
    only_top_k = spec(top_k=1, temperature=5.0, samplers=["top_k"], seed=2)
    assert only_top_k is not None and only_top_k.greedy
    no_top_k = spec(top_k=1, temperature=5.0, samplers=["temperature"], seed=2)
    assert no_top_k is not None and not no_top_k.greedy
    assert run(rt, no_top_k, 6) != greedy
    # xtc before top_k may drop the argmax: not greedy any more
    order = spec(top_k=1, xtc_probability=1.0, xtc_threshold=0.01, samplers=["xtc", "top_k"])
    assert order is not None and not order.greedy
    assert run(rt, order, 1)[0] != greedy[0]


def test_grammar_that_cannot_continue_raises_instead_of_aborting(rt: RuntimeState) -> None:
    s = spec(grammar='root ::= "a"', ignore_eos=True, seed=1)
    (session,) = rt.admit(["g"])
    tok = rt.forward([Step(session, rt.engine.tokenize(PROMPT), sample=True, spec=s)])[0].token
    assert rt.engine.detokenize([tok]) == "a"
    before = session.position
    (result,) = rt.forward([Step(session, [tok], sample=True, spec=s)])
    assert isinstance(result.error, BadRequest)  # -> bad_request, worker lives
    assert "no token satisfies" in str(result.error)
    assert session.position == before + 1  # the fed token is accounted for
    rt.check_position(session)


def test_build_errors_are_sampler_errors(engine: Engine) -> None:
    with pytest.raises(SamplerError, match="logit_bias"):
        Sampler(engine, SamplerSpec(logit_bias=((engine.n_vocab, 1.0),)))
    with pytest.raises(SamplerError, match="grammar"):  # token refs are checked at build
        Sampler(engine, SamplerSpec(grammar="root ::= <not-a-token-at-all>"))
    assert issubclass(SamplerError, ValueError)


# -- reproducibility and state across ops ---------------------------------------


def test_seed_reproduces_across_sessions_and_runtimes(engine: Engine) -> None:
    s = spec(seed=1234, temperature=1.0, repeat_penalty=1.1)
    first = RuntimeState(engine)
    a = run(first, s, 10, sid="a")
    b = run(first, s, 10, sid="b")
    second = RuntimeState(engine)  # a second "worker" over the same model
    c = run(second, s, 10, sid="c")
    assert a == b == c
    assert a != run(second, spec(seed=4321, temperature=1.0, repeat_penalty=1.1), 10)


def test_state_survives_across_ops_over_the_socket(client: Client) -> None:
    sampling = {"seed": 77, "temperature": 1.5, "repeat_penalty": 1.2}
    prompt = client.tokenize(PROMPT)
    stepwise = [client.prefill_sampled("s1", prompt, sampling)["token"]]
    for _ in range(4):
        stepwise.append(client.decode("s1", stepwise[-1], sampling)["token"])
    # one uninterrupted generation with the same seed gives the same tokens
    done = client.call(
        "generate",
        args={
            "tokens": prompt,
            "max_tokens": 5,
            "sampling": sampling,
            "ignore_eos": True,
            "stream": False,
        },
    ).result
    assert done["tokens"] == stepwise
    # a chain rebuilt every op would make each token a fresh chain's first draw
    fresh = []
    for k in range(len(stepwise)):
        fresh.append(client.prefill_sampled(f"f{k}", prompt + stepwise[:k], sampling)["token"])
        client.drop(f"f{k}")
    assert fresh[0] == stepwise[0] and fresh != stepwise


def test_json_schema_generation_over_the_socket(client: Client) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
    }
    result = client.call(
        "generate",
        args={
            "prompt": "A JSON object:",
            "max_tokens": 40,
            "sampling": {"json_schema": schema, "seed": 5, "temperature": 0.5},
            "stream": False,
        },
    ).result
    assert result["finish_reason"] == "stop", result
    value = json.loads(result["text"])
    assert isinstance(value["n"], int) and isinstance(value["ok"], bool)


# -- validation -----------------------------------------------------------------


def test_defaults_are_llama_cpp_common_defaults() -> None:
    s = spec()
    assert s == SamplerSpec()
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.typical_p) == (0.8, 40, 0.95, 0.05, 1.0)
    assert s.samplers[0] == "penalties" and s.samplers[-1] == "temperature"
    assert s.dry_sequence_breakers == ("\n", ":", '"', "*")
    assert not s.greedy and spec(temperature=0) is not None
    assert hash(spec(logit_bias=[{"token": 1, "bias": 2}], samplers=["top_k"])) is not None
    assert get_sampling({}) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("temperature", "hot"),
        ("top_k", 1.5),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("typical_p", 2),
        ("top_n_sigma", -2),
        ("dynatemp_range", -1),
        ("dynatemp_exponent", float("nan")),
        ("repeat_penalty", 0),
        ("presence_penalty", 1000),
        ("frequency_penalty", True),
        ("penalty_last_n", -2),
        ("dry_multiplier", -1),
        ("dry_base", 0.5),
        ("dry_allowed_length", -1),
        ("dry_penalty_last_n", -5),
        ("dry_sequence_breakers", "abc"),
        ("dry_sequence_breakers", [""]),
        ("xtc_probability", 1.5),
        ("xtc_threshold", -0.5),
        ("mirostat", 3),
        ("mirostat_tau", -1),
        ("mirostat_eta", 2),
        ("logit_bias", {"1": 2}),
        ("logit_bias", [{"token": -1, "bias": 1}]),
        ("logit_bias", [{"token": 1, "bias": "x"}]),
        ("logit_bias", [{"token": 1}]),
        ("seed", -1),
        ("seed", 1 << 32),
        ("ignore_eos", 1),
        ("samplers", ["top_k", "beam"]),
        ("samplers", "top_k"),
        ("grammar", "root ::= [0-9"),
        ("grammar", "start ::= [0-9]+"),
        ("grammar", ""),
        ("grammar", 5),
        ("json_schema", "not a map"),
        ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
    ],
)
def test_out_of_range_values_are_bad_requests_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(BadRequest, match=f"sampling\\.{field}"):
        get_sampling({"sampling": {field: value}}, grammars=LlamaGrammars())


def test_unknown_keys_and_conflicts_are_bad_requests() -> None:
    with pytest.raises(BadRequest, match=r"sampling\.top_q is not a known sampling field"):
        get_sampling({"sampling": {"top_q": 0.5}})
    with pytest.raises(BadRequest, match="cannot both"):
        get_sampling(
            {"sampling": {"grammar": "root ::= [0-9]", "json_schema": {}}},
            grammars=LlamaGrammars(),
        )
    with pytest.raises(BadRequest, match="sampling must be a map"):
        get_sampling({"sampling": [1]})
    assert check_grammar("root ::= [0-9]+") is None
    assert "Undefined rule" in (check_grammar("root ::= digit") or "")


def test_bad_sampling_over_the_socket_is_bad_request(client: Client) -> None:
    prompt = client.tokenize(PROMPT)
    for sampling, field in [
        ({"top_q": 0.5}, "sampling.top_q"),
        ({"top_p": 2}, "sampling.top_p"),
        ({"grammar": "root ::= ("}, "sampling.grammar"),
        ({"samplers": ["nope"]}, "sampling.samplers"),
    ]:
        with pytest.raises(SkiffError) as err:
            client.prefill_sampled("bad", prompt, sampling)
        assert err.value.code == "bad_request" and field in str(err.value), err.value
    with pytest.raises(SkiffError) as err:
        client.call("generate", args={"prompt": "x", "sampling": {"mirostat": 5}, "stream": False})
    assert err.value.code == "bad_request" and "sampling.mirostat" in str(err.value)
