"""The arena: runs episode requests concurrently, routes every model call through the GenerationPlan,
stamps every Step with the policy revision that produced it, follows the trainer's policy revisions
and paces admission so generation never runs further ahead of training than the plan allows.

    arena = Arena(plan, emitter=KafkaEmitter(...), config=ArenaConfig(policy_base_url=server.base_url))
    async with arena:                       # starts the emitter (and the revision follower, if given)
        stats = await arena.run(num_groups=16)

Requests and groups
-------------------
Each admitted *group* samples one environment (weight ``EnvSpec.options["weight"]``, default 1) and one
example from that environment's weighted ``ArtifactStore``, then runs ``plan.group_size`` rollouts of
it, sharing a ``group_id`` (their ``root_group_id``). Each rollout gets its own ``sample_seed``; the
plan routes member ``m`` of rollout ``r`` with ``plan.route(m, r, sample_seed)``; call ``i`` of the
rollout is sampled with seed ``sample_seed * 1000 + i``.

Policy revisions
----------------
``revisions`` (a ``streams.revisions.RevisionFollower`` of ``plan.family``: read_committed, no consumer group)
delivers the trainer's ``PolicyRevision`` events for ``plan.family``. On each new one the arena makes it
current. When the arena owns the learner's weights (``weights``: a ``producers.inference.weights.WeightLoader`` per
server; by default the local policy server's loader when the learner is the arena's own endpoint) it loads the
checkpoint into every server of its learner pool (``producers.inference.pool``: one or several servers, each call to the
least busy) under the ``RevisionGate``: calls in flight finish first, new calls wait, so each Step is stamped
with exactly the revision whose weights produced all of its tokens, whichever server answered. A LoRA run's
revision that is its adapter alone is served under the adapter's name (``LoraSpec.adapter_name``): from the swap
that loads it on, learner calls name that model (revision 0, the base, is served as the family). A server that
fails is out of the pool until it answers again and has loaded the current revision (``PoolWeights``). A revision
that carries a probe (``PolicyRevision.probe``) is checked after the load: when a server answers its tokens otherwise
than the revision's weights would, beyond its dtype's rounding (``producers.inference.weights.probe_tolerance``), the Steps of
that revision carry it with ``policy_exact=False``. A
revision the serving endpoint reports in its response wins (it is the one that produced the tokens). When nothing
proves the revision (an endpoint the arena does not load and that does not report it), Steps carry the
arena's current revision with ``policy_exact=False``. Fixed targets' Steps carry ``policy=None``.

Evaluation
----------
Held-out evaluation at the revisions the plan says: ``producers.arena.evaluation``.

Admission pacing (backpressure)
-------------------------------
Any number of arenas share ONE off-policy bound through the admissions ledger: a group is admitted only when its
claim is granted, so its last rollout lands in a batch at most ``max_off_policy_steps`` revisions ahead of the
policy that generated it. The rule and its claims, renewals and leases are ``producers.arena.pacer``'s
(``AdmissionPacer``). If the revision feed dies (e.g. the policy server refuses a revision's checkpoint),
admission stops and ``run`` raises that error rather than generating against a revision it cannot track.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from producers.arena.concurrency import POLL_S, InflightCap, Limiter, LoadProbe
from producers.arena.progress import ArenaProgress, ArenaStats
from producers.arena.emitter import Emitter
from producers.arena.evaluation import ArenaEvaluation
from producers.environments.loader import environment_from_spec
from producers.environments.types import Environment
from producers.environments.episodes import EpisodeState, GenerateResult
from producers.inference.client import InferenceClient, InferenceError
from producers.arena.config import ArenaConfig
from producers.arena.limits import STOP_GRACE_S
from producers.arena.rollout import EpisodeRequest, RolloutContext
from producers.arena.pacer import AdmissionPacer, default_arena_id, until_first
from producers.inference.pool import InferencePool
from producers.inference.weights import LocalPolicyWeights, PoolWeights, RevisionGate, WeightLoader, WeightLoadError
from schemas.envelope import new_id
from schemas.events import Rollout
from schemas.policy import PolicyRef, PolicyRevision
from schemas.scoring import SCORING_ARTIFACT
from streams.admissions import MemoryLedger
from streams.revisions import RevisionFollower

log = logging.getLogger("rollout.arena")
KEEPALIVE_S = 2.0  # an idle connection to a server kept this long, under its own keep-alive (``Arena.start``)


async def _acquired(sem: asyncio.Semaphore, stop: asyncio.Event | None, grace_until: Callable[[], float]) -> bool:
    """``sem`` acquired. Once ``stop`` is set, the group being started still gets its slots, but only until the
    stop's grace runs out (``grace_until``, loop time): False then, nothing acquired (the rest never starts)."""
    got = asyncio.ensure_future(sem.acquire())
    if stop is None:
        return await got
    if not stop.is_set():
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({got, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
    if not got.done():
        await asyncio.wait({got}, timeout=max(0.0, grace_until() - asyncio.get_running_loop().time()))
    if got.done() and not got.cancelled():
        return True
    got.cancel()
    await asyncio.gather(got, return_exceptions=True)
    if got.done() and not got.cancelled() and got.exception() is None:  # acquired while being cancelled
        sem.release()
    return False


# -- the arena -----------------------------------------------------------------------------------------

class RunFailing(RuntimeError):
    """Every rollout of the last ``max_failed_groups`` training groups failed: nothing trainable is coming, so the
    arena stops instead of waiting for a revision that cannot be trained."""


class Arena(ArenaEvaluation):
    def __init__(self, plan: Any, environments: Mapping[str, Environment] | None = None, *, emitter: Emitter,
                 config: ArenaConfig = ArenaConfig(), revisions: RevisionFollower | None = None,
                 weights: Callable[[str], WeightLoader] | None | str = "auto", admissions: MemoryLedger | None = None,
                 eval_environments: Sequence[tuple[Any, Environment]] | None = None,
                 manage_emitter: bool = True) -> None:
        """``config``: its settings (``ArenaConfig``). ``weights``: what loads a revision into a learner server
        (``VllmWeights``, ``LocalPolicyWeights``: called with each server's URL); "auto": the local policy server's
        loader when the learner is this arena's own endpoint; None: the arena loads nothing. ``admissions``: the
        run's ledger (default: claims folded in memory). ``eval_environments``: the plan's evaluation sources,
        loaded by the caller (default: loaded here when ``config.evaluate``). ``manage_emitter`` False: the emitter
        is shared and started/stopped by its owner."""
        c = self.config = config
        self.plan = plan
        self.rollout_timeout_s = c.rollout_timeout_s or None
        self.max_failed_groups = c.max_failed_groups
        # keyed by the source's name: two sources of one environment (different args, ratios) stay two
        self.env_specs = {spec.display_name: spec for spec in getattr(plan, "environments", []) or []}
        if environments is None:
            environments = {name: environment_from_spec(spec) for name, spec in self.env_specs.items()}
        self.environments = dict(environments)
        if not self.environments:
            raise ValueError("the arena needs at least one environment")
        self.env_weights = {k: 1.0 for k in self.environments}
        self.env_sampling: dict[str, dict[str, Any]] = {}
        for spec in getattr(plan, "environments", []) or []:
            env = self.environments.get(spec.display_name)
            if env is not None:
                self.env_weights[spec.display_name] = float((spec.options or {}).get("weight", 1.0))
                if spec.sampling:
                    self.env_sampling[env.ref] = dict(spec.sampling)
        self.emitter = emitter
        self.manage_emitter = manage_emitter
        urls = c.policy_base_url
        self.policy_base_urls = [urls] if isinstance(urls, str) else list(urls or [])
        self.concurrency = c.concurrency
        # training episodes in flight: the plan's [orchestrator.concurrency] bounds, else --concurrency as where the
        # cap opens and its ceiling; held to the cores until the episodes are known, where ``cores`` is given
        self.cap = InflightCap(plan.concurrency, cores=c.cores) if getattr(plan, "concurrency", None) is not None \
            else InflightCap.fixed_start(c.concurrency, cores=c.cores)
        self.server_pids: set[int] = set()  # processes this arena's command started that are not episodes (vLLM)
        self.eval_concurrency = c.eval_concurrency
        self.progress = c.progress
        self.run_id = c.run_id or new_id()
        self.producer_name = c.producer_name
        self.revisions = revisions
        # the learner's servers: every learner call picks one, every swap loads them all
        self.pool = InferencePool(plan.learner.base_urls or self.policy_base_urls)
        if weights == "auto":  # the learner is this arena's own endpoint: load revisions into it
            weights = LocalPolicyWeights if self.policy_base_urls and not plan.learner.base_urls else None
        self.weights = PoolWeights(self.pool, weights) if callable(weights) else None
        self.gate = RevisionGate()
        self.learner_model: str | None = None  # what learner calls name instead of the family: a LoRA adapter's name
        self.served_exact = True  # False: the server answered the current revision's probe otherwise (a swap's figures)
        self.reload_s: list[float] = []
        # evaluation: every environment's eval_dataset answered once by each revision made current that is due
        # (greedy by default); the next swap waits for it, so the revision is scored on the whole held-out set
        self.evaluate = c.evaluate
        self.last_revision: int | None = None  # the run's last revision, evaluated whatever the cadence (``run``)
        self.eval_sampling = dict(c.eval_sampling if c.eval_sampling is not None else {"temperature": 0.0})
        # the plan's evaluation sources (prime-rl's [[orchestrator.eval.source]]): their whole dataset is held out
        # (source, environment) of each: built here unless the caller loaded them
        self.eval_environments = list(eval_environments) if eval_environments is not None else \
            [(s, environment_from_spec(s)) for s in getattr(plan, "eval_environments", [])] if c.evaluate \
            else []
        self.rng = random.Random(c.seed)
        self.current_policy = PolicyRef(family=plan.family, revision=c.base_revision or 0)
        # admissions: the ledger shared with every other arena of the run (streams.admissions.KafkaLedger); an
        # arena alone in its process and without one folds its own claims in memory, by the same rule
        self.pacer = AdmissionPacer(plan.batch_size, plan.max_off_policy_steps, c.base_revision or 0,
                                    ledger=admissions, family=plan.family,
                                    arena_id=c.arena_id or default_arena_id(self.run_id), run_id=self.run_id,
                                    lease_s=c.admission_lease_s)
        self.stats = ArenaStats()
        self.client_options = dict(c.client_options or {})
        self._http: httpx.AsyncClient | None = None
        self._clients: dict[str, InferenceClient] = {}
        self._follow_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._generating: set[asyncio.Task] = set()  # rollouts still in their episode (not yet being emitted)
        self._cut: set[asyncio.Task] = set()  # ... cut short by a stop (``STOP_GRACE_S``)
        self._on_log = asyncio.Event()  # an admitted rollout finished (on the log or not): its records are counted
        self._stop_by: float | None = None  # loop time the stop's grace ends
        self._fatal: BaseException | None = None
        self._evaluating = asyncio.Lock()  # one evaluation at a time: a revision is answered once
        self.revision_log: list[tuple[float, int]] = []

    # lifecycle --------------------------------------------------------------------------------------

    async def start(self) -> Arena:
        # an idle connection is dropped here before the server drops it (uvicorn's, vLLM's, after 5 s: httpx's
        # default is 5 s too, and a request sent on a connection the server was closing failed with a ReadError)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0),
                                       limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024,
                                                           keepalive_expiry=KEEPALIVE_S))
        if self.manage_emitter:
            await self.emitter.start()
        await self.pacer.start()
        if self.revisions is not None:
            await self.revisions.start()
            try:  # the newest revision current, and evaluated when due, before anything is admitted
                await self.revisions.catch_up(self._on_revision, skippable=self._skippable)
            except Exception as e:  # noqa: BLE001 - what following would stop on: the run raises it
                self._failed(e)
                return self
            self._follow_task = asyncio.create_task(
                self.revisions.follow(self._on_revision, skippable=self._skippable), name="revisions")
            self._follow_task.add_done_callback(self._follow_done)
        return self

    async def stop(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._follow_task is not None:
            self._follow_task.cancel()
            await asyncio.gather(self._follow_task, return_exceptions=True)
        if self.revisions is not None:
            await self.revisions.stop()
        if self.manage_emitter:
            await self.emitter.stop()
        await self.pacer.stop()
        for client in self._clients.values():
            await client.aclose()
        await self.pool.aclose()
        if self._http is not None:
            await self._http.aclose()
        # episodes holding serving resources (verifiers.v1 envs), evaluation sources' too
        for env in [*self.environments.values(), *(env for _, env in self.eval_environments)]:
            close = getattr(env.episode, "aclose", None)
            if close is not None:
                await close()

    async def __aenter__(self) -> Arena:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def follow_error(self) -> str | None:
        """Why the arena stopped following revisions (a checkpoint the policy server refused...), if it did."""
        return f"{type(self._fatal).__name__}: {self._fatal}" if self._fatal is not None else None

    def _skippable(self, rev: PolicyRevision) -> bool:
        """A revision a newer one supersedes may be passed over when none of its evaluation is due."""
        return not self._evaluates(rev.revision)

    def _follow_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        """The revision feed stopped on ``exc`` (e.g. the policy server refused a revision's checkpoint): admit
        nothing more, and the run raises it."""
        if self._fatal is None:
            self._fatal = exc
        asyncio.get_running_loop().create_task(self.pacer.abort(exc))

    def client_for(self, target: Any) -> InferenceClient:
        client = self._clients.get(target.name)
        if client is None:
            client = InferenceClient.for_target(target, self.pool if target.is_learner else self.policy_base_urls,
                                                http=self._http, **self.client_options)
            self._clients[target.name] = client
        return client

    async def _on_revision(self, rev: PolicyRevision) -> None:
        if rev.revision < self.current_policy.revision:
            return
        if rev.revision > self.current_policy.revision or (rev.checkpoint and not self.current_policy.checkpoint_digest):
            if self.weights is not None and rev.checkpoint is not None and self._http is not None:
                try:
                    async with self.gate.swap():  # a failed load leaves the gate shut: nothing is stamped with it
                        figures = await self.weights.load(self._http, rev)
                        self.current_policy = rev.ref()
                        self.served_exact = not figures.get("inexact")
                        # an adapter revision is served under its adapter's name (prime-rl's model name switch)
                        lora = getattr(self.plan, "lora", None)
                        self.learner_model = lora.adapter_name if lora is not None and rev.checkpoint.adapter else None
                except WeightLoadError as e:
                    # a trainer keeping only its newest checkpoints may have pruned this one while the arena was
                    # behind (evaluating): a newer revision replaces it; with none, the arena stops, loudly
                    newer = await self.revisions.scan() if self.revisions is not None else None
                    if newer is None or newer.revision <= rev.revision:
                        raise
                    log.warning("revision %d could not be loaded (%s); loading revision %d, the newest, instead",
                                rev.revision, e, newer.revision)
                    return await self._on_revision(newer)
                self.reload_s.append(figures.get("reload_s", 0.0))
                if not self.served_exact:
                    log.warning("the learner's server answered %s@r%d's probe %.3g nats a token off (mean): its steps "
                                "are not stamped exact", rev.family, rev.revision, figures.get("probe_dlogp", -1.0))
            self.current_policy = rev.ref()
            self.revision_log.append((time.monotonic(), rev.revision))
            if self.evaluate:
                await self._evaluate_current()
        # the pacer hears of it after its evaluation: with an off-policy bound of 0 (cores taking turns) the batch
        # it generates waits for it, so an evaluation's seconds are its own, not shared with the batch's
        await self.pacer.on_revision(rev.revision)

    # running ----------------------------------------------------------------------------------------

    def sample_request_group(self) -> list[EpisodeRequest]:
        env_id = self.rng.choices(list(self.environments), weights=[self.env_weights[k] for k in self.environments])[0]
        env = self.environments[env_id]
        example = env.store.sample(self.rng)
        gid = new_id()
        spec = self.env_specs.get(env_id)
        n = self.plan.group_size_of(spec) if spec is not None else self.plan.group_size
        return [EpisodeRequest(env=env, example=example, group_id=gid, root_group_id=gid, group_size=n,
                               sample_seed=self.rng.getrandbits(31), train_source=env_id) for _ in range(n)]

    async def run_rollout(self, req: EpisodeRequest) -> GenerateResult:
        """Run one rollout (and its sub-episodes) to a GenerateResult. Never raises for episode failures:
        an endpoint that stays down or an episode bug gives a ``failed`` Rollout with the reason."""
        episode = req.episode or req.env.episode
        state = EpisodeState(rollout_id=req.rollout_id, example=req.example)
        policy = self.current_policy
        ctx = RolloutContext(self, req, state, policy)
        failure: str | None = None
        artifacts: dict[str, Any] = {}
        self.stats.in_flight += 1
        try:
            deadline = asyncio.timeout(self.rollout_timeout_s)
            try:
                async with deadline:
                    await episode.setup_state(state)
                    await episode.rollout(ctx, state)
                artifacts = episode.finalize(state)
            except InferenceError as e:
                failure = f"inference: {e}"
            except Exception as e:  # noqa: BLE001 - a buggy episode is recorded, not lost
                failure = (f"deadline: the rollout ran past {self.rollout_timeout_s:g} s (--rollout-timeout)"
                           if deadline.expired() else f"episode error: {type(e).__name__}: {e}")
            finally:
                try:
                    async with asyncio.timeout(self.rollout_timeout_s):
                        await episode.cleanup_state(state)
                except Exception as e:  # noqa: BLE001
                    failure = failure or f"cleanup error: {type(e).__name__}: {e}"
        finally:
            self.stats.in_flight -= 1
        scoring = req.scoring if req.scoring is not None else req.env.scoring
        try:
            spec = scoring(req.example, state) if callable(scoring) else scoring
            artifacts[SCORING_ARTIFACT] = spec.model_dump(mode="json")
        except Exception as e:  # noqa: BLE001
            failure = failure or f"scoring spec error: {type(e).__name__}: {e}"
        artifacts.setdefault("answer", req.example.answer)
        artifacts.setdefault("example_info", dict(req.example.info))
        status = "failed" if failure else state.status
        if status != "failed" and not ctx.steps and not state.children:
            status, failure = "failed", "the episode made no model call and spawned no sub-episode"
        members = {m: t for m, (_, t) in ctx.routes.items()}
        rollout = Rollout(
            run_id=self.run_id, producer=self.producer_name, rollout_id=req.rollout_id,
            episode_type=episode.episode_type, environment=req.env.ref, example_id=req.example.id,
            seed=req.example.seed_dict() | {"sample_seed": req.sample_seed}, step_ids=[s.step_id for s in ctx.steps],
            members=members, artifacts=_jsonable(artifacts), parent_rollout_id=req.parent_rollout_id,
            child_rollout_ids=[c.rollout.rollout_id for c in state.children], group_id=req.group_id,
            root_group_id=req.root_group_id, group_size=req.group_size, policy=policy, status=status,
            failure_reason=failure, evaluation=req.evaluation, train_source=req.train_source)
        if req.evaluation:
            self.stats.evaluations += 1
        else:
            self.stats.rollouts += 1
        self.stats.failed += status == "failed"
        if failure:
            self.stats.failure_reasons[failure.splitlines()[0][:600]] += 1
        self.stats.truncated += status == "truncated"
        return GenerateResult(rollout=rollout, steps=ctx.steps, children=list(state.children))

    async def _run_and_emit(self, req: EpisodeRequest, sem: asyncio.Semaphore | Limiter,
                            results: list[GenerateResult] | None, claim_id: str | None = None) -> str | None:
        """The status of the rollout on the log; None when it is not on it. A rollout of a claim another arena
        released meanwhile (this one was frozen past its lease) is not emitted: its capacity went to another
        group."""
        me = asyncio.current_task()
        try:
            self._generating.add(me)
            try:
                result = await self.run_rollout(req)
            except asyncio.CancelledError:
                if me in self._cut:
                    return None  # stopped: the episode was cut short and nothing of it emitted
                raise
            finally:
                self._generating.discard(me)
            if claim_id is not None:
                self.cap.completed()
            if claim_id is not None and not await self.pacer.held(claim_id):
                log.warning("rollout %s not emitted: its group's admission claim %s was released while this arena "
                            "was not renewing it (frozen or cut off for over %gs)", req.rollout_id, claim_id,
                            self.pacer.lease_s)
                return None
            await self.emitter.emit(result)
            if claim_id is not None:
                self.stats.admitted_on_log += 1
                self.stats.records += result.training_records
            if results is not None:
                results.append(result)
            return result.rollout.status
        except BaseException as e:  # noqa: BLE001 - emission failures stop the arena
            if self._fatal is None:
                self._fatal = e
            return None
        finally:
            sem.release()
            if claim_id is not None:
                self._on_log.set()

    def _grace_until(self) -> float:
        """When a stop's grace ends (loop time): ``STOP_GRACE_S`` after the first time anyone asks."""
        if self._stop_by is None:
            self._stop_by = asyncio.get_running_loop().time() + STOP_GRACE_S
        return self._stop_by

    async def _close_claim(self, claim_id: str, rollouts: list[asyncio.Task], size: int) -> None:
        """Done once every rollout of the group (``size``) is on the log; released (capacity back) if one never
        will be. A group whose every rollout failed counts towards ``max_failed_groups``; one that did not resets it."""
        statuses = await asyncio.gather(*rollouts)
        if len(statuses) == size and all(s is not None for s in statuses):
            await self.pacer.done(claim_id)
        elif self.pacer.book.held(claim_id):
            await self.pacer.release(claim_id, f"abandoned: {size - sum(s is not None for s in statuses)} rollouts "
                                               "not emitted")
        if statuses and all(s == "failed" for s in statuses):
            self.stats.failed_groups_in_a_row += 1
        elif any(s is not None for s in statuses):
            self.stats.failed_groups_in_a_row = 0
        n = self.stats.failed_groups_in_a_row
        if self.max_failed_groups and n >= self.max_failed_groups and self._fatal is None:
            reasons = "; ".join(f"{k} (x{c})" for k, c in self.stats.failure_reasons.most_common(3))
            self._fatal = RunFailing(f"every rollout of the last {n} groups failed, so nothing can be trained: "
                                     f"stopping (--max-failed-groups). Most frequent reasons: {reasons}")
            await self.pacer.abort(self._fatal)

    async def generate(self, requests: Sequence[EpisodeRequest], concurrency: int | None = None
                       ) -> list[GenerateResult]:
        """Run the given requests (at most ``concurrency`` at once, default the arena's; no pacing), emit each,
        return the results."""
        sem = asyncio.Semaphore(concurrency or self.concurrency)
        results: list[GenerateResult] = []
        tasks = []
        for req in requests:
            await sem.acquire()
            tasks.append(asyncio.create_task(self._run_and_emit(req, sem, results)))
        await asyncio.gather(*tasks)
        if self._fatal is not None:
            raise self._fatal
        return results

    async def _admit(self, group: list[EpisodeRequest], stop: asyncio.Event | None) -> str | None:
        """Admit a group (paced): its claim id; None when ``stop`` is set first (a paused arena must still stop)."""
        # sized by what rollouts yielded on the log, not by the plan: an env's own seats and turns are not in it
        admit = asyncio.ensure_future(self.pacer.admit(len(group), group[0].group_id,
                                                       self.pacer.slots(len(group), self.stats.records_per_rollout)))
        if stop is None:
            return await admit
        stopped = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({admit, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if admit in done:
            return admit.result()
        admit.cancel()
        await asyncio.gather(admit, return_exceptions=True)
        return None

    async def _more_needed(self, until_revision: int, stop: asyncio.Event) -> bool:
        """Whether the batches up to the run's last revision need another group: the slots admitted (by every
        arena; a claim made before a rollout's yield was known counts the records per rollout this arena has seen
        on the log, at least one each: a rollout that yields none leaves a partial batch, which the batcher
        flushes). Where a rollout may yield several (seats, routed members, sub-episodes, a verifiers env's own
        turns), no second group is admitted before a rollout of the first is counted:
        counted at one each, a two-seat game with ``max_steps = 2`` generated twice the rollouts it trained, and a
        proposer with four solvers five times (benchmarks/RESULTS.md)."""
        if not self.plan.one_record_per_rollout and self.stats.groups and not self.stats.admitted_on_log:
            await until_first(self._on_log.wait(), stop.wait())
            if stop.is_set():
                return False
        return self.pacer.final_revision(max(1.0, self.stats.records_per_rollout or 1.0)) < until_revision

    async def _room_again(self, until_revision: int, stop: asyncio.Event, idle_s: float = 300.0) -> bool:
        """Once the admitted slots fill the batches up to the run's last revision: whether slots come back before
        it is current (``stop``) and are needed again: a group the credit service's admission gate kept out of
        training gives its slots back (``AdmissionRefund``; prime-rl samples again to fill the batch), as does an
        abandoned claim, and the batcher's rebase after a partial batch (``AdmissionRebase``: slots that yielded
        no trained record). False once ``stop`` is set, or after ``idle_s`` with neither a new revision nor a
        slot given back."""
        def final() -> int:
            return self.pacer.final_revision(max(1.0, self.stats.records_per_rollout or 1.0))

        last, seen = time.monotonic(), (self.current_policy.revision, final())
        while not stop.is_set() and self._fatal is None:
            await until_first(stop.wait(), self.pacer.ledger.wait(self.pacer.POLL_S))
            await self.pacer.ledger.sync()
            now = (self.current_policy.revision, final())
            if now[1] < seen[1] and await self._more_needed(until_revision, stop):
                return True
            if now != seen:
                last, seen = time.monotonic(), now
            elif time.monotonic() - last > idle_s:
                return False
        return False

    async def run(self, num_groups: int | None = None, *, stop: asyncio.Event | None = None,
                  collect: bool = False, until_revision: int | None = None
                  ) -> ArenaStats | tuple[ArenaStats, list[GenerateResult]]:
        """Admit ``num_groups`` groups (or until ``stop`` is set), paced; wait for all to be emitted. Once all
        ``num_groups`` are admitted, ``last_revision`` is the revision trained on the last full batch (by every
        arena of the run, as far as this one has seen). ``until_revision``: the run's last revision (it is
        ``last_revision``); nothing more is admitted once it is current, or once the rollouts admitted fill the
        batches up to it (``_more_needed``)."""
        watcher, given_stop = None, stop
        if until_revision is not None:
            self.last_revision = until_revision
            stop, given = asyncio.Event(), stop

            async def end_at_last_revision() -> None:
                await until_first(self.wait_for_revision(until_revision, float("inf"), idle_s=float("inf")),
                             *([given.wait()] if given is not None else []))
                stop.set()
            watcher = asyncio.create_task(end_at_last_revision())
        sem = Limiter(self.cap.cap)
        # the arena at rest read here, before its first episode can start a process
        probe = LoadProbe(self._http, self.pool.urls, self.server_pids, os.getpid())
        sizing = asyncio.create_task(self._size_inflight(sem, probe), name="inflight-cap")
        results: list[GenerateResult] | None = [] if collect else None
        progress = ArenaProgress(self.stats, self.pacer, lambda: self.current_policy) if self.progress else None
        if progress:
            progress.start()
        try:
            admitted = 0
            while (num_groups is None or admitted < num_groups) and not (stop and stop.is_set()):
                if self._fatal is not None:
                    break
                if until_revision is not None and not await self._more_needed(until_revision, stop) \
                        and not await self._room_again(until_revision, stop):
                    break
                group = self.sample_request_group()
                try:
                    claim_id = await self._admit(group, stop)
                except RuntimeError:
                    break  # self._fatal says why
                if claim_id is None:
                    break  # stopped while paused
                admitted += 1
                self.stats.groups += 1
                rollouts = []
                for req in group:
                    if not await _acquired(sem, given_stop, self._grace_until):  # the grace ran out: the rest never start
                        self.stats.cut_short += len(group) - len(rollouts)
                        break
                    rollouts.append(asyncio.create_task(self._run_and_emit(req, sem, results, claim_id)))
                t = asyncio.create_task(self._close_claim(claim_id, rollouts, len(group)))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
            if admitted == num_groups:  # the revision trained on the last batch is the run's last: evaluated
                self.last_revision = self.pacer.final_revision()
            if self._tasks and given_stop is not None and given_stop.is_set():  # stopped: the episodes in flight
                _, late = await asyncio.wait(list(self._tasks), timeout=max(  # get what is left of the grace
                    0.0, self._grace_until() - asyncio.get_running_loop().time()))
                if late:
                    log.warning("stopping: %d episodes still running after %gs cut short (not emitted; their "
                                "groups' claims released)", len(self._generating), STOP_GRACE_S)
                    self._cut |= self._generating
                    self.stats.cut_short += len(self._generating)
                    for t in list(self._generating):
                        t.cancel()
            if self._tasks:
                await asyncio.gather(*list(self._tasks))
        finally:
            for task in (watcher, sizing):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            if progress:
                progress.stop()
        if self._fatal is not None:
            raise self._fatal
        return (self.stats, results or []) if collect else self.stats


    async def _size_inflight(self, limiter: Limiter, probe: LoadProbe) -> None:
        """Every ``POLL_S``: the machine's and the engine's load read, the cap on episodes in flight moved by it."""
        while True:
            self.stats.inflight_cap = limiter.limit
            await asyncio.sleep(POLL_S)
            load = await probe.take(limiter.held)
            before = self.cap.cap
            limiter.set_limit(self.cap.observe(load, limiter.held))
            self.stats.episode_bytes = round(self.cap.cost) if self.cap.cost is not None else None
            if self.cap.cap != before:
                log.info("episodes in flight: cap %d -> %d (%s; %d in flight, an episode ~%s MB)", before,
                         self.cap.cap, self.cap.reason, limiter.held,
                         f"{self.cap.cost / 2**20:.0f}" if self.cap.cost is not None else "?")


def _jsonable(value: Any) -> Any:
    import json

    return json.loads(json.dumps(value, default=str))
