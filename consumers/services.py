"""The long-lived services: thin shells around the pure logic, run by ``streams.transactions``.

    rollout serve verifier|credit|batcher|trainer [options]      (also: python -m consumers serve ...)

Each is a consumer group (scale out by starting more instances), exactly-once through Kafka
transactions (one transactional producer per input partition), dead-letters what it cannot process
inside the same transaction as the offset commit, and stops gracefully on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from consumers import credit as credit_mod
from consumers import scoring
from consumers.batching import BatchPolicy, Batcher
from schemas.errors import EventDecodeError
from schemas.events import DeadLetter, Rollout, RolloutScored, Step, TrainingRecord
from schemas.policy import PolicyRevision
from streams import serde, topics
from streams.transactions import Out, TransactionalProcessor, changelog_topic

log = logging.getLogger("rollout.services")

SERVICES = ("verifier", "credit", "batcher", "trainer")


@dataclass
class ServiceConfig:
    family: str = "tiny"
    credit: str = "grpo"
    credit_params: dict[str, Any] = field(default_factory=dict)
    group_timeout_s: float = 300.0
    max_off_policy_steps: int = 1
    batch_records: int | None = 64
    batch_tokens: int | None = None
    flush_after_s: float = 5.0
    step_timeout_s: float = 600.0
    instance: str = ""
    judge_targets: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: str | None = None  # trainer: where checkpoints are written
    lr: float = 1e-3                   # trainer: learning rate
    epochs: int = 1                    # trainer: optimizer passes over each batch


def dead_letter(rec: Any, service: str, error_type: str, message: str, run_id: str | None = None) -> Out:
    run = run_id or serde.header(rec.headers, "run_id") or "unknown"
    return Out(topics.DEAD_LETTERS.name, DeadLetter(
        run_id=run, producer=service, origin_topic=rec.topic, origin_partition=rec.partition,
        origin_offset=rec.offset, origin_key=rec.key, raw=rec.value or b"", error_type=error_type,
        error_message=message[:4000], service=service))


def decode(rec: Any, expect: type) -> Any:
    return serde.from_message(rec.value, expect)


# -- verifier ------------------------------------------------------------------------------------------
class VerifierTask:
    """Joins a rollout with its steps (co-partitioned by root group), scores it, emits RolloutScored.

    Monte Carlo parents wait for their children's scores (same root group, so same partition).
    """

    def __init__(self, partition: int, cfg: ServiceConfig, judge: scoring.Judge | None = None) -> None:
        self.p = partition
        self.cfg = cfg
        self.judge = judge
        self.name = "verifier"
        self.steps: dict[str, tuple[Any, Step, float]] = {}  # step_id -> (rec, step, arrived)
        self.rollouts: dict[str, tuple[Any, Rollout, float]] = {}
        self.children: dict[str, dict[str, float]] = {}  # parent id -> child id -> outcome (state)
        self.done_children: dict[str, float] = {}  # parent id -> time (forget outcomes after scoring)
        self.scored = 0

    async def process(self, rec: Any) -> list[Out]:
        try:
            if rec.topic == topics.STEPS.name:
                step = decode(rec, Step)
                self.steps[step.step_id] = (rec, step, time.monotonic())
                rid = step.rollout_id
            else:
                ro = decode(rec, Rollout)
                self.rollouts[ro.rollout_id] = (rec, ro, time.monotonic())
                rid = ro.rollout_id
        except EventDecodeError as e:
            return [dead_letter(rec, self.name, type(e).__name__, str(e))]
        return await self._try(rid)

    def restore(self, rec: Any) -> None:
        if rec.topic == topics.STEPS.name:
            step = decode(rec, Step)
            self.steps[step.step_id] = (rec, step, time.monotonic())
        else:
            ro = decode(rec, Rollout)
            self.rollouts[ro.rollout_id] = (rec, ro, time.monotonic())

    async def _try(self, rollout_id: str) -> list[Out]:
        entry = self.rollouts.get(rollout_id)
        if entry is None:
            return []
        rec, ro, _ = entry
        if any(s not in self.steps for s in ro.step_ids):
            return []
        outcomes = None
        spec_kind = (ro.artifacts.get("scoring") or {}).get("kind") if isinstance(ro.artifacts.get("scoring"), dict) else None
        if spec_kind == "monte_carlo" and ro.status != "failed":
            got = self.children.get(ro.rollout_id, {})
            if any(c not in got for c in ro.child_rollout_ids):
                return []
            outcomes = [got[c] for c in ro.child_rollout_ids]
        steps = [self.steps[s][1] for s in ro.step_ids]
        outs: list[Out] = []
        try:
            verdict = await scoring.score(ro, steps, judge=self.judge, child_outcomes=outcomes)
            scored = scoring.to_scored(ro, steps, verdict, producer=f"verifier{self.cfg.instance}")
            outs.append(Out(topics.SCORES.name, scored))
            self.scored += 1
        except scoring.ScoringError as e:
            outs.append(dead_letter(rec, self.name, "ScoringError", str(e), ro.run_id))
            scored = None
        except Exception as e:  # noqa: BLE001 - an unexpected scoring bug dead-letters too; the service goes on
            outs.append(dead_letter(rec, self.name, type(e).__name__, f"scoring crashed: {e}", ro.run_id))
            scored = None
        del self.rollouts[rollout_id]
        for s in ro.step_ids:
            self.steps.pop(s, None)
        self.children.pop(rollout_id, None)
        if ro.parent_rollout_id:
            member = None
            parent = self.rollouts.get(ro.parent_rollout_id)
            if parent is not None:
                member = (parent[1].artifacts.get("scoring") or {}).get("params", {}).get("child_member")  # type: ignore[union-attr]
            outcome = scoring.child_outcome(scored, member) if scored is not None else 0.0
            self.children.setdefault(ro.parent_rollout_id, {})[ro.rollout_id] = outcome
            outs.extend(await self._try(ro.parent_rollout_id))
        return outs

    def tick(self, now: float) -> list[Out]:
        outs: list[Out] = []
        t = self.cfg.step_timeout_s
        for rid, (rec, ro, arrived) in list(self.rollouts.items()):
            if now - arrived >= t:
                missing = [s for s in ro.step_ids if s not in self.steps]
                waiting = [c for c in ro.child_rollout_ids if c not in self.children.get(rid, {})]
                outs.append(dead_letter(rec, self.name, "Timeout",
                                        f"rollout {rid} incomplete after {t:g}s: {len(missing)} steps missing, "
                                        f"{len(waiting)} children unscored", ro.run_id))
                del self.rollouts[rid]
                for s in ro.step_ids:
                    self.steps.pop(s, None)
        for sid, (rec, st, arrived) in list(self.steps.items()):
            if now - arrived >= t and st.rollout_id not in self.rollouts:
                outs.append(dead_letter(rec, self.name, "OrphanStep",
                                        f"step {sid}: no rollout {st.rollout_id} within {t:g}s", st.run_id))
                del self.steps[sid]
        return outs

    def buffered(self) -> dict[str, list[int]]:
        return {topics.STEPS.name: [r.offset for r, _, _ in self.steps.values()],
                topics.ROLLOUTS.name: [r.offset for r, _, _ in self.rollouts.values()]}

    def state(self) -> dict[str, Any]:
        return {"children": self.children} if self.children else {}

    def load_state(self, state: dict[str, Any]) -> None:
        self.children = {k: dict(v) for k, v in state.get("children", {}).items()}


# -- credit --------------------------------------------------------------------------------------------
class CreditTask:
    def __init__(self, partition: int, cfg: ServiceConfig) -> None:
        self.p = partition
        self.cfg = cfg
        self.name = "credit"
        params = {"group_timeout_s": cfg.group_timeout_s, **cfg.credit_params}
        self.assigner = credit_mod.CreditAssigner(cfg.credit, params, producer=f"credit{cfg.instance}")
        self.recs: dict[str, Any] = {}  # rollout id -> input record (while its group is open)

    async def process(self, rec: Any) -> list[Out]:
        try:
            scored = decode(rec, RolloutScored)
        except EventDecodeError as e:
            return [dead_letter(rec, self.name, type(e).__name__, str(e))]
        if self.cfg.credit == "grpo" and not scored.evaluation:
            self.recs.setdefault(scored.rollout_id, rec)
        records = self.assigner.add(scored, time.monotonic())
        self._forget_closed()
        return [Out(topics.TRAINING_RECORDS.name, r) for r in records]

    def restore(self, rec: Any) -> None:
        scored = decode(rec, RolloutScored)
        self.recs.setdefault(scored.rollout_id, rec)
        self.assigner.groups.add(scored, time.monotonic())

    def _forget_closed(self) -> None:
        if len(self.recs) != sum(len(g) for g in self.assigner.groups.groups.values()):
            open_ids = {rid for g in self.assigner.groups.groups.values() for rid in g}
            self.recs = {k: v for k, v in self.recs.items() if k in open_ids}

    def tick(self, now: float) -> list[Out]:
        records, refused = self.assigner.flush_expired(now)
        outs = [Out(topics.TRAINING_RECORDS.name, r) for r in records]
        for group, reason in refused:
            for s in group:
                rec = self.recs.get(s.rollout_id)
                if rec is not None:
                    outs.append(dead_letter(rec, self.name, "GroupTimeout", reason, s.run_id))
        if records or refused:
            self._forget_closed()
        return outs

    def buffered(self) -> dict[str, list[int]]:
        return {topics.SCORES.name: [r.offset for r in self.recs.values()]}

    def state(self) -> dict[str, Any]:
        return self.assigner.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.assigner.load_state(state)


# -- batcher -------------------------------------------------------------------------------------------
class RevisionWatcher:
    """Side input: the latest PolicyRevision (with a checkpoint) per family, read_committed."""

    def __init__(self, client_kwargs: dict[str, Any]) -> None:
        self.kw = client_kwargs
        self.latest: dict[str, PolicyRevision] = {}
        self._task: asyncio.Task | None = None
        self.consumer = None

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        self.consumer = AIOKafkaConsumer(**self.kw, group_id=None, enable_auto_commit=False,
                                         isolation_level="read_committed", auto_offset_reset="earliest")
        await self.consumer.start()
        tps = [TopicPartition(topics.POLICY_REVISIONS.name, p) for p in range(topics.POLICY_REVISIONS.partitions)]
        self.consumer.assign(tps)
        await self.consumer.seek_to_beginning(*tps)
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            got = await self.consumer.getmany(timeout_ms=500)
            for recs in got.values():
                for rec in recs:
                    try:
                        rev = decode(rec, PolicyRevision)
                    except EventDecodeError:
                        continue
                    cur = self.latest.get(rev.family)
                    if rev.checkpoint is not None and (cur is None or rev.revision > cur.revision):
                        self.latest[rev.family] = rev

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self.consumer:
            await self.consumer.stop()


class BatcherTask:
    def __init__(self, partition: int, cfg: ServiceConfig, revisions: RevisionWatcher) -> None:
        self.p = partition
        self.cfg = cfg
        self.name = "batcher"
        self.revisions = revisions
        self.batcher: Batcher[Any] = Batcher(BatchPolicy(
            family=cfg.family, max_off_policy_steps=cfg.max_off_policy_steps, batch_records=cfg.batch_records,
            batch_tokens=cfg.batch_tokens, flush_after_s=cfg.flush_after_s), producer=f"batcher{cfg.instance}")

    async def process(self, rec: Any) -> list[Out]:
        try:
            record = decode(rec, TrainingRecord)
        except EventDecodeError as e:
            return [dead_letter(rec, self.name, type(e).__name__, str(e))]
        self.batcher.run_id = record.run_id
        refusal = self.batcher.add(record, time.monotonic(), rec)
        outs = [dead_letter(rec, self.name, refusal.error_type, refusal.reason, record.run_id)] if refusal else []
        return outs + self._poll(time.monotonic())

    def restore(self, rec: Any) -> None:
        record = decode(rec, TrainingRecord)
        self.batcher.run_id = record.run_id
        self.batcher.add(record, time.monotonic(), rec)

    def _poll(self, now: float) -> list[Out]:
        batches, refusals = self.batcher.poll(self.revisions.latest.get(self.cfg.family), now)
        outs = [Out(topics.TRAINER_BATCHES.name, b) for b, _ in batches]
        outs += [dead_letter(r.item.tag, self.name, r.error_type, r.reason, r.item.record.run_id) for r in refusals]
        return outs

    def tick(self, now: float) -> list[Out]:
        return self._poll(now)

    def buffered(self) -> dict[str, list[int]]:
        return {topics.TRAINING_RECORDS.name: [it.tag.offset for it in self.batcher.items]}

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        pass


# -- wiring --------------------------------------------------------------------------------------------
def inputs_of(name: str) -> list[topics.Topic]:
    return {"verifier": [topics.STEPS, topics.ROLLOUTS], "credit": [topics.SCORES],
            "batcher": [topics.TRAINING_RECORDS], "trainer": [topics.TRAINER_BATCHES]}[name]


async def ensure_topics(name: str, admin_kwargs: dict[str, Any]) -> None:
    ins = inputs_of(name)
    await topics.create_topics(admin_kwargs, [*topics.TOPICS.values(), changelog_topic(name, ins[0].partitions)])


def build_processor(name: str, cfg: ServiceConfig, client_kwargs: dict[str, Any]) -> TransactionalProcessor:
    ins = inputs_of(name)
    parts = {t.partitions for t in ins}
    if len(parts) != 1:
        raise ValueError(f"{name}: co-partitioned inputs must share a partition count, got {parts}")
    judge = scoring.http_judge(cfg.judge_targets) if cfg.judge_targets else None
    on_start = None
    if name == "verifier":
        def make(p: int) -> Any:
            return VerifierTask(p, cfg, judge)
    elif name == "credit":
        def make(p: int) -> Any:
            return CreditTask(p, cfg)
    elif name == "batcher":
        watcher = RevisionWatcher(client_kwargs)

        def make(p: int) -> Any:
            return BatcherTask(p, cfg, watcher)
        on_start = watcher.start
    else:
        raise ValueError(f"unknown service {name!r}")
    proc = TransactionalProcessor(name, [t.name for t in ins], parts.pop(), make, client_kwargs,
                                  instance=cfg.instance, on_start=on_start)
    if name == "batcher":
        proc.side = watcher  # type: ignore[attr-defined]
    return proc


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        d = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
             "msg": record.getMessage()}
        extra = getattr(record, "fields", None)
        if extra:
            d.update(extra)
        return json.dumps(d)


def setup_logging(level: str = "INFO") -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)


async def serve(name: str, cfg: ServiceConfig, client_kwargs: dict[str, Any], *, stats_every_s: float = 10.0) -> None:
    """Run one service until SIGTERM. Supervises its own Kafka clients: if the broker is unreachable at start,
    or the clients lose the cluster (aiokafka can be left with no known brokers after a broker restart), the
    processor is torn down and built again; exactly-once is unaffected, since a new processor takes its
    partitions over from the log (fence, committed offsets, changelog)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if name == "trainer":
        await _retry(lambda: ensure_topics(name, client_kwargs), stop)
        from consumers.trainer import serve_trainer

        await serve_trainer(cfg, client_kwargs, stop=stop)
        log.info("service stopped", extra={"fields": {"service": name, "instance": cfg.instance}})
        return
    while not stop.is_set():
        if not await _retry(lambda: ensure_topics(name, client_kwargs), stop):
            break
        proc = build_processor(name, cfg, client_kwargs)
        proc.stopping = stop
        try:
            await proc.start()
            log.info("service started", extra={"fields": {"service": name, "instance": cfg.instance,
                                                          "group": proc.group_id}})
            last = time.monotonic()
            lost_since: float | None = None
            while not stop.is_set():
                await proc.safe_step()
                if proc.lost_cluster():
                    lost_since = lost_since or time.monotonic()
                    if time.monotonic() - lost_since > 3:
                        raise ConnectionError("Kafka clients lost the cluster metadata")
                else:
                    lost_since = None
                if time.monotonic() - last >= stats_every_s:
                    last = time.monotonic()
                    stuck = await proc.stalled(float(os.environ.get("ROLLOUT_STALL_S") or 30))
                    if stuck:
                        raise ConnectionError(f"partitions {stuck} have input but made no progress")
                    s = proc.stats
                    log.info("stats", extra={"fields": {
                        "service": name, "instance": cfg.instance, "partitions": sorted(proc.tasks),
                        "in": s.records_in, "out": s.records_out, "txns": s.transactions, "aborted": s.aborted,
                        "fenced": s.fenced, "rebuilt": s.rebuilt, "recommitted": s.recommitted,
                        "by_type": dict(s.by_type)}})
        except Exception as e:  # noqa: BLE001 - rebuild the clients and carry on
            log.warning("restarting the Kafka clients", extra={"fields": {
                "service": name, "instance": cfg.instance, "error": f"{type(e).__name__}: {e}"}})
            await asyncio.sleep(1.0)
        finally:
            try:
                await asyncio.wait_for(_close(proc), 5)  # a broker that is away must not keep us spinning
            except Exception as e:  # noqa: BLE001
                log.warning("closing clients: %s", e)
    log.info("service stopped", extra={"fields": {"service": name, "instance": cfg.instance}})


async def _close(proc: TransactionalProcessor) -> None:
    await proc.stop()
    side = getattr(proc, "side", None)
    if side is not None:
        await side.stop()


async def _retry(fn, stop: asyncio.Event, *, every_s: float = 2.0) -> bool:
    while not stop.is_set():
        try:
            await fn()
            return True
        except Exception as e:  # noqa: BLE001 - broker not there yet
            log.warning("Kafka not reachable yet: %s: %s", type(e).__name__, e)
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass
    return False


def add_args(p: Any) -> None:
    p.add_argument("name", choices=SERVICES)
    add_options(p)


def add_options(p: Any) -> None:
    p.add_argument("--instance", default=os.environ.get("ROLLOUT_INSTANCE", ""), help="label for logs")
    p.add_argument("--plan", default=None, help="GenerationPlan file: credit, family, batch size, off-policy bound")
    p.add_argument("--family", default="tiny")
    p.add_argument("--credit", default="grpo", choices=credit_mod.STRATEGIES)
    p.add_argument("--alpha", type=float, default=0.9, help="EMA factor for the moving baselines")
    p.add_argument("--group-timeout-s", type=float, default=300.0)
    p.add_argument("--max-off-policy-steps", type=int, default=1)
    p.add_argument("--batch-records", type=int, default=64)
    p.add_argument("--batch-tokens", type=int, default=None)
    p.add_argument("--flush-after-s", type=float, default=5.0)
    p.add_argument("--step-timeout-s", type=float, default=600.0)
    p.add_argument("--checkpoint-dir", default=None, help="trainer: where checkpoints are written")
    p.add_argument("--lr", type=float, default=1e-3, help="trainer: learning rate")
    p.add_argument("--epochs", type=int, default=1, help="trainer: optimizer passes over each batch (PPO epochs)")
    p.add_argument("--log-level", default="INFO")


def config_from_args(args: Any) -> ServiceConfig:
    cfg = ServiceConfig(family=args.family, credit=args.credit, credit_params={"alpha": args.alpha},
                        group_timeout_s=args.group_timeout_s, max_off_policy_steps=args.max_off_policy_steps,
                        batch_records=None if args.batch_tokens else args.batch_records,
                        batch_tokens=args.batch_tokens, flush_after_s=args.flush_after_s,
                        step_timeout_s=args.step_timeout_s, instance=args.instance,
                        checkpoint_dir=args.checkpoint_dir, lr=args.lr, epochs=args.epochs)
    if args.plan:
        try:
            from schemas.plan import PlanError, compile_plan, credit_strategy  # type: ignore[import-not-found]
        except ImportError as e:
            raise SystemExit(f"--plan needs schemas.plan: {e}") from None
        plan = compile_plan(args.plan)
        cfg.family = getattr(plan, "family", cfg.family)
        try:  # the plan's algorithm, mapped to a credit strategy; one we cannot run stops credit and trainer
            cfg.credit, params = credit_strategy(plan)
            cfg.credit_params.update(params)
        except PlanError as e:
            if getattr(args, "name", None) in ("credit", "trainer"):
                raise SystemExit(f"rollout serve {args.name}: refusing the plan: {e}") from None
        cfg.max_off_policy_steps = getattr(plan, "max_off_policy_steps", cfg.max_off_policy_steps)
        cfg.batch_records = getattr(plan, "batch_size", cfg.batch_records)
        cfg.judge_targets = dict(getattr(plan, "targets", {}) or {})
    return cfg


def cmd_serve(args: Any) -> int:
    from streams.config import KafkaSettings, ensure_broker

    setup_logging(args.log_level)
    settings = KafkaSettings.from_env()
    settings = settings.with_bootstrap(ensure_broker(settings))
    asyncio.run(serve(args.name, config_from_args(args), settings.client_kwargs()))
    return 0
