"""Replay's fast decoder (``replay.frames``) agrees with the models: for any input, the same replay rows, or
the same refusal (``EventDecodeError`` type and message) as ``schemas.codec.decode``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from replay import columns as C
from replay import frames, record_sets
from schemas import codec
from schemas.errors import EventDecodeError
from schemas.events import Step

sys.path.insert(0, str(Path(__file__).parent))
from _contract_factories import fixture_events  # noqa: E402
from test_schema_evolution import FUZZ, _frames, _reframe, _split, json_values  # noqa: E402

META = C.Meta("t", 0, 7, 1_700_000_000_000)


def outcome(decode, frame: bytes) -> tuple:
    """What replay would store for this frame: its rows in every table, or the refusal."""
    try:
        event = decode(frame)
    except EventDecodeError as e:
        return ("refused", type(e).__name__, str(e))
    try:
        tables = C.BUILDERS[event.event_type]([event], [META])
    except Exception as e:  # noqa: BLE001 - a value no column can hold fails alike on both paths
        return ("unbuildable", type(e).__name__)
    return ("rows", event.event_type, {name: repr(t.to_pylist()) for name, t in sorted(tables.items())})


def native_outcome(frame: bytes) -> tuple:
    """What replay stores when the compiled reader (replay.record_sets) meets the frame: its row, or, where it
    leaves the frame to Python, the Python decoder's outcome."""
    cols = record_sets.native_reader().StepColumns()
    if cols.push_frame(frame, META.topic, META.partition, META.offset, META.timestamp_ms):
        return ("rows", "step", {"steps": repr(record_sets.step_table(cols).to_pylist())})
    return outcome(frames.decode, frame)


def assert_same(frame: bytes) -> tuple:
    fast, model, native = outcome(frames.decode, frame), outcome(codec.decode, frame), native_outcome(frame)
    assert fast == model
    assert native == model
    return fast


def test_the_common_event_types_have_a_fast_path() -> None:
    assert {"step", "rollout", "rollout_scored", "policy_revision"} <= set(frames.fast_types())


def test_every_fixture_event_gives_the_same_rows() -> None:
    fast = 0
    for event in fixture_events().values():
        frame = codec.encode(event)
        assert assert_same(frame)[0] == "rows"
        fast += isinstance(frames.decode(frame), msgspec.Struct)
    assert fast >= 4  # the fast path really ran (structs, not models)


def test_the_compiled_reader_takes_the_common_steps() -> None:
    """Built by .ci/setup (pip install ./native); its columns are replay.tables.STEPS'."""
    assert record_sets.native_reader() is not None, "rollout_native is not built: run `pip install ./native`"
    record_sets.check_columns()
    step = codec.encode(fixture_events()["step"])
    assert record_sets.native_reader().StepColumns().push_frame(step, "t", 0, 0, 0)
    for frame in _frames():
        if frame[6:6 + frame[5]] == b"step":
            assert record_sets.native_reader().StepColumns().push_frame(frame, "t", 0, 0, 0)


def test_checked_in_frames_give_the_same_rows() -> None:
    for frame in _frames():
        assert assert_same(frame)[0] == "rows"


@pytest.mark.parametrize("created_at", [
    "2026-11-24T00:04:41.123456789Z",  # msgspec would round the 7th digit, pydantic truncates it
    "2026-11-24t00:04:41z", "2026-11-24T00:04Z", "2026-11-24T00:04:41", "2026-02-29T00:00:00Z",
    "2026-11-24T00:04:41,5Z", "2026-11-24T00:04:41+23:59", "2026-11-24T00:04:41-00:00", 1_700_000_000,
    "٢٠٢٦-11-24T00:04:41Z"])
def test_datetimes_only_take_the_fast_path_where_both_parsers_agree(created_at) -> None:
    kind, header, blobs = _split(codec.encode(fixture_events()["step"]))
    header["created_at"] = created_at
    assert_same(_reframe(kind, json.dumps(header).encode(), blobs))


@pytest.mark.parametrize("field,value", [
    ("index", 1.0), ("index", "1"), ("index", -1), ("index", 2**70), ("trainable", 1), ("latency_s", -0.5),
    ("policy", None), ("member_id", ""), ("schema_version", 2), ("event_type", "rollout"), ("event_id", None),
    ("prompt", [{"role": "robot"}]), ("prompt", [{"role": "user", "extra": 1}]), ("unknown_field", 1),
    ("completion_logprobs", {"$blob": [0, 3]}), ("completion_token_ids", {"$blob": [0, 10**9]}),
    ("completion_token_ids", {"$blob": [0, 1], "x": 1}), ("policy", {"family": "f", "revision": 0,
                                                                     "checkpoint_digest": "a" * 64 + "\n"})])
def test_malformed_steps_are_refused_alike(field, value) -> None:
    kind, header, blobs = _split(codec.encode(fixture_events()["step"]))
    header[field] = value
    assert_same(_reframe(kind, json.dumps(header).encode(), blobs))


def test_a_missing_defaulted_field_still_decodes_through_the_model() -> None:
    kind, header, blobs = _split(codec.encode(fixture_events()["step"]))
    del header["event_id"]  # the model draws a new id; the fast path leaves it to the model
    assert isinstance(frames.decode(_reframe(kind, json.dumps(header).encode(), blobs)), Step)


@FUZZ
@given(which=st.integers(0, 6), data=st.data())
def test_fields_replaced_by_arbitrary_json_give_the_same_outcome(which: int, data: st.DataObject) -> None:
    kind, header, blobs = _split(_frames()[which])
    key = data.draw(st.sampled_from(sorted(header)))
    header[key] = data.draw(json_values)
    assert_same(_reframe(kind, json.dumps(header).encode(), blobs))


@FUZZ
@given(which=st.integers(0, 6), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                             min_size=1, max_size=8))
def test_corrupted_frames_give_the_same_outcome(which: int, flips: list[tuple[int, int]]) -> None:
    frame = bytearray(_frames()[which])
    for pos, byte in flips:
        frame[pos % len(frame)] = byte
    assert_same(bytes(frame))


@FUZZ
@given(latency=st.floats(min_value=0, allow_nan=False, allow_infinity=False) | st.integers(0, 2**64))
def test_every_latency_reads_back_to_the_same_double(latency) -> None:
    """JSON numbers are parsed alike: a float the compiled reader rounded differently is a different row."""
    kind, header, blobs = _split(codec.encode(fixture_events()["step"]))
    header["latency_s"] = latency
    assert_same(_reframe(kind, json.dumps(header).encode(), blobs))
