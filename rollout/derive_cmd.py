"""`rollout derive SOURCE_RUN`: a new run from a past run's rollouts: re-score, re-credit and re-train them.

    rollout derive run-1a2b --rubric mypkg.rewards:fixed          re-score with a fixed reward, re-train from r0
    rollout derive run-1a2b --credit rloo --fork 5                 another estimator, training from the source's r5
    rollout derive run-1a2b --revisions 3:9 --since 2026-11-20     a range: admission revisions, creation time
    rollout derive run-1a2b --run-id derive-1a2b3c4d ...           resume a stopped derived run (same flags: checked)

The derived run is the pipeline's own services (verifier, credit, batcher, trainer) under a topic prefix of
its own (``<run id>.``) with their own consumer groups: exactly-once as the live services, so a stopped derived
run resumes where it stopped, and every source rollout is used once. Its verifier reads the source run's Steps
and Rollouts; nothing is ever written under the source run's prefix.

Its revision chain forks from one source revision (``--fork``, default 0): the family ``<family>.<run id>``
starts with that revision's checkpoint (digest checked) and goes on from its number. How history is trained
(``schemas.history``): token-level PPO clip of exp(logp_now - logp_recorded) against the logprobs the
generating revision recorded; the batcher stays at most four batches ahead of the trainer (its pace), and a
record whose generating revision's number is more than ``--max-off-policy-steps`` from the target's (the
derived chain numbered on from the fork) is refused with its reason (a dead letter).
Every derived score and record names its source Rollout (run, topic, partition, offset, digest); replay the
derived run and its source is replayed into the same database (``rollout replay --run <derived run>``).
The derived revisions answer the source run's held-out questions at its evaluation cadence
(``rollout.derived_evaluation``), so both runs compare in ``v_eval_accuracy_by_revision``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from contextlib import AsyncExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

from rollout.argtypes import at_least

DEFAULT_MAX_LAG = 8  # the plan's default off-policy bound (schemas.plan.DEFAULT_MAX_OFF_POLICY_STEPS)
SERVICES = ("verifier", "credit", "batcher", "trainer")
# history arrives as fast as it is read: a group still incomplete this long after its first record was cut by the
# derivation's range (or a weight swap), and goes to the dead letters (GroupTimeout) instead of being held for ever
GROUP_TIMEOUT_S = 60.0


class DeriveError(Exception):
    """A derived run that cannot start: one line that says what to do."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("derive", help="re-score, re-credit and re-train a past run's rollouts as a new run",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="the source run's id (`rollout runs` lists them)")
    p.add_argument("--run-id", help="the derived run's id (default: a new derive-XXXXXXXX; give an existing one "
                                    "to resume it)")
    p.add_argument("--fork", type=at_least(0), default=0, help="the source revision to train from (default 0)")
    p.add_argument("--fork-checkpoint", metavar="PATH",
                   help="the fork revision's weights when the source run has none on record (an imported run: a .pt "
                        "file, or an HF folder or its model.safetensors)")
    p.add_argument("--revisions", help="only rollouts admitted under these source revisions: A:B, A: or :B")
    p.add_argument("--since", type=datetime.fromisoformat, help="only rollouts created at or after (ISO 8601)")
    p.add_argument("--until", type=datetime.fromisoformat, help="only rollouts created before (ISO 8601)")
    p.add_argument("--rubric", action="append", metavar="MODULE:FUNCTION[*WEIGHT]",
                   help="re-score with these reward functions instead of the rollouts' own (repeatable)")
    p.add_argument("--scoring-kind", help="re-score with this verifier kind (consumers.scoring.VERIFIERS)")
    p.add_argument("--credit", help="credit strategy (default: the source run's, when its plan is recorded; else grpo)")
    p.add_argument("--batch-records", type=at_least(1),
                   help="records per batch (default: the source run's batch size, when its plan is recorded; else the "
                        "batcher's)")
    p.add_argument("--max-off-policy-steps", type=at_least(0), default=DEFAULT_MAX_LAG,
                   help=f"refuse records whose generating revision is further than this from the target revision "
                        f"(default {DEFAULT_MAX_LAG})")
    p.add_argument("--lr", type=float, help="learning rate (default: the source run's, when its plan is recorded; "
                                            "else the trainer's)")
    p.add_argument("--gate", action="append", metavar="MIN:MAX",
                   help="an admission gate, prime-rl's advantage_range: a group whose every advantage lies in "
                        "[MIN, MAX] is not trained on (0:0 drops the groups every rollout of which was rewarded "
                        "alike); repeatable")
    p.add_argument("--flush-after-s", type=float, default=2.0,
                   help="train a partial batch after this long without a full one (default 2)")
    p.add_argument("--group-timeout-s", type=float, default=GROUP_TIMEOUT_S,
                   help="a group still incomplete this long after its first record was cut by the range (or the source "
                        f"run stopped mid-group): its records go to the dead letters as GroupTimeout, and the run "
                        f"finishes (default {GROUP_TIMEOUT_S:g})")
    p.add_argument("--checkpoint-dir", help="where the derived checkpoints go (default .state/derived/<run id>)")
    p.add_argument("--plan", metavar="RECIPE",
                   help="evaluate the derived revisions on this recipe's held-out questions at its cadence (default: "
                        "the plan the source run recorded, so its questions and cadence; a run `rollout rl` or "
                        "`rollout demo` did not start records none)")
    p.add_argument("--no-evaluate", action="store_true",
                   help="do not evaluate the derived revisions (no inference server is started)")
    p.add_argument("--follow", action="store_true", help="keep running for a source run still being written")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_derive, trains=True)


def _revision_range(text: str | None) -> tuple[int | None, int | None]:
    if not text:
        return None, None
    lo, sep, hi = text.partition(":")
    if not sep:
        raise DeriveError(f"--revisions {text!r}: give A:B, A: or :B")
    try:
        return (int(lo) if lo else None), (int(hi) if hi else None)
    except ValueError:
        raise DeriveError(f"--revisions {text!r}: revisions are numbers, as in 3:9") from None


def gates_of(specs: list[str] | None) -> list:
    """``--gate MIN:MAX`` flags as the plan's admission gates (``schemas.plan.AdmissionGate``), named by position."""
    from pydantic import ValidationError

    from schemas.plan import AdmissionGate

    gates = []
    for i, spec in enumerate(specs or [], 1):
        lo, sep, hi = spec.partition(":")
        try:
            if not sep:
                raise ValueError("give MIN:MAX")
            gates.append(AdmissionGate(name=f"gate{i}", reject_min=float(lo), reject_max=float(hi)))
        except ValidationError as e:  # MIN above MAX
            raise DeriveError(f"--gate {spec!r}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        except ValueError as e:  # not MIN:MAX, or not numbers
            raise DeriveError(f"--gate {spec!r}: {e}; as in --gate 0:0") from None
    return gates


def rescore_of(rubric: list[str] | None, kind: str | None):
    """The re-scoring the flags ask for, every function imported now: a verifier that cannot be loaded stops
    the run before anything is written."""
    from consumers.reward_functions import load_func
    from consumers.scoring import VERIFIERS
    from schemas.history import Rescore
    from schemas.scoring import WeightedFunc

    if not rubric and not kind:
        return None
    funcs = []
    for spec in rubric or []:
        fn, _, weight = spec.partition("*")
        try:
            load_func(fn)
            funcs.append(WeightedFunc(fn=fn, weight=float(weight) if weight else 1.0))
        except Exception as e:  # noqa: BLE001 - an import error, a missing attribute, a malformed name
            raise DeriveError(f"--rubric {spec}: cannot load the reward function ({type(e).__name__}: {e}); "
                              f"give module:function, importable here") from None
    if kind is not None and kind not in VERIFIERS:
        raise DeriveError(f"--scoring-kind {kind!r} is not a registered verifier ({', '.join(VERIFIERS)})")
    return Rescore(kind=kind or ("rubric" if funcs else None), funcs=funcs or None)


async def find_source(settings: Any, run_id: str) -> str:
    """The topic prefix the source run is under."""
    from replay.runs import list_runs

    runs = [r for r in await list_runs(settings) if r.run_id == run_id]
    if not runs:
        raise DeriveError(f"run {run_id!r} is not on the log (`rollout runs` lists the runs)")
    if len({r.prefix for r in runs}) > 1:
        raise DeriveError(f"run {run_id} is under several topic prefixes ({', '.join(sorted(r.prefix for r in runs))})"
                          f": set ROLLOUT_TOPIC_PREFIX to the one to derive from")
    return runs[0].prefix


async def source_revisions(kw: dict[str, Any], prefix: str, run_id: str) -> list[tuple[Any, Any]]:
    """The source run's PolicyRevisions, with their records."""
    from streams.revisions import RevisionFollower

    async with RevisionFollower(kw, topic=prefix + "policy-revisions") as follower:
        return [(rec, rev) for rec, rev in await follower.read_to_end() if rev.run_id == run_id]


def fork_revision(pairs: list[tuple[Any, Any]], run_id: str, revision: int, weights: str | None = None):
    """(the source run's revision, its SourceEvent, the checkpoint to start from): the revision's own, present and
    matching its digest, or ``weights`` for a revision with none on record (an imported run)."""
    from policy.checkpoint import checkpoint_path, file_sha256
    from schemas.envelope import SourceEvent
    from schemas.policy import CheckpointRef

    found = next(((rec, rev) for rec, rev in pairs if rev.revision == revision), None)
    if found is None:
        have = sorted({rev.revision for _, rev in pairs})
        raise DeriveError(f"run {run_id} has no revision {revision} (it has {_span(have)}): choose --fork among them")
    rec, rev = found
    where = SourceEvent.of(run_id, rec.topic, rec.partition, rec.offset, rec.value)
    if rev.checkpoint is None:
        if weights is None:
            raise DeriveError(f"run {run_id}'s revision {revision} names no checkpoint (an imported run records no "
                              f"weights): give them with --fork-checkpoint PATH")
        path = Path(weights) / "model.safetensors" if Path(weights).is_dir() else Path(weights)
        if not path.is_file():
            raise DeriveError(f"--fork-checkpoint {weights}: no such checkpoint file")
        return rev, where, CheckpointRef(uri=path.resolve().as_uri(), digest=file_sha256(path))
    path = checkpoint_path(rev.checkpoint)
    if not path.exists():
        raise DeriveError(f"run {run_id}'s revision {revision}: its checkpoint {path} is missing (moved or pruned); "
                          f"choose another --fork, or restore the file")
    if file_sha256(path) != rev.checkpoint.digest:
        raise DeriveError(f"run {run_id}'s revision {revision}: its checkpoint {path} does not match its digest "
                          f"{rev.checkpoint.digest[:12]} (it was changed after it was published): refusing to train "
                          f"from different weights")
    return rev, where, rev.checkpoint


def _span(revs: list[int]) -> str:
    return "none" if not revs else f"r{revs[0]}" if len(revs) == 1 else f"r{revs[0]}..r{revs[-1]}"


# what a derived run trains with as its source did, unless a flag says otherwise: the rest of a recorded plan is the
# source's generation (its model, environments, run length, LoRA), which a derived run does not repeat
TRAINING_SETTINGS = ("credit", "credit_params", "batch_records", "batch_tokens", "lr", "weight_decay", "optimizer")


def training_settings(revisions: list[Any], *, credit: str | None = None, batch_records: int | None = None,
                      lr: float | None = None) -> dict[str, Any]:
    """A derived run's training settings: the flags given, else the source run's as its revision 0's plan records
    them (``TRAINING_SETTINGS``), else the services' defaults (left out). Another credit strategy drops the source's
    parameters; a batch size in records replaces a token budget. Epochs are not recorded (``rollout rl --epochs``):
    the trainer's default."""
    from consumers.settings import plan_values
    from schemas.plan import GenerationPlan

    raw = next((rev.plan for rev in revisions if rev.revision == 0 and rev.plan), None)
    values = plan_values(GenerationPlan.model_validate(raw), credit=False) if raw is not None else {}
    out = {k: values[k] for k in TRAINING_SETTINGS if values.get(k) is not None}
    if credit is not None and credit != out.get("credit"):
        out.pop("credit_params", None)
        out["credit"] = credit
    if batch_records is not None:
        out.pop("batch_tokens", None)
        out["batch_records"] = batch_records
    if lr is not None:
        out["lr"] = lr
    return out


def evaluation_plan(revisions: list[Any], recipe: str | None, fork: int):
    """The plan the derived run is evaluated by (``rollout.derived_evaluation.plan_for``), as its server is started
    for it (``server_plan``); None, said in one line, when there is none."""
    from rollout.derived_evaluation import NoPlan, plan_for, server_plan
    from schemas.plan import PlanError

    try:
        return server_plan(plan_for(revisions, recipe), revisions, fork)
    except NoPlan as e:
        print(f"not evaluated: {e}; give --plan RECIPE to evaluate on its held-out questions", file=sys.stderr)
    except PlanError as e:
        raise DeriveError(f"--plan: {e}") from None
    return None


def changed_settings(before: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """The settings (and shaping flags) a resumed derived run gives otherwise than its start recorded: a flag given
    then and left off now (``--gate``) differs too. A start that recorded no flags is compared on its derivation."""
    before = dict(before)
    flags = settings["flags"]
    before_flags = before.pop("flags", flags)
    return sorted([k for k in settings if k != "flags" and before.get(k) != settings[k]] +
                  [k for k in {**before_flags, **flags} if before_flags.get(k) != flags.get(k)])


async def publish_fork(kw: dict[str, Any], family: str, derivation, source, where, checkpoint,
                       flags: dict[str, Any]) -> bool:
    """The derived chain's first revision, with the derivation's settings and the flags that shape its training
    (``flags``: credit, batch, lr, bound, flush). Idempotent: a resumed run finds it, and is refused unless they are
    the ones the run started with (other settings would mix two runs). A run started before its flags were
    recorded is compared on its derivation alone."""
    from schemas.policy import PolicyRevision
    from streams.revisions import RevisionFollower, publish

    settings = {**derivation.model_dump(mode="json"), "flags": flags}
    async with RevisionFollower(kw, family) as follower:
        have = next((rev for _, rev in await follower.read_to_end() if rev.fork is not None), None)
    if have is not None:
        if changed := changed_settings(dict(have.derivation or {}), settings):
            raise DeriveError(f"derived run {derivation.run_id} was started with other settings ({', '.join(changed)}"
                              f" differ): resume it with its first flags, or start a new run without --run-id")
        return True
    await publish(kw, PolicyRevision(run_id=derivation.run_id, producer="derive", family=family,
                                     revision=source.revision, checkpoint=checkpoint, served_model=source.served_model,
                                     fork=source.ref(), source=where, derivation=settings))
    return False


async def run_derived(args: argparse.Namespace, kafka: Any) -> dict[str, Any]:
    from consumers import settings as service_settings
    from consumers.batching import HISTORY_AHEAD
    from consumers.credit import check_gates
    from consumers.runner import System
    from consumers.status import service_lag
    from schemas.history import Derivation
    from streams import topics

    lo, hi = _revision_range(args.revisions)
    rescore = rescore_of(args.rubric, args.scoring_kind)
    gates = gates_of(args.gate)
    run_id = args.run_id or f"derive-{uuid.uuid4().hex[:8]}"
    kw = kafka.client_kwargs()
    source_prefix = await find_source(kafka, args.source)
    pairs = await source_revisions(kw, source_prefix, args.source)
    source, where, checkpoint = fork_revision(pairs, args.source, args.fork, args.fork_checkpoint)
    flags = training_settings([rev for _, rev in pairs], credit=args.credit, batch_records=args.batch_records,
                              lr=args.lr)
    try:
        check_gates(flags.get("credit", service_settings.ServiceSettings.model_fields["credit"].default), gates)
    except ValueError as e:
        raise DeriveError(f"--gate: {e}") from None
    plan = None if args.no_evaluate else evaluation_plan([rev for _, rev in pairs], args.plan, args.fork)
    family = f"{source.family}.{run_id}"
    derivation = Derivation(run_id=run_id, source_run_id=args.source, source_prefix=source_prefix, fork=source.ref(),
                            from_revision=lo, to_revision=hi, since=args.since, until=args.until, rescore=rescore)
    os.environ["ROLLOUT_TOPIC_PREFIX"] = f"{run_id}."  # the derived run's own topics, groups and ids
    await topics.create_topics(kafka.admin_kwargs())
    shaping = {"credit": args.credit, "batch_records": args.batch_records, "lr": args.lr,
               "max_off_policy_steps": args.max_off_policy_steps, "flush_after_s": args.flush_after_s,
               **({"gates": [[g.reject_min, g.reject_max] for g in gates]} if gates else {})}
    resumed = await publish_fork(kw, family, derivation, source, where, checkpoint, shaping)
    cfg = service_settings.build(flags, family=family, derivation=derivation, flush_after_s=args.flush_after_s,
                                 max_off_policy_steps=args.max_off_policy_steps, group_timeout_s=args.group_timeout_s,
                                 admission_gates=gates,
                                 checkpoint_dir=args.checkpoint_dir or str(Path(".state/derived") / run_id))
    print(f"derived run {run_id}: from run {args.source} (topics {source_prefix}*), training {family} from "
          f"{source.family}@r{source.revision} at lr {cfg.lr:g}, credit {cfg.credit}, batches of "
          f"{cfg.batch_records or cfg.batch_tokens} {'records' if cfg.batch_records else 'tokens'}", file=sys.stderr)
    print(f"history rule: {derivation.rule().importance} (clip {derivation.rule().clip:g}) against the recorded "
          f"logprobs; at most {HISTORY_AHEAD} batches ahead of the trainer; records more than {cfg.max_off_policy_steps} revisions from the "
          f"target refused",
          file=sys.stderr)
    t0 = time.monotonic()
    quiet_s = 2 * cfg.flush_after_s + 4
    async with System(SERVICES, cfg, kw) as system, AsyncExitStack() as stack:
        arena = None
        if plan is not None:
            from rollout.derived_evaluation import evaluating

            # resumed: from the newest revision on (those before were answered in an earlier life)
            first = await newest_revision(kw, family) if resumed else source.revision
            arena = await stack.enter_async_context(evaluating(
                plan, family, first, kw, run_id, Path(cfg.checkpoint_dir), [rev for _, rev in pairs]))
            print(f"evaluation: {plan.source}'s held-out questions, revision {first} and every "
                  f"{plan.eval_interval} after, and the last", file=sys.stderr)
        last, still = None, time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            rows = {r["service"]: r for r in await service_lag(kw, sample_s=0.0, settings=cfg) if r["service"] in SERVICES}
            moved = tuple(r["committed"] for r in rows.values())
            if moved != last:
                last, still = moved, time.monotonic()
            if not args.no_progress:
                print("\r" + "  ".join(f"{s}: {rows[s]['committed']}/{rows[s]['end']}" for s in SERVICES if s in rows),
                      end="", file=sys.stderr, flush=True)
            caught_up = len(rows) == len(SERVICES) and all(r["lag"] == 0 for r in rows.values())
            # read to the end is not done: a group cut by the range is held by credit until GROUP_TIMEOUT_S (then
            # dead-lettered, GroupTimeout), a partial batch by the batcher until flush_after_s
            held = {name: n for name, n in held_input(system).items() if n}
            if caught_up and not args.follow and held and time.monotonic() - still >= quiet_s:
                print(f"\rcaught up; waiting for what is held: {', '.join(f'{s} {n} records' for s, n in held.items())}"
                      f" (incomplete groups go to the dead letters after {args.group_timeout_s:g}s)", end="",
                      file=sys.stderr, flush=True)
            if caught_up and not held and not args.follow and time.monotonic() - still >= quiet_s:
                if arena is not None and arena.last_revision is None:  # the last, then its answers scored
                    from rollout.derived_evaluation import LAST_REVISION_TIMEOUT_S

                    final = await newest_revision(kw, family)
                    if not await arena.evaluate_last(final, LAST_REVISION_TIMEOUT_S):
                        raise DeriveError(f"the last revision r{final} was not evaluated within "
                                          f"{LAST_REVISION_TIMEOUT_S:g}s ({arena.follow_error or 'not loaded'})")
                    still = time.monotonic()
                    continue
                break
    if not args.no_progress:
        print(file=sys.stderr)
    return {"run_id": run_id, "family": family, "seconds": time.monotonic() - t0 - quiet_s, "prefix": f"{run_id}.",
            "evaluated": arena.stats.evaluated_revisions if arena is not None else []}


async def newest_revision(kw: dict[str, Any], family: str) -> int:
    from streams.revisions import RevisionFollower

    async with RevisionFollower(kw, family) as follower:
        return max(rev.revision for _, rev in await follower.read_to_end())


def held_input(system: Any) -> dict[str, int]:
    """Records each service of ``system`` holds uncommitted in its state (credit's incomplete groups, the
    batcher's partial batch): input read, not yet turned into output."""
    return {name: sum(len(offsets) for task in list(proc.tasks.values()) for offsets in task.buffered().values())
            for name, proc in system.processors.items()}


def cmd_derive(args: argparse.Namespace) -> int:
    from streams.config import KafkaSettings, ensure_broker

    kafka = KafkaSettings.from_env()
    if not kafka.external:
        kafka = kafka.with_bootstrap(ensure_broker(kafka))
    try:
        out = asyncio.run(run_derived(args, kafka))
    except DeriveError as e:
        print(f"rollout derive: error: {e}", file=sys.stderr)
        return 2
    if out["evaluated"]:
        print(f"evaluated revisions {', '.join(f'r{r}' for r in out['evaluated'])} on the held-out questions "
              f"(v_eval_accuracy_by_revision, family {out['family']})")
    print(f"derived run {out['run_id']} caught up in {out['seconds']:.1f}s; replay both runs into one database "
          f"with: rollout replay --db {out['run_id']}.duckdb --run {out['run_id']}")
    return 0
