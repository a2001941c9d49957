"""The admissions ledger's fold (schemas.admission.AdmissionBook): pure, in log order, the same for every reader."""

from __future__ import annotations

import asyncio

import pytest

from producers.arena.pacer import AdmissionPacer
from schemas.admission import (AdmissionBook, AdmissionClaim, AdmissionDone, AdmissionRebase, AdmissionRefund,
                              AdmissionRelease, AdmissionRenew)
from streams.admissions import MemoryLedger

B, BOUND, LEASE = 4, 1, 10.0


def claim(cid: str, *, arena: str = "a", n: int = 4, seen: int = 0, family: str = "f",
          slots: int | None = None) -> AdmissionClaim:
    return AdmissionClaim(run_id="r", producer=arena, claim_id=cid, arena_id=arena, family=family, group_id=cid,
                          rollouts=n, slots=slots, seen_revision=seen, batch_size=B, max_off_policy_steps=BOUND,
                          lease_s=LEASE)


def release(cid: str, arena: str) -> AdmissionRelease:
    return AdmissionRelease(run_id="r", producer=arena, claim_id=cid, arena_id=arena, reason="test")


def fold(*records) -> AdmissionBook:
    book = AdmissionBook()
    for at, event in records:
        book.apply(event, at)
    return book


def test_grants_in_log_order_within_the_bound_and_denies_beyond():
    # (seen - R0 + bound + 1) * B = 8 rollouts at revision 0: two groups of 4; the third waits for revision 1
    book = fold((0, claim("c1")), (1, claim("c2", arena="b")), (2, claim("c3")), (3, claim("c4", seen=1)))
    assert [book.granted(c) for c in ("c1", "c2", "c3", "c4")] == [True, True, False, True]
    assert book.admitted("f") == 12 and book.admitted("other") == 0
    assert not book.grantable("f", 1, 1, B, BOUND) and book.grantable("f", 4, 2, B, BOUND)


def test_the_first_claim_sets_the_base_revision_and_families_are_apart():
    book = fold((0, claim("c1", seen=5)), (1, claim("c2", seen=5)), (2, claim("c3", seen=5)),
                (3, claim("g1", family="g")))
    assert [book.granted(c) for c in ("c1", "c2", "c3", "g1")] == [True, True, False, True]
    assert book.base_revision("f", 0) == 5 and book.base_revision("new", 7) == 7


def test_two_claimers_racing_only_the_one_within_the_bound_is_granted():
    """Both saw room for one more group; the log orders them, every reader agrees on the winner."""
    records = [(0, claim("c1")), (1, claim("a2", arena="a")), (1, claim("b2", arena="b"))]
    assert [fold(*records).granted(c) for c in ("a2", "b2")] == [True, False]
    assert fold(*records).admitted("f") == fold(*records).admitted("f") == 8
    assert fold((0, claim("c1")), (1, claim("c1")), (2, claim("c2"))).granted("c2")  # a repeated claim: once


def test_release_gives_capacity_back_and_done_closes_a_claim():
    book = fold((0, claim("c1")), (1, claim("c2")), (2, AdmissionDone(run_id="r", producer="a", claim_id="c1",
                                                                     arena_id="a")))
    assert not book.grantable("f", 4, 0, B, BOUND)
    book.apply(release("c1", "a"), 3)  # done: nothing to give back
    book.apply(release("c2", "a"), 4)  # the claimer abandons its open claim: at once
    assert book.admitted("f") == 4 and book.grantable("f", 4, 0, B, BOUND)
    book.apply(release("c2", "a"), 5)
    assert book.admitted("f") == 4 and book.claims["c2"].released == "test"


def test_the_batch_for_a_target_owes_the_groups_claimed_at_its_bound_while_they_can_still_come():
    """Target r2 with bound 1: groups claimed having seen r1 or less can be in no later batch. Owed while running
    under a live lease, or done less than the grace ago (their records still in scoring and credit); not once
    released, their arena's lease run out, the grace passed, or claimed at r2 (the next batch takes them)."""
    done = lambda cid, at: (at, AdmissionDone(run_id="r", producer="a", claim_id=cid, arena_id="a"))  # noqa: E731
    book = fold(*[(95.0, c) for c in (claim("c0", n=1), claim("run", n=1), claim("late", n=1, seen=1),
                                       claim("gone", n=1), claim("fresh", n=1, seen=2),
                                       claim("other", n=1, family="g"))],
                done("c0", 100.0), (96.0, release("gone", "a")))  # leases (10 s) run to 105
    assert book.coming("f", 102.0, 5.0, seen_at_most=2 - BOUND) == {"c0", "run", "late"}
    assert book.coming("f", 102.0, 5.0) == {"c0", "run", "late", "fresh"}  # any revision: what a flush waits for
    assert book.coming("f", 105.0, 5.0, seen_at_most=2 - BOUND) == set()  # grace over; leases (10 s) ran out
    book.apply(AdmissionRenew(run_id="r", producer="a", claim_id="run", arena_id="a"), 104.0)
    assert book.coming("f", 105.0, 5.0, seen_at_most=2 - BOUND) == {"run"}  # renewed: its arena is alive
    assert book.coming("f", 105.0, 5.0, seen_at_most=0) == book.coming("f", 105.0, 5.0) == {"run"}
    assert book.coming("g", 100.0, 5.0, seen_at_most=2 - BOUND) == {"other"}


def test_a_gated_group_gives_its_slots_back_once_and_an_unclaimed_group_is_ignored():
    """credit's admission gate kept group c1 out of training: its slots go to the next claim, whether the claim was
    done or not; a second refund, or one for a group no claim names (a sub-episode's), changes nothing."""
    def refund(group: str) -> AdmissionRefund:
        return AdmissionRefund(run_id="r", producer="credit", group_id=group, reason="gate 'zero_advantage'")

    done = AdmissionDone(run_id="r", producer="a", claim_id="c1", arena_id="a")
    full = [(0, claim("c1")), (1, claim("c2")), (2, done)]
    assert not fold(*full).grantable("f", 4, 0, B, BOUND)
    book = fold(*full, (3, refund("c1")), (4, refund("c1")), (5, refund("sub-episode")), (6, claim("c3")))
    assert book.granted("c3") and book.admitted("f") == 8 and not book.held("c1") and book.held("c2")
    assert not fold(*full, (3, refund("c2"))).held("c2")  # still running (no Done): refunded all the same
    # slots claimed at one a rollout come back the same way
    assert fold((0, claim("c1", slots=6)), (1, refund("c1"))).admitted("f", 2.0) == 0


def test_a_rebase_uses_up_the_claims_it_counted_and_slots_are_counted_again_from_its_revision():
    """The batcher flushed a partial batch with nothing coming: the four claims it had folded (16 slots, counted as
    batches up to r4) reached r3 only. After the rebase the book counts from r3 with the claims after those four: the
    arena sees that r4 needs another batch. A used-up claim given back later, a repeated rebase or an older one
    change nothing; a claim folded before the rebase but after the batcher's count still counts."""
    def rebase(revision: int, claims: int) -> AdmissionRebase:
        return AdmissionRebase(run_id="r", producer="batcher", family="f", revision=revision, claims=claims,
                               reason="test")

    claims = [(0, claim("c1")), (1, claim("c2")), (2, claim("c3", seen=1)), (3, claim("c4", seen=2))]
    book = fold(*claims)
    assert book.admitted("f") == 16 and book.base_revision("f", 0) + book.admitted("f") // B == 4
    book.apply(claim("c5", seen=3), 4)  # in the log before the rebase, not yet folded by the batcher
    book.apply(rebase(3, 4), 5)
    assert book.base_revision("f", 0) == 3 and book.admitted("f") == 4 and book.claims_folded("f") == 5
    book.apply(release("c2", "a"), 6)  # used up: its slots already left the count
    book.apply(rebase(3, 4), 7)
    book.apply(rebase(2, 3), 8)
    assert (book.base_revision("f", 0), book.admitted("f")) == (3, 4)
    book.apply(release("c5", "a"), 9)
    assert book.admitted("f") == 0 and book.grantable("f", 8, 3, B, BOUND) and not book.grantable("f", 8, 2, B, BOUND)
    assert fold(*claims, (4, rebase(3, 4))).admitted("g") == 0  # other families untouched


def test_a_group_of_several_records_a_rollout_takes_its_slots():
    """A two-seat game yields 2+ records a rollout: its claims count slots, so the bound holds in records. Counted
    at one a rollout, a two-seat run at bound 0 admitted 2.6 batches of records for each batch (18 refused stale)."""
    book = fold((0, claim("c1", n=2)), (1, claim("c2", n=2, slots=5)), (2, claim("c3", n=1, slots=2)))
    assert [book.granted(c) for c in ("c1", "c2", "c3")] == [True, True, False]  # 2 + 5 + 2 > (0 + 1 + 1) * 4
    assert book.admitted("f") == 7
    assert book.admitted("f", records_per_rollout=2.5) == 10  # c1 counted before the yield was known: 2 x 2.5
    book.apply(release("c2", "a"), 3)
    assert book.admitted("f") == 2 and book.grantable("f", 6, 0, B, BOUND) and not book.grantable("f", 7, 0, B, BOUND)


def test_the_pacer_sizes_a_claim_by_the_records_a_rollout_yielded():
    pacer = AdmissionPacer(B, BOUND)
    assert pacer.slots(4, None) is None and pacer.slots(4, 1.0) is None  # one a rollout: the claim says rollouts
    assert pacer.slots(3, 1.4) == 5  # rounded up: a slot short would push a record into the next batch
    assert pacer.slots(4, 3.0) == (BOUND + 1) * B  # never more than one claim can be granted


async def test_claims_with_slots_pace_the_arena_in_records():
    ledger = MemoryLedger()
    pacer = AdmissionPacer(B, BOUND, ledger=ledger, arena_id="a")
    await pacer.start()
    try:
        await pacer.admit(2, slots=5)
        waiter = asyncio.create_task(pacer.admit(2, slots=4))  # 5 + 4 > 8: waits for revision 1
        await asyncio.sleep(0.05)
        assert pacer.paused and not waiter.done()
        await pacer.on_revision(1)
        await asyncio.wait_for(waiter, 2)
        assert ledger.book.admitted("default") == 9 and pacer.admitted == 4 and pacer.final_revision() == 2
    finally:
        await pacer.stop()


def test_lease_expiry_lets_any_arena_release_a_dead_arenas_claim():
    book = fold((100, claim("c1", arena="dead")), (101, claim("c2", arena="dead")))
    assert book.expired("f", 100 + LEASE - 0.1) == []
    assert [c.claim_id for c in book.expired("f", 100 + LEASE)] == ["c1"]
    book.apply(release("c2", "b"), 105)  # early: ignored by every reader alike
    assert book.claims["c2"].released is None and book.admitted("f") == 8
    book.apply(release("c1", "b"), 100 + LEASE)
    book.apply(release("c2", "b"), 101 + LEASE)
    assert book.admitted("f") == 0 and book.expired("f", 1e9) == []


async def test_a_restarted_arena_releases_its_earlier_claims_and_joins_in():
    ledger = MemoryLedger()
    first = AdmissionPacer(B, BOUND, ledger=ledger, arena_id="a1")
    await first.start()
    await first.admit(4)
    await first.admit(4)  # killed now: both claims left open
    other = AdmissionPacer(B, BOUND, ledger=ledger, arena_id="b")
    waiter = asyncio.create_task(other.admit(4))
    await asyncio.sleep(0.05)
    assert other.paused and not waiter.done()
    again = AdmissionPacer(B, BOUND, ledger=ledger, arena_id="a1")  # the same arena, restarted
    await again.start()
    await asyncio.wait_for(waiter, 2)
    assert ledger.book.admitted("default") == 4 and other.admitted == 4 and other.pauses == 1
    assert {s.released for s in ledger.book.claims.values()} >= {"restarted: the arena's earlier process left it open"}


def test_arenas_started_without_an_id_never_share_one():
    """Issue 24, hole 7: with the run id as the default, two arenas started without --arena-id released each
    other's open claims as their own predecessor's, and their emitters fenced each other."""
    from producers.arena.pacer import default_arena_id

    ids = {default_arena_id("run7") for _ in range(5)}
    assert len(ids) == 5 and all(i.startswith("run7-") for i in ids)


@pytest.mark.integration
async def test_an_admissions_topic_without_broker_timestamps_is_refused_loudly(kafka_settings, make_topic):
    """Issue 24, hole 7: leases are timed by the log's timestamps, which must be the broker's. A topic made
    before LogAppendTime was set (or by hand) is refused at the first append, with the command that fixes it;
    one with LogAppendTime is accepted."""
    from streams.admissions import KafkaLedger, NotBrokerTimed

    kw = kafka_settings.client_kwargs()
    for configs, ok in (({}, False), ({"message.timestamp.type": "LogAppendTime"}, True)):
        ledger = KafkaLedger(kw, await make_topic(configs=configs))
        await ledger.start()
        try:
            if ok:
                await ledger.append(claim("c1"))
                assert ledger.book.granted("c1")
            else:
                with pytest.raises(NotBrokerTimed, match="message.timestamp.type=LogAppendTime"):
                    await ledger.append(claim("c1"))
        finally:
            await ledger.stop()


async def test_a_slow_live_arena_keeps_its_claim_and_a_paused_one_loses_it():
    """Issue 24, hole 7: a live arena renews its open claims every third of a lease, so a group slower than the
    lease is not released under it; a paused (not killed) arena stops renewing, another arena releases its
    claim after one lease, and once resumed it finds the claim gone (``held``) and must not emit the group."""
    lease = 1.5  # renewals every 0.5 s: a loaded 2-core machine delays a task by tenths of a second, not a lease
    ledger = MemoryLedger()
    slow = AdmissionPacer(B, BOUND, ledger=ledger, arena_id="slow", lease_s=lease)
    other = AdmissionPacer(B, BOUND, ledger=ledger, arena_id="other", lease_s=lease)
    await slow.start()
    await other.start()
    try:
        cid = await slow.admit(4)
        await slow.admit(4)  # the bound is full now
        await asyncio.sleep(3 * lease)  # the groups take three leases, their arena alive
        assert ledger.book.expired("default", ledger.now()) == []  # renewed: nobody may release them
        assert await slow.held(cid) and slow.lost == 0

        slow._renewing.cancel()  # paused: a frozen process renews nothing
        waiter = asyncio.create_task(other.admit(4))
        await asyncio.wait_for(waiter, 5 * lease)  # released by the other arena after one lease
        assert ledger.book.claims[cid].released.startswith("lease of")
        await slow.renew()  # resumed, its renewal comes after the release: it renews nothing that counts
        assert not await slow.held(cid) and slow.lost == 1  # resumed: the group must not be emitted
    finally:
        await slow.stop()
        await other.stop()


async def test_the_last_revision_admitted_counts_the_records_each_rollout_yields():
    """``rollout rl``'s arena stops admitting at the run's last revision counted in records: two seats yield two
    records a rollout, so half the rollouts fill the same batches."""
    pacer = AdmissionPacer(B, 5, ledger=MemoryLedger(), family="f", arena_id="a")
    await pacer.start()
    try:
        for _ in range(2):
            await pacer.admit(4)
        assert pacer.final_revision() == 2  # 8 rollouts at one record each: two batches of 4
        assert pacer.final_revision(2.0) == 4 and pacer.final_revision(2.4) == 4  # 16 and 19 records
        assert pacer.final_revision(0.5) == 1  # a partial batch does not count
    finally:
        await pacer.stop()
