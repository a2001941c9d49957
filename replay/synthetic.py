"""A synthetic run shaped like the pipeline's output, for replay tests, benchmarks and demos.

Built only from the schemas (PolicyRevision, Step, Rollout, RolloutScored, TrainingRecord and
TrainerBatches assembled with ``schemas.batch.assemble_batch``) and produced through a real
transactional Kafka producer with ``streams.serde.to_message``, one transaction per stage of a
round, the way the arena, verifier, credit assignment, batcher and trainer each commit theirs.

Per round: the arena plays ``groups`` prompt groups (an arithmetic group of single-call
rollouts, a debate with a trainable and a fixed seat, a proposer whose children are solver
rollouts) with the learner's current revision (every other group one revision behind, as an
asynchronous arena would); the verifier scores them; credit assignment emits one record per
trainable step (group-relative advantage); the batcher emits a batch for the current revision;
the trainer publishes the next revision, with its step statistics (loss, logprob mismatch) in
``metrics``. Optionally (``eval_questions``) the arena also answers a fixed set of held-out
evaluation questions with the current revision each round (scored, never credited or batched), and
(``inexact``) the steps played one revision behind are marked ``policy_exact=False``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.batch import assemble_batch
from schemas.envelope import Event
from schemas.events import ChatMessage, Rollout, RolloutScored, Step, StepTokens, TrainerBatch, TrainingRecord
from schemas.policy import CheckpointRef, PolicyRevision
from schemas.objectives import DefaultLoss

FAMILY = "toy"
# The scoring kind each episode type's rewards stand for (0/1 answers are exact matches; debate is zero-sum).
VERIFIER = {"arithmetic": "exact_match", "solver": "exact_match", "debate": "zero_sum_judge",
            "proposer_solver": "monte_carlo"}


@dataclass
class SyntheticRun:
    run_id: str
    transactions: list[list[tuple[str, Event]]] = field(default_factory=list)  # (topic key, event)

    def events(self, topic_key: str | None = None) -> list[Event]:
        return [e for tx in self.transactions for k, e in tx if topic_key is None or k == topic_key]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for tx in self.transactions:
            for k, _ in tx:
                out[k] = out.get(k, 0) + 1
        return out


def _revision(run_id: str, rev: int, batch: TrainerBatch | None = None, family: str = FAMILY) -> PolicyRevision:
    digest = hashlib.sha256(f"{run_id}/{family}/{rev}".encode()).hexdigest()
    metrics = {"loss": 1.0 / (rev + 1), "mismatch_mean": 0.01 * rev, "mismatch_max": 0.1 * rev,
               "mismatch_kl": 1e-4 * rev, "mismatch_tokens": 100.0 * rev, "is_masked": 0.01 * rev} if rev else {}
    return PolicyRevision(run_id=run_id, producer="trainer", family=family, revision=rev,
                          checkpoint=CheckpointRef(uri=f"file:///ckpt/{run_id}/r{rev}.pt", digest=digest),
                          parent_revision=rev - 1 if rev else None, metrics=metrics,
                          objective=DefaultLoss().model_dump(mode="json") if rev else None,
                          batch_id=batch.batch_id if batch else None, batch_digest=batch.batch_digest if batch else None)


def generate_run(run_id: str, *, rounds: int = 3, groups: int = 3, group_size: int = 4, prompt_tokens: int = 32,
                 completion_tokens: int = 48, max_off_policy_steps: int = 1, seed: int = 0,
                 environments: Sequence[str] = ("arithmetic", "debate", "proposer_solver"),
                 tag: str | None = None, eval_questions: int = 0, inexact: bool = False,
                 family: str = FAMILY) -> SyntheticRun:
    """``tag`` (default: the run id's first 8 characters) goes into every generated id; ``family``: the learner's
    model family (e.g. ``org/name``, as Hugging Face names models)."""
    rng = np.random.default_rng(seed)
    run = SyntheticRun(run_id)
    revisions = [_revision(run_id, 0, family=family)]
    run.transactions.append([("policy-revisions", revisions[0])])
    counter = 0

    def ids(prefix: str) -> str:
        nonlocal counter
        counter += 1
        return f"{prefix}-{tag or run_id[:8]}-{counter:06d}"

    def step(rollout_id: str, root: str, index: int, member: str, rev: PolicyRevision | None, text: str) -> Step:
        n = int(rng.integers(max(1, completion_tokens // 2), completion_tokens + 1))
        return Step(run_id=run_id, producer="arena", step_id=ids("step"), rollout_id=rollout_id, root_group_id=root,
                    index=index, member_id=member, target="learner" if rev else "fixed-judge",
                    trainable=rev is not None, policy=rev.ref() if rev else None,
                    policy_exact=not (inexact and rev is not None and rev is not revisions[-1]),
                    prompt=[ChatMessage(role="user", content=text)],
                    completion=[ChatMessage(role="assistant", content=f"answer to {text}")],
                    prompt_token_ids=rng.integers(0, 50000, prompt_tokens, dtype=np.int32),
                    completion_token_ids=rng.integers(0, 50000, n, dtype=np.int32),
                    completion_logprobs=-rng.random(n, dtype=np.float32) * 3,
                    finish_reason="stop", latency_s=float(rng.random()))

    for rnd in range(rounds):
        current = revisions[-1]
        arena: list[tuple[str, Event]] = []
        scored: list[tuple[str, Event]] = []
        records: list[TrainingRecord] = []
        for g in range(groups):
            env = environments[g % len(environments)]
            rev = revisions[-2] if (g % 2 and len(revisions) > 1) else current
            group_id = ids("group")
            members_spec = {"arithmetic": {"solver": True}, "debate": {"pro": True, "con": False},
                            "proposer_solver": {"proposer": True}}[env]
            rollouts: list[tuple[Rollout, list[Step]]] = []
            for _ in range(group_size if env != "proposer_solver" else 1):
                rid = ids("rollout")
                steps: list[Step] = []
                turns = 2 if env == "debate" else 1
                for t in range(turns):
                    for m, trainable in members_spec.items():
                        steps.append(step(rid, group_id, len(steps), m, rev if trainable else None, f"{env} {rid} {t}"))
                children: list[tuple[Rollout, list[Step]]] = []
                if env == "proposer_solver":
                    child_group = ids("group")
                    for _c in range(2):
                        cid = ids("rollout")
                        cs = [step(cid, group_id, 0, "solver", rev, f"solve {cid}")]
                        children.append((Rollout(
                            run_id=run_id, producer="arena", rollout_id=cid, episode_type="solver",
                            environment="proposer_solver@1", example_id=f"ex-{rnd}-{g}", seed={"n": rnd},
                            step_ids=[s.step_id for s in cs], members={"solver": True}, parent_rollout_id=rid,
                            group_id=child_group, root_group_id=group_id, group_size=2, policy=rev.ref(),
                            status="completed"), cs))
                roll = Rollout(run_id=run_id, producer="arena", rollout_id=rid, episode_type=env,
                               environment=f"{env}@1", example_id=f"ex-{rnd}-{g}", seed={"n": rnd, "g": g},
                               step_ids=[s.step_id for s in steps], members=members_spec,
                               artifacts={"answer": str(rnd + g)}, child_rollout_ids=[c.rollout_id for c, _ in children],
                               group_id=group_id, root_group_id=group_id,
                               group_size=group_size if env != "proposer_solver" else 1,
                               policy=rev.ref(), status="completed")
                rollouts.extend(children)
                rollouts.append((roll, steps))
            # the verifier and credit assignment, group by group
            by_group: dict[str, list[tuple[Rollout, list[Step], dict[str, float]]]] = {}
            for roll, steps in rollouts:
                rewards = {m: (float(rng.integers(0, 2)) if m != "con" else 0.0) for m in roll.members}
                if "con" in rewards:
                    rewards["pro"] = float(rng.choice([-1.0, 1.0]))
                    rewards["con"] = -rewards["pro"]
                for s in steps:
                    arena.append(("steps", s))
                arena.append(("rollouts", roll))
                trainable = [s for s in steps if s.trainable]
                scored.append(("scores", RolloutScored(
                    run_id=run_id, producer="verifier", causation_id=roll.event_id, rollout_id=roll.rollout_id,
                    group_id=roll.group_id, root_group_id=roll.root_group_id, group_size=roll.group_size,
                    environment=roll.environment, example_id=roll.example_id,
                    parent_rollout_id=roll.parent_rollout_id, status=roll.status, rewards=rewards,
                    metrics={"length": float(sum(len(s.completion_token_ids) for s in steps))},
                    verifier=VERIFIER[roll.episode_type], verifier_version="1",
                    trainable_steps=[StepTokens(step_id=s.step_id, member_id=s.member_id, policy=s.policy,
                                                prompt_token_ids=s.prompt_token_ids,
                                                completion_token_ids=s.completion_token_ids,
                                                completion_logprobs=s.completion_logprobs) for s in trainable])))
                by_group.setdefault(roll.group_id, []).append((roll, steps, rewards))
            for members in by_group.values():
                trainable_rewards = [r[m] for roll, _, r in members for m, t in roll.members.items() if t]
                baseline = float(np.mean(trainable_rewards)) if trainable_rewards else 0.0
                for roll, steps, rewards in members:
                    for s in steps:
                        if not s.trainable:
                            continue
                        mask = np.ones(len(s.completion_token_ids), dtype=np.uint8)
                        records.append(TrainingRecord(
                            run_id=run_id, producer="credit", causation_id=s.event_id,
                            record_id=f"rec-{roll.rollout_id}-{s.step_id}", rollout_id=roll.rollout_id,
                            step_ids=[s.step_id], member_id=s.member_id, group_id=roll.group_id,
                            environment=roll.environment, policy=s.policy, prompt_token_ids=s.prompt_token_ids,
                            completion_token_ids=s.completion_token_ids, completion_logprobs=s.completion_logprobs,
                            loss_mask=mask, reward=rewards[s.member_id], advantage=rewards[s.member_id] - baseline,
                            credit="grpo"))
        # held-out evaluation: the same questions every round, answered by the current revision
        eval_group = ids("group") if eval_questions else ""
        for q in range(eval_questions):
            rid = ids("rollout")
            s = step(rid, eval_group, 0, "solver", current, f"eval question {q}")
            roll = Rollout(run_id=run_id, producer="arena", rollout_id=rid, episode_type="arithmetic",
                           environment="arithmetic@1", example_id=f"eval-{q}", seed={"q": q}, step_ids=[s.step_id],
                           members={"solver": True}, group_id=eval_group, root_group_id=eval_group,
                           group_size=eval_questions, policy=current.ref(), status="completed", evaluation=True)
            arena += [("steps", s), ("rollouts", roll)]
            scored.append(("scores", RolloutScored(
                run_id=run_id, producer="verifier", causation_id=roll.event_id, rollout_id=rid, group_id=eval_group,
                root_group_id=eval_group, group_size=eval_questions, environment=roll.environment,
                example_id=roll.example_id, status="completed", rewards={"solver": float(rng.integers(0, 2))},
                verifier="exact_match", verifier_version="1", evaluation=True,
                trainable_steps=[StepTokens(step_id=s.step_id, member_id="solver", policy=s.policy,
                                            prompt_token_ids=s.prompt_token_ids,
                                            completion_token_ids=s.completion_token_ids,
                                            completion_logprobs=s.completion_logprobs)])))
        run.transactions.append(arena)
        run.transactions.append(scored)
        run.transactions.append([("training-records", r) for r in records])
        batch = assemble_batch(records, current, max_off_policy_steps, run_id=run_id, producer="batcher",
                               causation_id=records[0].event_id)
        run.transactions.append([("trainer-batches", batch)])
        revisions.append(_revision(run_id, current.revision + 1, batch, family))
        run.transactions.append([("policy-revisions", revisions[-1])])
    return run


def generate_steps_run(run_id: str, *, steps: int, completion_tokens: int = 512, prompt_tokens: int = 128,
                       steps_per_rollout: int = 4, seed: int = 0) -> SyntheticRun:
    """A run that is mostly steps (for throughput): rollouts of ``steps_per_rollout`` calls, scored."""
    rng = np.random.default_rng(seed)
    run = SyntheticRun(run_id)
    rev = _revision(run_id, 0)
    run.transactions.append([("policy-revisions", rev)])
    tx: list[tuple[str, Event]] = []
    prompt = rng.integers(0, 50000, prompt_tokens, dtype=np.int32)
    completion = rng.integers(0, 50000, completion_tokens, dtype=np.int32)
    logprobs = -rng.random(completion_tokens, dtype=np.float32)
    for r in range(max(1, steps // steps_per_rollout)):
        rid = f"rollout-{run_id[:8]}-{r:07d}"
        group = f"group-{run_id[:8]}-{r // 4:07d}"
        ss = [Step(run_id=run_id, producer="arena", step_id=f"{rid}-s{i}", rollout_id=rid, root_group_id=group,
                   index=i, member_id="solver", target="learner", trainable=True, policy=rev.ref(),
                   prompt=[ChatMessage(role="user", content=f"question {r} turn {i}")],
                   completion=[ChatMessage(role="assistant", content=f"answer {r} turn {i}")],
                   prompt_token_ids=prompt, completion_token_ids=completion, completion_logprobs=logprobs,
                   finish_reason="stop", latency_s=0.1) for i in range(steps_per_rollout)]
        roll = Rollout(run_id=run_id, producer="arena", rollout_id=rid, episode_type="arithmetic",
                       environment="arithmetic@1", example_id=f"ex-{r}", seed={"r": r},
                       step_ids=[s.step_id for s in ss], members={"solver": True}, group_id=group,
                       root_group_id=group, group_size=4, policy=rev.ref(), status="completed")
        score = RolloutScored(run_id=run_id, producer="verifier", rollout_id=rid, group_id=group,
                              root_group_id=group, group_size=4, environment="arithmetic@1", example_id=f"ex-{r}",
                              status="completed", rewards={"solver": float(r % 2)}, verifier="synthetic",
                              verifier_version="1")
        tx.extend([("steps", s) for s in ss] + [("rollouts", roll), ("scores", score)])
        if len(tx) >= 2000:
            run.transactions.append(tx)
            tx = []
    if tx:
        run.transactions.append(tx)
    return run


async def produce(transactions: Iterable[Sequence[tuple[str, Event]]], producer_kwargs: Mapping[str, Any],
                  topics: Mapping[str, str], *, transactional_id: str, abort: bool = False,
                  compression_type: str | None = None) -> int:
    """Produce each transaction atomically with a transactional producer; returns bytes produced once readable.
    ``abort``: every transaction is aborted instead (what a reader must never see)."""
    from aiokafka import AIOKafkaProducer, TopicPartition

    from streams.serde import to_message
    from streams.settings import MAX_MESSAGE_BYTES
    from streams.commits import wait_visible

    producer = AIOKafkaProducer(**dict(producer_kwargs), transactional_id=transactional_id, enable_idempotence=True,
                                acks="all", linger_ms=5, max_batch_size=1024 * 1024, max_request_size=MAX_MESSAGE_BYTES,
                                compression_type=compression_type)
    await producer.start()
    total = 0
    written: dict[TopicPartition, int] = {}
    try:
        for tx in transactions:
            await producer.begin_transaction()
            try:
                futures = []
                for key, event in tx:
                    k, v, h = to_message(event)
                    total += len(v)
                    futures.append(await producer.send(topics[key], value=v, key=k, headers=h))
                for f in futures:
                    md = await f
                    written[TopicPartition(md.topic, md.partition)] = md.offset
            except BaseException:
                await producer.abort_transaction()
                raise
            await (producer.abort_transaction() if abort else producer.commit_transaction())
    finally:
        await producer.stop()
    await wait_visible(dict(producer_kwargs), written)
    return total
