"""The admissions ledger: how any number of arenas share one off-policy bound through the log alone.

Events (one partition, so one total order every reader folds the same way):

* ``AdmissionClaim``: an arena asks to admit a group of ``rollouts`` top-level rollouts, expected to fill
  ``slots`` batch slots (training records: a two-seat rollout fills two or more; absent, one a rollout), having
  seen trainer revision ``seen_revision``; it carries the plan's ``batch_size`` and bound, so the fold needs
  nothing else.
* ``AdmissionDone``: the claimer emitted every rollout of the group.
* ``AdmissionRenew``: the claimer is alive and still running the group: its lease starts again (a slow group
  keeps its claim as long as its arena renews; a dead or frozen arena stops renewing).
* ``AdmissionRelease``: a granted claim gives its capacity back: written by the claimer when it abandons the
  group, or by any arena once the claim's lease ran out (its arena died, or stopped renewing).
* ``AdmissionRefund``: the credit service's admission gate kept the finished group out of training (prime-rl's
  ``advantage_range``): the group's claim gives its capacity back, so another group fills its slots, as prime-rl
  samples again to fill the batch. Named by group, as credit knows it; a group no claim names is ignored.
* ``AdmissionRebase``: the batcher flushed a partial batch with no admitted group still coming: every claim it had
  folded (the family's first ``claims``) is used up, whatever it yielded, and the next claim's slots start the batch
  trained from ``revision``. Without it, slots that yielded no trained record (a rollout past its deadline, a reward
  that raised, a record refused as stale) still counted as batches to come: the arenas stopped admitting one
  revision or more short of the run's last, and the run ended there (the chaos run: 4 of 5).

``AdmissionBook`` is the fold: pure, deterministic from the records and their log timestamps, so every arena
computes the same grants. Per family, with ``A`` the slots of the granted, not released claims before it
in log order and ``R0`` the ``seen_revision`` of the family's first claim, a claim is granted iff::

    A + slots  <=  (seen_revision - R0 + max_off_policy_steps + 1) * batch_size

(after a rebase, ``R0`` is its ``revision`` and ``A`` counts only the claims after its ``claims``), i.e. its
last record lands in a batch at most ``max_off_policy_steps`` revisions ahead of the revision its
claimer had seen (the slots numbered ``[kB, (k+1)B)`` fill the batch that trains revision ``R0 + k``).
``seen_revision`` never exceeds the trainer's revision, so the bound holds whoever appends. A denied claim
costs nothing. A release by anyone but the claimer counts only when its timestamp is at least ``lease_s``
after the claim's or its last renewal's: a dead arena's claims block the others for one lease at most, and a
release written early by a fast clock is ignored, identically by every reader. A claimer whose claim was
released (it was frozen past its lease) must not emit the group: ``AdmissionPacer.held`` tells it.

The batcher reads the same book (``AdmissionBook.coming``): the batch for target ``T`` is the last that can take a
group claimed at ``seen_revision <= T - max_off_policy_steps``, so it waits for such groups and takes the oldest
records first; and it flushes a partial batch only when no admitted group is still coming. Records reach the batcher in completion
order, not claim order: without the wait a slow group's records landed one batch late and were refused as stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import Field

from schemas.envelope import Event


class AdmissionClaim(Event):
    """An arena's request to admit one group (granted or denied by its place in the ledger)."""

    EVENT_TYPE: ClassVar[str] = "admission_claim"

    claim_id: str = Field(min_length=1)
    arena_id: str = Field(min_length=1)
    family: str = Field(min_length=1)
    group_id: str = Field(min_length=1)
    rollouts: int = Field(ge=1, description="top-level rollouts of the group (sub-episodes ride on them)")
    slots: int | None = Field(None, ge=1, description="batch slots (training records) the group is expected to "
                              "fill: its rollouts times the records a rollout of the run yielded so far; none: one "
                              "a rollout")
    seen_revision: int = Field(ge=0, description="the newest trainer revision the claimer had seen")
    batch_size: int = Field(ge=1)
    max_off_policy_steps: int = Field(ge=0)
    lease_s: float = Field(gt=0, description="after this long without Done, any arena may release the claim")

    @property
    def weight(self) -> int:
        """The batch slots the claim takes in the book."""
        return self.slots or self.rollouts


class AdmissionDone(Event):
    """Every rollout of the claimed group is on the log: the claim can no longer expire."""

    EVENT_TYPE: ClassVar[str] = "admission_done"

    claim_id: str = Field(min_length=1)
    arena_id: str = Field(min_length=1)


class AdmissionRenew(Event):
    """The claimer still runs the group: the claim's lease starts again at this record's timestamp."""

    EVENT_TYPE: ClassVar[str] = "admission_renew"

    claim_id: str = Field(min_length=1)
    arena_id: str = Field(min_length=1)


class AdmissionRelease(Event):
    """A granted claim's capacity returns to the pool (abandoned by its claimer, or its lease expired)."""

    EVENT_TYPE: ClassVar[str] = "admission_release"

    claim_id: str = Field(min_length=1)
    arena_id: str = Field(min_length=1, description="who wrote the release")
    reason: str


class AdmissionRefund(Event):
    """A finished group the admission gate kept out of training: its claim's slots return to the pool."""

    EVENT_TYPE: ClassVar[str] = "admission_refund"

    group_id: str = Field(min_length=1)
    reason: str


class AdmissionRebase(Event):
    """The batches emitted so far used up every claim the batcher had folded (a partial batch went out with no
    admitted group still coming): the slot count starts again after them."""

    EVENT_TYPE: ClassVar[str] = "admission_rebase"

    family: str = Field(min_length=1)
    revision: int = Field(ge=0, description="the revision the next batch is trained from")
    claims: int = Field(ge=0, description="the family's claims in log order, granted or not, that are used up")
    reason: str


ADMISSION_EVENTS = (AdmissionClaim, AdmissionDone, AdmissionRenew, AdmissionRelease, AdmissionRefund, AdmissionRebase)


@dataclass
class ClaimState:
    claim: AdmissionClaim
    lease_from: float  # the claim record's log timestamp (seconds), moved on by each renewal
    granted: bool
    seq: int = 0  # the claim's place among its family's claims (``AdmissionRebase.claims`` counts them)
    done: bool = False
    done_at: float | None = None  # the Done record's log timestamp
    released: str | None = None  # the reason, once released

    def expired(self, now: float) -> bool:
        return now >= self.lease_from + self.claim.lease_s

    @property
    def open(self) -> bool:
        """Granted and still running: counts and may expire."""
        return self.granted and not self.done and self.released is None


@dataclass
class _Family:
    base_revision: int
    admitted: int = 0  # slots of granted, not released claims
    counted_as_rollouts: int = 0  # ...of which claims without ``slots`` (one a rollout, the yield not yet known)
    claims: int = 0  # claims folded, granted or not
    used_up: int = 0  # the first this many claims no longer count (the last ``AdmissionRebase``)


@dataclass
class AdmissionBook:
    """The ledger folded in log order (see the module docstring)."""

    claims: dict[str, ClaimState] = field(default_factory=dict)
    families: dict[str, _Family] = field(default_factory=dict)
    by_group: dict[str, str] = field(default_factory=dict)  # group id -> the id of the claim granted for it
    unsettled: dict[str, ClaimState] = field(default_factory=dict)  # granted, not given back, maybe still coming

    def apply(self, event: Event, at: float) -> None:
        """Fold one record, ``at`` its log timestamp in seconds."""
        if isinstance(event, AdmissionClaim):
            if event.claim_id in self.claims:
                return  # a retried append: the first one decided
            fam = self.families.setdefault(event.family, _Family(event.seen_revision))
            granted = self.grantable(event.family, event.weight, event.seen_revision, event.batch_size,
                                     event.max_off_policy_steps)
            if granted:
                fam.admitted += event.weight
                fam.counted_as_rollouts += event.rollouts if event.slots is None else 0
            self.claims[event.claim_id] = ClaimState(event, at, granted, seq=fam.claims)
            fam.claims += 1
            if granted:
                self.by_group[event.group_id] = event.claim_id
                self.unsettled[event.claim_id] = self.claims[event.claim_id]
            return
        if isinstance(event, AdmissionRefund):
            state = self.claims.get(self.by_group.get(event.group_id, ""))
            if state is not None and state.granted and state.released is None:  # done or not: the group is over
                self._give_back(state, f"refunded: {event.reason}")
            return
        if isinstance(event, AdmissionRebase):
            self._rebase(event)
            return
        state = self.claims.get(getattr(event, "claim_id", ""))
        if state is None or not state.open:
            return
        if isinstance(event, AdmissionDone):
            state.done, state.done_at = True, at
        elif isinstance(event, AdmissionRenew) and event.arena_id == state.claim.arena_id:
            state.lease_from = max(state.lease_from, at)
        elif isinstance(event, AdmissionRelease) and (
                event.arena_id == state.claim.arena_id or state.expired(at)):
            self._give_back(state, event.reason)

    def _give_back(self, state: ClaimState, reason: str) -> None:
        state.released = reason
        self.unsettled.pop(state.claim.claim_id, None)
        fam = self.families[state.claim.family]
        if state.seq >= fam.used_up:  # a used-up claim's slots left the count at the rebase
            fam.admitted -= state.claim.weight
            fam.counted_as_rollouts -= state.claim.rollouts if state.claim.slots is None else 0

    def _rebase(self, event: AdmissionRebase) -> None:
        """Count again from ``event.revision`` with the claims after the used-up ones (a repeated or older rebase
        changes nothing)."""
        fam = self.families.get(event.family)
        if fam is None or event.claims < fam.used_up or event.revision < fam.base_revision:
            return
        fam.base_revision, fam.used_up = event.revision, event.claims
        live = [s.claim for s in self.claims.values() if s.claim.family == event.family and s.seq >= fam.used_up
                and s.granted and s.released is None]
        fam.admitted = sum(c.weight for c in live)
        fam.counted_as_rollouts = sum(c.rollouts for c in live if c.slots is None)

    def claims_folded(self, family: str) -> int:
        """The family's claims folded so far, granted or not (what an ``AdmissionRebase`` made now uses up)."""
        fam = self.families.get(family)
        return fam.claims if fam else 0

    def grantable(self, family: str, slots: int, seen_revision: int, batch_size: int, bound: int) -> bool:
        """Whether a claim of ``slots`` appended now would be granted."""
        fam = self.families.get(family)
        base, admitted = (fam.base_revision, fam.admitted) if fam else (seen_revision, 0)
        return admitted + slots <= (seen_revision - base + bound + 1) * batch_size

    def admitted(self, family: str, records_per_rollout: float = 1.0) -> int:
        """Slots of the granted, not released claims; those of claims without ``slots`` at
        ``records_per_rollout`` a rollout."""
        fam = self.families.get(family)
        return int(fam.admitted + fam.counted_as_rollouts * (records_per_rollout - 1.0)) if fam else 0

    def base_revision(self, family: str, default: int) -> int:
        fam = self.families.get(family)
        return fam.base_revision if fam else default

    def coming(self, family: str, now: float, grace_s: float, seen_at_most: int | None = None) -> set[str]:
        """Admitted groups whose records may still reach the batcher: granted and not given back, and running
        under a live lease, or done (all emitted) less than ``grace_s`` ago, the time their records take through
        scoring and credit. A dead arena's claim stops coming when its lease runs out, a group that yields no
        record when ``grace_s`` has passed (the book then forgets it: one caller, one grace). With
        ``seen_at_most``, only those claimed having seen that revision or an older one: the batch for target ``T``
        owes a place to those at ``T - max_off_policy_steps``, no later batch being within their bound. The
        caller leaves out the groups whose records it already has."""
        out = set()
        for cid, s in list(self.unsettled.items()):
            if s.done and s.done_at is not None and now - s.done_at >= grace_s:
                del self.unsettled[cid]
            elif s.claim.family == family and (seen_at_most is None or s.claim.seen_revision <= seen_at_most) \
                    and (s.done or not s.expired(now)):
                out.add(s.claim.group_id)
        return out

    def expired(self, family: str, now: float) -> list[AdmissionClaim]:
        """Open claims of ``family`` whose lease ran out by ``now``: anyone may release them."""
        return [s.claim for s in self.claims.values() if s.open and s.claim.family == family and s.expired(now)]

    def held(self, claim_id: str) -> bool:
        """Whether the claim is granted and not released: its group may still be emitted."""
        state = self.claims.get(claim_id)
        return state is not None and state.granted and state.released is None

    def granted(self, claim_id: str) -> bool | None:
        """None while the claim is not in the book yet."""
        state = self.claims.get(claim_id)
        return None if state is None else state.granted
