"""Contract evolution: exported JSON Schemas are pinned, old frames keep decoding (upcast when a
version is bumped), future versions are refused clearly, and no malformed input escapes as
anything but an EventDecodeError."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import Field

from schemas import codec, export_jsonschema
from schemas.errors import EventDecodeError, UnknownEventTypeError, UnknownSchemaVersionError
from schemas.events import ALL_EVENTS, EVENTS_BY_TYPE, Step, TrainingRecord

sys.path.insert(0, str(Path(__file__).parent))
from _contract_factories import FIXTURE_LOGPROBS, T0, fixture_events, record, step  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "events"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(a: np.ndarray) -> bytes:
    return a.dtype.str.encode() + a.tobytes()


# -- exported JSON Schemas ------------------------------------------------------------------------


def test_checked_in_json_schemas_match_the_models() -> None:
    """Fails on any unintended contract change. If the change is intended: run
    ``python -m schemas.export_jsonschema`` and commit the diff (with a version bump and an
    upcaster when old readers or old frames are affected)."""
    diffs = export_jsonschema.differences()
    assert diffs == [], (f"{diffs}: the event models changed. If intended, run `python -m schemas.export_jsonschema` "
                         "and commit the JSON Schema diff (bump SCHEMA_VERSION + add an upcaster if old frames break)")
    on_disk = {p.name for p in export_jsonschema.SCHEMA_DIR.glob("*.json")}
    assert {export_jsonschema.filename(cls) for cls in ALL_EVENTS} <= on_disk


def test_schema_pins_type_version_and_array_encoding() -> None:
    schema = json.loads((export_jsonschema.SCHEMA_DIR / "step.v1.json").read_text())
    assert schema["x-event-type"] == "step" and schema["x-schema-version"] == 1
    assert schema["properties"]["event_type"]["const"] == "step"
    assert schema["properties"]["completion_logprobs"]["contentEncoding"] == "base64"
    assert schema["additionalProperties"] is False


def test_export_check_mode_reports_a_drift(tmp_path: Path) -> None:
    assert export_jsonschema.main(["--dir", str(tmp_path)]) == 0
    assert export_jsonschema.main(["--check", "--dir", str(tmp_path)]) == 0
    (tmp_path / "step.v1.json").write_text("{}\n")
    assert export_jsonschema.main(["--check", "--dir", str(tmp_path)]) == 1


# -- checked-in frames ----------------------------------------------------------------------------


def test_every_event_type_has_a_checked_in_frame() -> None:
    missing = {f"{cls.EVENT_TYPE}.v{cls.SCHEMA_VERSION}.bin" for cls in ALL_EVENTS} - {
        p.name for p in FIXTURES.glob("*.bin")}
    assert not missing, (f"no checked-in frame for {sorted(missing)}: add the event to fixture_events() in "
                         "tests/_contract_factories.py and run `python tests/fixtures/events/make_fixtures.py`")


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.bin")), ids=lambda p: p.name)
def test_checked_in_frames_still_decode(path: Path) -> None:
    event_type, version = path.stem.rsplit(".v", 1)
    frame = path.read_bytes()
    assert codec.peek(frame) == (event_type, int(version))
    event = codec.decode(frame)
    assert event.EVENT_TYPE == event_type
    assert event.event_id and event.created_at == T0 and event.run_id == "run-1"
    expected = fixture_events()[event_type]
    assert event == expected, f"{path.name} no longer decodes to the fixture's values"


def test_checked_in_frames_field_values() -> None:
    """Literal expectations, independent of the factory, for the token-carrying events."""
    step_ev = codec.decode((FIXTURES / "step.v1.bin").read_bytes(), expect=Step)
    assert step_ev.event_id == "ev-step-1" and step_ev.step_id == "step-1" and step_ev.member_id == "solver"
    assert step_ev.completion_token_ids.tolist() == [53, 10, 0, 255, 2**31 - 1, 7]
    assert bits(step_ev.completion_logprobs) == bits(FIXTURE_LOGPROBS)
    assert step_ev.completion_logprobs.view("<u4").tolist()[:4] == [0xBF000000, 0x80000000, 0x7FC00000, 0xFF800000]
    assert str(step_ev.policy) == "tiny-byte-lm@r3" and step_ev.latency_s == 0.25

    rec = codec.decode((FIXTURES / "training_record.v1.bin").read_bytes(), expect=TrainingRecord)
    assert (rec.record_id, rec.reward, rec.advantage, rec.credit) == ("rec-00000", 1.0, 0.75, "grpo")
    assert rec.loss_mask.tolist() == [1] * 6 and rec.environment == "arithmetic@1"

    batch = codec.decode((FIXTURES / "trainer_batch.v1.bin").read_bytes())
    assert [r.record_id for r in batch.records] == ["rec-00000", "rec-00001"]
    assert [(s.policy.revision, s.records) for s in batch.source_revisions] == [(3, 1), (4, 1)]
    assert batch.batch_digest == fixture_events()["trainer_batch"].batch_digest
    assert batch.batch_id.startswith("tiny-byte-lm-r4-")

    dead = codec.decode((FIXTURES / "dead_letter.v1.bin").read_bytes())
    assert dead.raw == b"RLEV\x01\x04junk" and dead.origin_key == b"group-1"


# -- upcasting: the mechanism, shown with a test-only version 2 -----------------------------------


def _v1_to_v2(body: dict) -> dict:
    """v2 renamed ``credit`` to ``credit_strategy`` and added ``kl_coef`` (0.0 for old records)."""
    body = dict(body)
    body["credit_strategy"] = body.pop("credit")
    body.setdefault("kl_coef", 0.0)
    return body


class TrainingRecordV2(TrainingRecord):
    """Test-only: what a bump of TrainingRecord to schema version 2 would look like."""

    SCHEMA_VERSION: ClassVar[int] = 2
    UPCASTERS: ClassVar[dict] = {1: _v1_to_v2}

    credit: str | None = None  # type: ignore[assignment]  # superseded by credit_strategy
    credit_strategy: str
    kl_coef: float = Field(ge=0)


def test_old_frame_is_upcast_to_the_new_version(monkeypatch: pytest.MonkeyPatch) -> None:
    v1_frame = (FIXTURES / "training_record.v1.bin").read_bytes()
    monkeypatch.setitem(EVENTS_BY_TYPE, "training_record", TrainingRecordV2)
    event = codec.decode(v1_frame)
    assert type(event) is TrainingRecordV2 and event.schema_version == 2
    assert event.credit_strategy == "grpo" and event.kl_coef == 0.0 and event.credit is None
    assert bits(event.completion_logprobs) == bits(FIXTURE_LOGPROBS)  # arrays still zero-copy from the v1 frame
    assert event.record_id == "rec-00000" and event.policy.revision == 3
    # a v2 frame round-trips natively, with the new version in its header
    v2_frame = codec.encode(event)
    assert codec.peek(v2_frame) == ("training_record", 2)
    assert codec.decode(v2_frame) == event


def test_a_v1_reader_refuses_the_v2_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(EVENTS_BY_TYPE, "training_record", TrainingRecordV2)
    v2_frame = codec.encode(codec.decode((FIXTURES / "training_record.v1.bin").read_bytes()))
    monkeypatch.setitem(EVENTS_BY_TYPE, "training_record", TrainingRecord)
    with pytest.raises(UnknownSchemaVersionError, match="version 2 is newer than this reader's 1"):
        codec.decode(v2_frame)


def test_missing_upcaster_is_a_decode_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class TrainingRecordV3(TrainingRecordV2):
        SCHEMA_VERSION: ClassVar[int] = 3  # forgot UPCASTERS[2]

    monkeypatch.setitem(EVENTS_BY_TYPE, "training_record", TrainingRecordV3)
    with pytest.raises(EventDecodeError, match="no upcaster for training_record v2 -> v3"):
        codec.decode((FIXTURES / "training_record.v1.bin").read_bytes())


# -- refusals of versions and types ---------------------------------------------------------------


def _with_version(frame: bytes, version: int) -> bytes:
    type_len = frame[5]
    pos = 6 + type_len
    return frame[:pos] + struct.pack("<H", version) + frame[pos + 2:]


@pytest.mark.parametrize("cls", ALL_EVENTS, ids=lambda c: c.EVENT_TYPE)
def test_unknown_future_version_is_refused_clearly(cls) -> None:
    frame = (FIXTURES / f"{cls.EVENT_TYPE}.v1.bin").read_bytes()
    future = _with_version(frame, cls.SCHEMA_VERSION + 1)
    assert codec.peek(future) == (cls.EVENT_TYPE, cls.SCHEMA_VERSION + 1)
    with pytest.raises(UnknownSchemaVersionError) as info:
        codec.decode(future)
    msg = str(info.value)
    assert cls.EVENT_TYPE in msg and f"version {cls.SCHEMA_VERSION + 1}" in msg and "upgrade" in msg
    with pytest.raises(UnknownSchemaVersionError):
        codec.decode(_with_version(frame, 65535))


def test_version_zero_and_frame_version_are_refused() -> None:
    frame = (FIXTURES / "step.v1.bin").read_bytes()
    with pytest.raises(EventDecodeError, match="not a valid version"):
        codec.decode(_with_version(frame, 0))
    with pytest.raises(UnknownSchemaVersionError, match="frame version 2"):
        codec.decode(frame[:4] + b"\x02" + frame[5:])


def test_unknown_event_type_is_refused() -> None:
    frame = (FIXTURES / "step.v1.bin").read_bytes()
    forged = frame[:6] + b"stop" + frame[10:]  # same length as "step"
    with pytest.raises(UnknownEventTypeError, match="unknown event type 'stop'"):
        codec.decode(forged)


# -- malformed bytes: always EventDecodeError -----------------------------------------------------


def _frames() -> list[bytes]:
    return [p.read_bytes() for p in sorted(FIXTURES.glob("*.bin"))]


def assert_decodes_or_refuses(data: bytes) -> None:
    try:
        codec.decode(data)
    except EventDecodeError:
        pass  # the only acceptable failure; anything else propagates and fails the test


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        codec.decode(data)


@FUZZ
@given(data=st.binary(max_size=256))
def test_random_bytes_after_a_valid_prefix_are_refused(data: bytes) -> None:
    kind = b"step"
    head = b"RLEV\x01" + bytes([len(kind)]) + kind + struct.pack("<HI", 1, len(data))
    with pytest.raises(EventDecodeError):
        codec.decode(head + data)


def test_every_truncation_of_every_frame_is_refused() -> None:
    for frame in _frames():
        for cut in range(len(frame)):
            assert_decodes_or_refuses(frame[:cut])
        # cuts inside the header can never decode
        header_end = 6 + frame[5] + 6 + struct.unpack_from("<I", frame, 6 + frame[5] + 2)[0]
        for cut in range(header_end):
            with pytest.raises(EventDecodeError):
                codec.decode(frame[:cut])


@FUZZ
@given(which=st.integers(0, 6), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                             min_size=1, max_size=8))
def test_corrupted_frames_are_refused_or_decode(which: int, flips: list[tuple[int, int]]) -> None:
    frame = bytearray(_frames()[which])
    for pos, byte in flips:
        frame[pos % len(frame)] = byte
    assert_decodes_or_refuses(bytes(frame))


def _reframe(kind: str, header: bytes, blobs: bytes = b"") -> bytes:
    k = kind.encode()
    prefix = b"RLEV\x01" + bytes([len(k)]) + k + struct.pack("<HI", 1, len(header))
    return prefix + header + b"\0" * (-(len(prefix) + len(header)) % 8) + blobs


def _split(frame: bytes) -> tuple[str, dict, bytes]:
    type_len = frame[5]
    kind = frame[6:6 + type_len].decode()
    pos = 6 + type_len
    _, header_len = struct.unpack_from("<HI", frame, pos)
    pos += 6
    header = frame[pos:pos + header_len]
    blob_start = pos + header_len + (-(pos + header_len) % 8)
    return kind, json.loads(header), frame[blob_start:]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


@FUZZ
@given(which=st.integers(0, 6), data=st.data())
def test_fields_replaced_by_arbitrary_json_are_refused_or_decode(which: int, data: st.DataObject) -> None:
    kind, header, blobs = _split(_frames()[which])
    key = data.draw(st.sampled_from(sorted(header)))
    header[key] = data.draw(json_values)
    assert_decodes_or_refuses(_reframe(kind, json.dumps(header).encode(), blobs))


@FUZZ
@given(offset=st.one_of(st.integers(-2**40, 2**40), json_values),
       count=st.one_of(st.integers(-2**40, 2**40), json_values),
       extra=st.lists(json_values, max_size=2))
def test_blob_references_out_of_range_are_refused(offset, count, extra) -> None:
    kind, header, blobs = _split((FIXTURES / "step.v1.bin").read_bytes())
    header["completion_logprobs"] = {"$blob": [offset, count, *extra]}
    assert_decodes_or_refuses(_reframe(kind, json.dumps(header).encode(), blobs))


@pytest.mark.parametrize("ref", [[0, 10**9], [-8, 1], [10**6, 1], [0, -1], ["0", 1], [0], [0, 1, 2], "x", None,
                                 [0.5, 1], {"a": 1}])
def test_specific_bad_blob_references(ref) -> None:
    kind, header, blobs = _split((FIXTURES / "step.v1.bin").read_bytes())
    header["completion_token_ids"] = {"$blob": ref}
    with pytest.raises(EventDecodeError):
        codec.decode(_reframe(kind, json.dumps(header).encode(), blobs))


@pytest.mark.parametrize("header", [b"", b"{", b"not json", b"[]", b"null", b'{"event_type": "step"}',
                                    b"\xff\xfe{}", b"[" * 10000, b'{"a":' * 5000])
def test_bad_json_is_refused(header: bytes) -> None:
    with pytest.raises(EventDecodeError):
        codec.decode(_reframe("step", header))


def test_valid_frames_still_decode_after_reframing() -> None:
    """The fuzz helpers produce real frames: unmodified, they decode."""
    for frame in _frames():
        kind, header, blobs = _split(frame)
        assert codec.decode(_reframe(kind, json.dumps(header).encode(), blobs)) == codec.decode(frame)
    s = step(3)
    assert codec.decode(codec.encode(s)) == s and codec.decode(codec.encode(record())) == record()
