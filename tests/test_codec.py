"""The binary frame: round trips are bit-exact, arrays are zero-copy, bad events are refused."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from pydantic import ValidationError

from schemas import codec
from schemas.batch import assemble_batch
from schemas.errors import EventDecodeError
from schemas.events import DeadLetter, Step, TrainerBatch, TrainingRecord

sys.path.insert(0, str(Path(__file__).parent))
from _contract_factories import T0, record, revision, rollout, step  # noqa: E402

# Any 32-bit pattern as a float32: every NaN payload, both infinities, -0.0, subnormals.
float32_bits = hnp.arrays(np.dtype("<u4"), st.integers(0, 2048),
                          elements=st.integers(0, 2**32 - 1)).map(lambda a: a.view("<f4"))
SPECIALS = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, np.finfo(np.float32).tiny / 2,
                     np.finfo(np.float32).max], dtype="<f4")
token_ids = st.integers(0, 2048).flatmap(
    lambda n: hnp.arrays(np.dtype("<i4"), n, elements=st.integers(-2**31, 2**31 - 1)))

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(a: np.ndarray) -> bytes:
    return a.dtype.str.encode() + a.tobytes()


@SETTINGS
@given(lps=float32_bits)
def test_step_round_trip_is_bit_exact(lps: np.ndarray) -> None:
    ids = np.arange(len(lps), dtype="<i4") * 7919
    s = step(len(lps), logprobs=lps, token_ids=ids)
    frame = codec.encode(s)
    back = codec.decode(frame, expect=Step)
    assert back == s
    assert bits(back.completion_logprobs) == bits(lps)
    assert bits(back.completion_token_ids) == bits(ids)
    assert codec.encode(back) == frame  # re-encoding is byte-identical


@SETTINGS
@given(ids=token_ids)
def test_step_token_ids_cover_the_int32_range(ids: np.ndarray) -> None:
    lps = np.zeros(len(ids), dtype="<f4")
    back = codec.decode(codec.encode(step(len(ids), logprobs=lps, token_ids=ids)))
    assert bits(back.completion_token_ids) == bits(ids)


def test_special_floats_survive_exactly() -> None:
    s = step(len(SPECIALS), logprobs=SPECIALS)
    back = codec.decode(codec.encode(s))
    assert bits(back.completion_logprobs) == bits(SPECIALS)
    assert np.signbit(back.completion_logprobs[3])  # -0.0 kept its sign
    assert np.isnan(back.completion_logprobs[0])


def test_decoded_arrays_are_zero_copy_read_only_views() -> None:
    frame = codec.encode(step(8192))
    back = codec.decode(frame)
    arr = back.completion_logprobs
    assert not arr.flags.writeable
    assert arr.base is not None and not arr.flags.owndata
    base = np.frombuffer(frame, dtype="u1").ctypes.data
    for a in (back.completion_token_ids, back.completion_logprobs, back.prompt_token_ids):
        offset = a.ctypes.data - base
        assert 0 < offset < len(frame) and offset % 8 == 0  # a view into the frame, 8-byte aligned


@SETTINGS
@given(lps=float32_bits.filter(len), reward=st.floats(allow_nan=False, allow_infinity=False, width=64),
       advantage=st.floats(allow_nan=False, allow_infinity=False))
def test_training_record_round_trip(lps: np.ndarray, reward: float, advantage: float) -> None:
    r = record(3, n_tokens=len(lps), logprobs=lps, reward=reward, advantage=advantage)
    back = codec.decode(codec.encode(r), expect=TrainingRecord)
    assert back == r
    assert bits(back.completion_logprobs) == bits(lps)
    assert back.reward == reward and back.advantage == advantage


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=24), data=st.data())
def test_trainer_batch_round_trip(lengths: list[int], data: st.DataObject) -> None:
    records = []
    for i, n in enumerate(lengths):
        lps = data.draw(hnp.arrays(np.dtype("<u4"), n, elements=st.integers(0, 2**32 - 1))).view("<f4")
        records.append(record(i, rev=data.draw(st.integers(3, 5)), n_tokens=n, logprobs=lps))
    batch = assemble_batch(records, revision(5), 2, run_id="run-1", producer="batcher-0")
    frame = codec.encode(batch)
    back = codec.decode(frame, expect=TrainerBatch)
    assert back == batch
    for got, want in zip(back.records, batch.records):
        assert bits(got.completion_logprobs) == bits(want.completion_logprobs)
        assert bits(got.completion_token_ids) == bits(want.completion_token_ids)
        assert bits(got.loss_mask) == bits(want.loss_mask)
    assert back.batch_digest == batch.batch_digest and back.lineage_digest == batch.lineage_digest
    assert codec.encode(back) == frame


def test_every_event_type_round_trips() -> None:
    batch = assemble_batch([record(0), record(1)], revision(0), 0, run_id="run-1", producer="b")
    dead = DeadLetter(run_id="run-1", producer="verifier-0", created_at=T0, origin_topic="rollouts",
                      origin_partition=3, origin_offset=42, origin_key=b"\x00\xffkey", raw=b"RLEV\x01garbage",
                      error_type="EventDecodeError", error_message="truncated", service="verifier")
    for event in (revision(1), step(), rollout(), record(), batch, dead):
        back = codec.decode(codec.encode(event))
        assert type(back) is type(event) and back == event
        assert codec.peek(codec.encode(event)) == (event.EVENT_TYPE, event.SCHEMA_VERSION)


def test_expect_refuses_another_type() -> None:
    with pytest.raises(EventDecodeError, match="expected a step event"):
        codec.decode(codec.encode(record()), expect=Step)


# -- refusals at construction ---------------------------------------------------------------------


def test_misaligned_step_lengths_are_refused() -> None:
    with pytest.raises(ValidationError, match="same length"):
        step(4, logprobs=np.zeros(3, dtype="<f4"))


def test_misaligned_record_lengths_are_refused() -> None:
    with pytest.raises(ValidationError, match="same length"):
        record(n_tokens=5, logprobs=np.zeros(4, dtype="<f4"))


def test_record_without_tokens_is_refused() -> None:
    with pytest.raises(ValidationError, match="no completion tokens"):
        record(n_tokens=0, logprobs=np.zeros(0, dtype="<f4"))


def test_trainable_step_must_name_its_policy() -> None:
    s = step()
    with pytest.raises(ValidationError, match="policy revision"):
        Step(**{**dict(s), "policy": None})


def test_failed_rollout_without_reason_is_refused() -> None:
    with pytest.raises(ValidationError, match="failure_reason"):
        rollout(status="failed", failure_reason=None)
    assert rollout(status="failed", failure_reason="env crashed", step_ids=[]).status == "failed"


def test_empty_rollout_is_refused() -> None:
    with pytest.raises(ValidationError, match="empty rollout"):
        rollout(step_ids=[])
    assert rollout(step_ids=[], child_rollout_ids=["child-1"]).child_rollout_ids == ["child-1"]


def test_misaligned_frame_is_refused_on_decode() -> None:
    """A frame whose logprob blob reference disagrees with the token count fails validation on decode."""
    frame = bytearray(codec.encode(step(4)))
    header = frame.decode("latin-1")
    pos = header.index('"completion_logprobs":{"$blob":[')
    start = header.index(",", pos + len('"completion_logprobs":{"$blob":[')) + 1
    assert frame[start:start + 1] == b"4"
    frame[start:start + 1] = b"3"
    with pytest.raises(EventDecodeError, match="same length"):
        codec.decode(bytes(frame))


def test_decoding_a_mutable_buffer_does_not_alias_it() -> None:
    """Regression: arrays decoded from a bytearray were writable views of the caller's buffer."""
    buf = bytearray(codec.encode(step(4)))
    event = codec.decode(buf)
    buf[-64:] = b"\xff" * 64
    assert event.completion_token_ids.tolist() == [0, 1, 2, 3]
    assert not event.completion_token_ids.flags.writeable
    frame = bytes(codec.encode(step(4)))
    assert codec.decode(memoryview(frame)).completion_token_ids.base is not None  # bytes stay zero-copy


def test_an_array_is_shared_only_when_nothing_can_change_it() -> None:
    """Building an event from another event's arrays shares them (no copy per hop); an array someone could
    still write, directly or through a writable base, is copied."""
    decoded = codec.decode(codec.encode(step(16)))
    again = step(16, token_ids=decoded.completion_token_ids)
    assert np.shares_memory(again.completion_token_ids, decoded.completion_token_ids)  # a frame's view: shared
    assert np.shares_memory(step(16, token_ids=again.completion_token_ids).completion_token_ids,
                            decoded.completion_token_ids)
    mutable = np.arange(16, dtype="<i4")
    copied = step(16, token_ids=mutable)
    mutable[0] = 99
    assert copied.completion_token_ids[0] == 0
    # a read-only view of a writable array is no promise: the owner can still write through the base
    view = mutable.view()
    view.flags.writeable = False
    through_base = step(16, token_ids=view)
    mutable[1] = 99
    assert through_base.completion_token_ids[1] == 1


def test_event_ids_are_uuid4_hex_and_differ_across_a_fork() -> None:
    import os
    import uuid

    from schemas.envelope import new_id

    ids = [new_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    for i in ids[:100]:
        u = uuid.UUID(i)
        assert (u.hex, u.version, u.variant) == (i, 4, uuid.RFC_4122)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's next ids must not repeat the parent's (its generator is seeded again)
        os.write(w, "".join(new_id() for _ in range(4)).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(r, 4096).decode()
    parent = "".join(new_id() for _ in range(4))
    assert len(child) == len(parent) == 128 and child != parent
