"""Replay throughput (Kafka -> DuckDB) against a raw aiokafka consume, and audit-view time over 1M steps.

    python -m benchmarks replay [--quick] [--steps N] [--tokens N] [--query-steps N] [--reps N]

1. Produces a synthetic run (rollouts of 4 steps of --tokens completion tokens, scored) into fresh
   topics (prefix bench.replay.<id>.) with a transactional producer, as the pipeline would.
2. Reads every topic of it twice, alternately, --reps times each: a raw aiokafka consume (same
   consumer settings: no group, read_committed, same fetch sizes; counts messages and bytes, decodes
   nothing) and `rollout replay` into a fresh DuckDB file (decode, Arrow, insert, offsets).
   Best time of each is reported: steps/s and MB/s (frame bytes), and replay/raw ratio (target >= 0.6).
3. Synthesizes --query-steps steps (default 1,000,000) with their rollouts and rewards directly into
   DuckDB through Arrow (no Kafka: 1M steps of 512 tokens would be ~8 GB on the log) and times
   `SELECT * FROM v_reward_by_revision` (target < 1 s) and the other views.

Kafka: ROLLOUT_BOOTSTRAP_SERVERS, else the local broker (started if needed). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
import uuid

import numpy as np
import pyarrow as pa

from benchmarks._shared import kafka_for


async def raw_consume(settings, topic_names) -> tuple[float, int, int]:
    """Seconds, messages, bytes for one pass over the topics with a plain aiokafka consumer."""
    from aiokafka import AIOKafkaConsumer

    from replay.runs import assign_all, consumer_kwargs

    t0 = time.perf_counter()
    consumer = AIOKafkaConsumer(**consumer_kwargs(settings))
    await consumer.start()
    try:
        tps = await assign_all(consumer, topic_names)
        consumer.assign(tps)
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
        todo = {tp for tp in tps if end[tp] > begin[tp]}
        for tp in tps:
            consumer.seek(tp, begin[tp])
        n = nbytes = 0
        while todo:
            batch = await consumer.getmany(*todo, timeout_ms=200)
            for tp, records in batch.items():
                for r in records:
                    if r.offset >= end[tp]:
                        break
                    n += 1
                    nbytes += len(r.value)
            for tp in list(todo):
                if await consumer.position(tp) >= end[tp]:
                    todo.discard(tp)
    finally:
        await consumer.stop()
    return time.perf_counter() - t0, n, nbytes


def synth_steps_db(path: str, n_steps: int, *, revisions: int = 50, steps_per_rollout: int = 4,
                   list_len: int = 32, seed: int = 0) -> float:
    """n_steps steps (+ rollouts, scores, rewards) written through Arrow into the replay schema."""
    import duckdb

    from replay import tables as T

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    n_roll = n_steps // steps_per_rollout
    rollout_idx = np.arange(n_steps) // steps_per_rollout
    rollout_ids = np.array([f"rollout-{i:08d}" for i in range(n_roll)], dtype=object)
    rev_of_rollout = (np.arange(n_roll) * revisions // n_roll).astype(np.int64)
    roles = np.array(["solver", "pro", "con"], dtype=object)
    role_of_rollout = rng.integers(0, 2, n_roll)  # solver rollouts or pro/con debates
    step_role = np.where(role_of_rollout[rollout_idx] == 0, 0, 1 + (np.arange(n_steps) % 2))
    lens = np.full(n_steps, list_len, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 50000, offsets[-1], dtype=np.int32)))
    logprobs = pa.ListArray.from_arrays(pa.array(offsets), pa.array(-rng.random(offsets[-1], dtype=np.float32)))
    null_str = pa.nulls(n_steps, pa.string())
    steps = pa.table({
        "event_id": pa.array([f"e{i:09d}" for i in range(n_steps)]), "run_id": pa.array(["bench"] * n_steps),
        "producer": pa.array(["arena"] * n_steps),
        "created_at": pa.array(np.zeros(n_steps, dtype="datetime64[us]")).cast(T.TS),
        "causation_id": null_str, "schema_version": pa.array(np.ones(n_steps, dtype=np.int32)),
        "step_id": pa.array([f"step-{i:09d}" for i in range(n_steps)]),
        "rollout_id": pa.array(rollout_ids[rollout_idx]), "root_group_id": pa.array(rollout_ids[rollout_idx]),
        "step_index": pa.array((np.arange(n_steps) % steps_per_rollout).astype(np.int32)),
        "member_id": pa.array(roles[step_role]), "target": pa.array(["learner"] * n_steps),
        "trainable": pa.array(step_role != 2),
        "policy_family": pa.array(np.where(step_role != 2, "toy", None)),
        "policy_revision": pa.array(np.where(step_role != 2, rev_of_rollout[rollout_idx], 0), mask=step_role == 2),
        "policy_checkpoint_digest": null_str, "policy_exact": pa.array(np.ones(n_steps, dtype=bool)),
        "prompt": pa.array(["[]"] * n_steps),
        "completion": pa.array(["[]"] * n_steps), "tool_calls": pa.array(["[]"] * n_steps),
        "prompt_token_ids": tokens, "completion_token_ids": tokens, "completion_logprobs": logprobs,
        "n_prompt_tokens": pa.array(lens.astype(np.int32)), "n_completion_tokens": pa.array(lens.astype(np.int32)),
        "finish_reason": pa.array(["stop"] * n_steps), "latency_s": pa.array(rng.random(n_steps)),
        "_topic": pa.array(["steps"] * n_steps), "_partition": pa.array(np.zeros(n_steps, dtype=np.int32)),
        "_offset": pa.array(np.arange(n_steps, dtype=np.int64)),
        "_ts": pa.array(np.zeros(n_steps, dtype="datetime64[ms]")).cast(T.KAFKA_TS),
    }).cast(T.STEPS.schema)
    # rewards: solver rollouts one member, debates two (zero-sum)
    solver = role_of_rollout == 0
    win = rng.integers(0, 2, n_roll).astype(np.float64)
    rr = [(rollout_ids[solver], np.array(["solver"] * solver.sum(), dtype=object), win[solver]),
          (rollout_ids[~solver], np.array(["pro"] * (~solver).sum(), dtype=object), 2 * win[~solver] - 1),
          (rollout_ids[~solver], np.array(["con"] * (~solver).sum(), dtype=object), 1 - 2 * win[~solver])]
    rewards = pa.table({
        "score_event_id": pa.array(np.concatenate([r[0] for r in rr])),
        "rollout_id": pa.array(np.concatenate([r[0] for r in rr])),
        "member_id": pa.array(np.concatenate([r[1] for r in rr])),
        "reward": pa.array(np.concatenate([r[2] for r in rr])),
    }).cast(T.SCORE_REWARDS.schema)
    con = duckdb.connect(path)
    T.ensure_schema(con)
    con.register("s", steps)
    con.execute("INSERT INTO steps BY NAME SELECT * FROM s")
    con.register("r", rewards)
    con.execute("INSERT INTO score_rewards BY NAME SELECT * FROM r")
    con.execute("CHECKPOINT")
    con.close()
    return time.perf_counter() - t0


def time_views(path: str, views: list[str], reps: int = 3) -> dict[str, dict[str, float]]:
    import duckdb

    out = {}
    con = duckdb.connect(path, read_only=True)
    try:
        for v in views:
            times = []
            rows = 0
            for _ in range(reps):
                t0 = time.perf_counter()
                rows = len(con.execute(f"SELECT * FROM {v}").fetchall())
                times.append(time.perf_counter() - t0)
            out[v] = {"first_s": round(times[0], 4), "best_s": round(min(times), 4), "rows": rows}
    finally:
        con.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks replay", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5,000 steps through Kafka, 1 rep (under a minute)")
    ap.add_argument("--steps", type=int, help="steps through Kafka (default 20,000; quick 5,000)")
    ap.add_argument("--tokens", type=int, default=512, help="completion tokens per step (default 512)")
    ap.add_argument("--query-steps", type=int, default=1_000_000, help="steps synthesized for the view timing")
    ap.add_argument("--reps", type=int, help="passes of each reader (default 2; quick 1)")
    args = ap.parse_args(argv)
    n_steps = args.steps or (5000 if args.quick else 20000)
    reps = args.reps or (1 if args.quick else 2)

    settings = kafka_for("replay")
    from replay.ingest import Replayer
    from replay.runs import default_topics
    from replay.synthetic import generate_steps_run, produce
    from streams import topics

    names = default_topics()

    async def setup() -> tuple[float, int]:
        await topics.create_topics(settings.admin_kwargs())
        t0 = time.perf_counter()
        run = generate_steps_run(run_id, steps=n_steps, completion_tokens=args.tokens)
        t_gen = time.perf_counter() - t0
        nbytes = await produce(run.transactions, settings.client_kwargs(), names, transactional_id=f"bench-{run_id}")
        print(f"topics {os.environ['ROLLOUT_TOPIC_PREFIX']}*: produced {sum(run.counts().values())} messages ({nbytes / 1e6:.1f} MB) of run {run_id} "
              f"in {time.perf_counter() - t0:.1f} s (generation {t_gen:.1f} s)", flush=True)
        return nbytes, sum(run.counts().values())

    run_id = uuid.uuid4().hex
    produced_bytes, produced_msgs = asyncio.run(setup())
    raw_best = rep_best = None
    with tempfile.TemporaryDirectory() as tmp:
        raw_cpu = rep_cpu = raw_loop = rep_loop = None
        for i in range(reps):
            c0, l0 = time.process_time(), time.thread_time()
            t, n, b = asyncio.run(raw_consume(settings, names.values()))
            raw_cpu = min(raw_cpu or 1e9, time.process_time() - c0)
            raw_loop = min(raw_loop or 1e9, time.thread_time() - l0)
            assert n == produced_msgs, (n, produced_msgs)
            raw_best = min(raw_best or t, t)
            print(f"raw consume   pass {i + 1}: {n} messages, {b / 1e6:.1f} MB in {t:.2f} s "
                  f"({b / 1e6 / t:.1f} MB/s)", flush=True)
            db = os.path.join(tmp, f"replay{i}.duckdb")
            t0, c0, l0 = time.perf_counter(), time.process_time(), time.thread_time()
            result = asyncio.run(Replayer(db, settings, run_id=run_id).run())
            t = time.perf_counter() - t0
            rep_cpu = min(rep_cpu or 1e9, time.process_time() - c0)
            rep_loop = min(rep_loop or 1e9, time.thread_time() - l0)
            assert result.rows["steps"] == n_steps, result.rows
            rep_best = min(rep_best or t, t)
            print(f"rollout replay pass {i + 1}: {result.messages} messages, {result.bytes / 1e6:.1f} MB in {t:.2f} s "
                  f"({result.bytes / 1e6 / t:.1f} MB/s); phases: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in result.timings.items()), flush=True)
            if rep_best == t:
                phases = {k: round(v, 3) for k, v in result.timings.items()}
            os.remove(db)

        qdb = os.path.join(tmp, "query.duckdb")
        t_synth = synth_steps_db(qdb, args.query_steps)
        print(f"synthesized {args.query_steps} steps into DuckDB via Arrow in {t_synth:.1f} s", flush=True)
        views = time_views(qdb, ["v_reward_by_revision", "v_token_counts"])
        for v, r in views.items():
            print(f"  {v}: first {r['first_s']:.3f} s, best {r['best_s']:.3f} s ({r['rows']} rows)", flush=True)

    raw_mbps = produced_bytes / 1e6 / raw_best
    rep_mbps = produced_bytes / 1e6 / rep_best
    out = {
        "benchmark": "replay", "quick": args.quick, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "kafka": settings.bootstrap, "steps": n_steps, "completion_tokens_per_step": args.tokens,
        "messages": produced_msgs, "mb": round(produced_bytes / 1e6, 2), "reps": reps,
        "raw_consume": {"seconds": round(raw_best, 3), "cpu_s": round(raw_cpu, 3), "loop_cpu_s": round(raw_loop, 3),
                        "steps_per_s": round(n_steps / raw_best),
                        "mb_per_s": round(raw_mbps, 1)},
        "replay": {"seconds": round(rep_best, 3), "cpu_s": round(rep_cpu, 3), "loop_cpu_s": round(rep_loop, 3),
                   "steps_per_s": round(n_steps / rep_best),
                   "mb_per_s": round(rep_mbps, 1), "phases_s": phases},
        "replay_vs_raw": round(raw_best / rep_best, 3), "replay_vs_raw_target": 0.6,
        "replay_vs_raw_cpu": round(raw_cpu / rep_cpu, 3), "load_avg_1m": round(os.getloadavg()[0], 1),
        "query_steps": args.query_steps, "query_steps_source": "synthesized into DuckDB via Arrow (not via Kafka)",
        "reward_by_revision_s": views["v_reward_by_revision"]["best_s"],
        "reward_by_revision_first_s": views["v_reward_by_revision"]["first_s"], "reward_by_revision_target_s": 1.0,
        "views": views,
    }
    out["ok"] = out["replay_vs_raw"] >= 0.6 and out["reward_by_revision_first_s"] < 1.0
    print(json.dumps(out))
    return 0
