"""Property tests of what a peer's bytes meet first: codec, frames, validators, handlers.

The promise under test is one sentence: whatever a peer sends, the edge
either gets a typed value or a ``faults.Fault`` (a stable error code), never
another exception — which the edge would answer as ``internal``, and which
for input alone is a bug. ``tests/test_codec.py`` and ``tests/test_frames_*.py``
hold the round trips and the one-field-at-a-time refusals; here values are
arbitrary (any msgpack value, any integer, NaN, huge, deep), and the
handlers of every op run through the real edge path (``scripts/fuzz_atheris.py``'s
``Harness``: a fake model, real tables).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faults import Fault
from protocol import frame_chunks, frames, transport
from worker.api import validate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from _fuzz_draws import SAMPLING, Target  # noqa: E402
from _fuzz_values import ARG_NAMES  # noqa: E402
from fuzz_atheris import Harness  # noqa: E402
from fuzzcases import Generator  # noqa: E402

try:
    from worker.api.sampling import get_sampling
except ImportError:  # before sampling validation had its own module
    from worker.api.validate import get_sampling  # type: ignore[attr-defined,no-redef]

# No example database: the suite leaves nothing behind in the tree.
PROPS = settings(
    max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
FEW = settings(PROPS, max_examples=40)  # for strategies that are slow to draw
WIRE_INTS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from(
        [0, 1, -1, 2**31, 2**32 - 1, 2**53 + 1, 2**62 - 1, 2**62, 2**63 - 1, 2**64 - 1]
    ),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    WIRE_INTS,
    st.floats(),  # NaN and the infinities included
    st.text(max_size=40),
    st.binary(max_size=40),
)
KEYS = st.one_of(st.text(max_size=12), st.integers(-3, 3), st.sampled_from(ARG_NAMES))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=12,
)


def _fault_or(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when it raised a Fault; any other exception fails the test."""
    try:
        return fn()
    except Fault:
        return None


# -- codec ---------------------------------------------------------------------


@PROPS
@given(st.binary(max_size=300))
def test_decode_of_any_bytes_is_a_map_or_a_codec_error(raw: bytes) -> None:
    with contextlib.suppress(transport.CodecError):
        assert isinstance(transport.decode(raw), dict)


@PROPS
@given(VALUES)
def test_decode_of_any_msgpack_value_is_a_map_or_a_codec_error(value: Any) -> None:
    raw = msgpack.packb(value, use_bin_type=True)
    try:
        decoded = transport.decode(raw)
    except transport.CodecError:
        assert not isinstance(value, dict) or _depth(value) > transport.MAX_DEPTH
        return
    assert isinstance(value, dict) and _same(decoded, value)


@FEW
@given(st.dictionaries(st.text(max_size=8), VALUES, max_size=4))
def test_encode_decode_round_trip(header: dict[str, Any]) -> None:
    assert _same(transport.decode(transport.encode(header)), header)


@PROPS
@given(st.integers(1, 40), st.booleans(), st.one_of(st.none(), WIRE_INTS, st.text(max_size=3)))
def test_depth_cap_is_exact_and_keeps_an_integer_id(depth: int, lists: bool, rid: Any) -> None:
    """The header is level 1; a container at level 33 is refused, and the refusal
    still carries the header's id when that is an integer (not a bool)."""
    leaf: Any = 0
    for _ in range(depth - 1):
        leaf = [leaf] if lists else {"k": leaf}
    raw = transport.encode({"id": rid, "x": leaf} if depth > 1 else {"id": rid})
    if depth <= transport.MAX_DEPTH:
        assert transport.decode(raw)["id"] == rid
        return
    with pytest.raises(transport.TooDeep) as err:
        transport.decode(raw)
    assert err.value.req_id == (rid if type(rid) is int else None)


@PROPS
@given(st.integers(0, 600), st.integers(1, 600))
def test_size_cap_is_checked_before_parsing(size: int, cap: int) -> None:
    raw = transport.encode({"pad": "x" * size})
    if len(raw) > cap:
        with pytest.raises(transport.HeaderTooLarge):
            transport.decode(raw, max_bytes=cap)
    else:
        assert transport.decode(raw, max_bytes=cap)["pad"] == "x" * size


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _same(a: Any, b: Any) -> bool:
    """Equality that takes NaN as equal to itself (msgpack keeps NaN a NaN)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# -- frames --------------------------------------------------------------------

FRAME_FIELDS = ("version", "producer_stage", "layer_start", "layer_end", "token_count")
FRAME_FIELDS += ("sequence_count", "positions", "parts")
PART_FIELDS = ("identity", "dtype", "dims", "byte_strides", "token_axis", "buffer", "offset")
PART_FIELDS += ("nbytes",)
DESCRIPTOR_VALUES = st.one_of(
    WIRE_INTS,
    st.lists(WIRE_INTS, max_size=9),
    st.lists(st.integers(-8, 64), min_size=1, max_size=4),
    SCALARS,
)


@st.composite
def hostile_frames(draw: st.DrawFn) -> tuple[Any, list[bytes]]:
    """A valid frame's header with fields replaced by hostile values, and its
    buffers cut short, grown, dropped or replaced."""
    dtype = draw(st.sampled_from(sorted(frames.DTYPES)))
    dims = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
    arr = np.zeros(dims, frames.DTYPES[dtype])
    out: list[Any] = []
    header: Any = frames.attach(frames.make_frame([("x", arr, 0, dtype)], positions=None), out)
    part = header["parts"][0]
    for name in draw(st.lists(st.sampled_from(PART_FIELDS), max_size=3)):
        part[name] = draw(DESCRIPTOR_VALUES)
    for name in draw(st.lists(st.sampled_from(FRAME_FIELDS), max_size=2)):
        header[name] = draw(st.one_of(DESCRIPTOR_VALUES, st.just([part, part])))
    if draw(st.booleans()):
        header["parts"] = [part, dict(part)] if draw(st.booleans()) else [part]
    buffers = [bytes(b) for b in out]
    if draw(st.booleans()):
        buffers = draw(st.lists(st.binary(max_size=80), max_size=3))
    return header, buffers


@PROPS
@given(hostile_frames())
def test_any_descriptor_parses_to_a_readable_frame_or_a_fault(
    case: tuple[Any, list[bytes]],
) -> None:
    header, buffers = case
    frame = _fault_or(lambda: frames.parse(header, [memoryview(b) for b in buffers]))
    if frame is None:
        return
    for p in frame.parts:  # every accepted part lies inside its buffer: numpy agrees
        data = frame.array(p.identity).tobytes()
        assert len(data) == p.nbytes
    out: list[Any] = []
    again = frames.parse(frames.attach(frame, out), out)  # what we accept, we can send
    assert again.identities == frame.identities


@PROPS
@given(hostile_frames(), WIRE_INTS, WIRE_INTS)
def test_slicing_an_accepted_frame_anywhere_is_a_frame_or_a_fault(
    case: tuple[Any, list[bytes]], start: int, end: int
) -> None:
    frame = _fault_or(lambda: frames.parse(case[0], case[1]))
    if frame is not None:
        part = _fault_or(lambda: frame_chunks.slice_frame(frame, start, end))
        assert part is None or part.token_count == end - start


# -- validators ----------------------------------------------------------------


@PROPS
@given(VALUES)
def test_scalar_validators_give_their_type_or_a_fault(value: Any) -> None:
    args = {"x": value}
    got = _fault_or(lambda: validate.get_int(args, "x", lo=-5, hi=2**40))
    assert got is None or (type(got) is int and -5 <= got <= 2**40)
    got = _fault_or(lambda: validate.read_fields(args, {"x": validate.Num(0.5, -1.0, 1.0)})["x"])
    assert got is None or (type(got) is float and -1.0 <= got <= 1.0)
    got = _fault_or(lambda: validate.get_bool(args, "x", False))
    assert got is None or type(got) is bool
    got = _fault_or(lambda: validate.get_str(args, "x", max_len=8))
    assert got is None or (type(got) is str and len(got) <= 8)
    got = _fault_or(lambda: validate.check_token(value, 100, "x"))
    assert got is None or (type(got) is int and 0 <= got < 100)
    got = _fault_or(lambda: validate.get_tokens(args, "x", 100, max_len=4))
    assert got is None or all(type(t) is int and 0 <= t < 100 for t in got)
    got = _fault_or(lambda: validate.check_session(value))
    assert got is None or (type(got) is str and 0 < len(got) <= 256)
    got = _fault_or(lambda: validate.get_outputs({"output": value}))
    assert got is None or set(got) <= {"hidden", "logits"}
    got = _fault_or(lambda: validate.get_outputs({"return_logits": value}))
    assert got is None or got in ((), ("logits",))


SAMPLING_MAPS = st.dictionaries(
    st.one_of(st.sampled_from(SAMPLING), st.text(max_size=6)),
    st.one_of(VALUES, st.floats(-200, 200), st.integers(-2, 70)),
    max_size=6,
)


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    with structlog.testing.capture_logs():  # the edge logs every refusal
        yield Harness()


@FEW
@given(st.one_of(SAMPLING_MAPS, VALUES))
def test_sampling_is_a_spec_or_a_fault(harness: Harness, raw: Any) -> None:
    """With llama.cpp's own grammar parser behind ``grammar`` / ``json_schema``."""
    _fault_or(lambda: get_sampling({"sampling": raw}))
    _fault_or(lambda: get_sampling({"sampling": raw}, grammars=harness.app.grammars))


# -- every handler, through the edge -------------------------------------------


@st.composite
def requests(draw: st.DrawFn, ops: list[str]) -> bytes:
    """One structured fuzz input for ``Harness.check``: an op, buffers, args."""
    op = draw(st.sampled_from(ops))
    args = draw(st.one_of(st.dictionaries(KEYS, VALUES, max_size=6), VALUES))
    session = draw(st.one_of(st.none(), st.sampled_from(["s", "x" * 256])))
    header: dict[str, Any] = {"v": 1, "id": 7, "op": op, "args": args}
    if session is not None:
        header["session"] = session
    return b"\x00" + msgpack.packb(header, use_bin_type=True)


@FEW
@given(st.data())
def test_every_handler_answers_arbitrary_args_with_a_stable_code(
    harness: Harness, data: st.DataObject
) -> None:
    for edge_ops in [ops for _, ops in harness.services]:
        harness.check(data.draw(requests(edge_ops)))


@settings(max_examples=40, deadline=None, database=None)
@given(st.integers(0, 2**32 - 1))
def test_near_valid_requests_of_the_live_fuzzer_pass_in_process(
    harness: Harness, seed: int
) -> None:
    """``scripts/fuzz.py``'s own cases (valid headers, mutated args, hostile
    frames) through the in-process path: the same verdict without a worker."""
    ops = tuple(op for op in harness.services[0][1] if op not in ("info", "stats"))
    gen = Generator(Target("worker", ops, 4 << 20, 262_144, 640, 1024, 4), seed)
    for i in range(10):
        case = gen.case(i)
        if case.kind == "big":
            continue
        for message in case.messages:
            harness.check_message(0, message.frames)
