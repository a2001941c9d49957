"""``streams.poison``: a try counts as failed from its start, so a process that dies in it leaves the count
behind, in its file, for the next process (the torchrun group restarted around a follower's crash)."""

from streams.poison import DIED, PoisonCounts

KEY = ("t.trainer-batches", 0, 7)


def test_a_try_that_never_ends_counts_and_outlives_its_process(tmp_path):
    path = tmp_path / "trainer-host-0.json"
    first = PoisonCounts(path)
    first.start(KEY)  # the process dies here: nothing more from it
    assert PoisonCounts(path).get(KEY) == (1, DIED)
    second = PoisonCounts(path)
    second.start(KEY)
    second.ended(KEY, RuntimeError("gloo: connection closed by peer"))
    assert PoisonCounts(path).get(KEY) == (2, "RuntimeError: gloo: connection closed by peer")


def test_a_try_that_ends_well_or_for_the_environment_is_given_back(tmp_path):
    counts = PoisonCounts(tmp_path / "c.json")
    counts.start(KEY)
    counts.ended(KEY, ValueError("bad"))
    counts.start(KEY)
    counts.ended(KEY, None)  # went well (or the disk was full): the earlier failure stays, this try does not count
    assert PoisonCounts(tmp_path / "c.json").get(KEY) == (1, "ValueError: bad")
    other = ("t.trainer-batches", 0, 8)
    counts.start(other)
    counts.ended(other, None)
    assert PoisonCounts(tmp_path / "c.json").get(other) == (0, "")


def test_a_commit_past_a_record_forgets_it_and_memory_only_counts_are_the_same(tmp_path):
    for counts in (PoisonCounts(tmp_path / "c.json"), PoisonCounts()):
        counts.start(KEY)
        counts.ended(KEY, ValueError("bad"))
        counts.forget({0: {"t.trainer-batches": 7}})
        assert counts.get(KEY)[0] == 1
        counts.forget({0: {"t.trainer-batches": 8}})
        assert not counts and counts.get(KEY) == (0, "")
    assert PoisonCounts(tmp_path / "c.json").get(KEY) == (0, "")
