"""A run's closing summary: what the arena reported, what the log holds (revisions, rewards, dead letters,
evaluations), as one JSON line and a few readable ones."""

from __future__ import annotations

import json
from collections import Counter

from rollout.run_view import Progress, mean


def arena_stats_from(out: bytes) -> dict | None:
    """The JSON line the arena ends with."""
    lines = out.decode(errors="replace").splitlines()
    return next((json.loads(line) for line in reversed(lines) if line.startswith("{")), None)


async def summarize(kw, progress: Progress, arena_stats: dict) -> dict:
    from aiokafka import AIOKafkaConsumer

    from schemas import codec
    from streams import topics

    async def read(topic: str) -> list:
        c = AIOKafkaConsumer(topic, **kw, group_id=None, isolation_level="read_committed",
                             auto_offset_reset="earliest", max_partition_fetch_bytes=64 * 1024 * 1024)
        await c.start()
        out, idle = [], 0
        try:
            while idle < 3:
                got = await c.getmany(timeout_ms=300)
                n = sum(len(v) for v in got.values())
                idle = idle + 1 if n == 0 else 0
                for recs in got.values():
                    out.extend(codec.decode(r.value) for r in recs)
        finally:
            await c.stop()
        return out

    rollouts = await read(topics.ROLLOUTS.name)
    batches = await read(topics.TRAINER_BATCHES.name)
    letters = await read(topics.DEAD_LETTERS.name)
    r4 = lambda v: round(v, 4)  # noqa: E731
    history = [m for _, m in sorted(progress.revisions.items()) if m]  # each trained revision's step figures
    first = min((r.created_at for r in rollouts if not r.evaluation), default=None)
    metrics = {str(k): {n: r4(x) for n, x in m.items()} for k, m in sorted(progress.revisions.items()) if m}
    return {
        "rollouts": sum(not r.evaluation for r in rollouts), "eval_rollouts": sum(r.evaluation for r in rollouts),
        "first_rollout_at": first.timestamp() if first is not None else None,  # the first training rollout's
        "failed_rollouts": sum(r.status == "failed" for r in rollouts),
        "failure_reasons": dict(Counter(arena_stats.get("failure_reasons") or {}).most_common(5)),  # the arena's count
        "scored": progress.scored, "eval_scored": progress.eval_scored,
        "batches": len(batches), "records_in_batches": sum(len(b.records) for b in batches),
        "revisions": max(progress.revisions, default=0),
        "dead_letters": len(letters),
        "dead_letter_reasons": dict(Counter(f"{d.service}: {d.error_type}" for d in letters)),
        "eval_accuracy_by_revision": {str(k): r4(mean(v)) for k, v in sorted(progress.evals.items())},
        "eval_questions_by_revision": {str(k): len(v) for k, v in sorted(progress.evals.items())},
        "mean_reward_by_revision": {str(k): r4(mean(v)) for k, v in sorted(progress.train.items())},
        "reward_parts_by_revision": {n: {str(k): r4(mean(v)) for k, v in sorted(p.items())}
                                     for n, p in progress.parts.items()},
        "rollouts_by_revision": {str(k): len(v) for k, v in sorted(progress.train.items())},
        "trainer_metrics_by_revision": metrics,
        "trainer_losses": [r4(h["loss"]) for h in history if "loss" in h][:50],
        "step_s": [round(h["step_s"], 2) for h in history if "step_s" in h],
        "reload_s": arena_stats.get("reload_s", []),
        "arena": {k: arena_stats.get(k) for k in ("rollouts", "evaluations", "failed", "completion_tokens",
                                                  "elapsed_s", "eval_s", "eval_s_each", "evaluated_revisions", "final_revision",
                                                  "final_revision_reached")},
    }


def print_summary(s: dict) -> None:
    why = ": " + "; ".join(f"{reason} (x{n})" for reason, n in s["failure_reasons"].items()) if s["failure_reasons"] else ""
    print(f"\nrun {s['run']} ({s['policy']}): rollouts {s['rollouts']} (+{s['eval_rollouts']} evaluation, "
          f"{s['failed_rollouts']} failed{why}), batches {s['batches']} ({s['records_in_batches']} records), "
          f"revisions published {s['revisions']}, dead letters {s['dead_letters']} {s['dead_letter_reasons'] or ''}")
    if s.get("served_model"):
        print(f"model: {s['served_model']}: these results are that model's, not {s['family']}'s")
    evals = s["eval_accuracy_by_revision"]
    if evals:
        first, last = next(iter(evals)), list(evals)[-1]
        print(f"held-out eval accuracy (greedy, {s['eval_questions_by_revision'][first]} questions never trained on): "
              f"r{first} {evals[first]:.1%} -> r{last} {evals[last]:.1%}")
        print("  " + "  ".join(f"r{k} {v:.0%}" for k, v in evals.items()))
    names = list(s["reward_parts_by_revision"])
    print("training reward by the revision that generated the rollouts:")
    for rev, r in s["mean_reward_by_revision"].items():
        parts = "  ".join(f"{n} {s['reward_parts_by_revision'][n].get(rev, 0.0):.3f}" for n in names)
        m = s["trainer_metrics_by_revision"].get(str(int(rev) + 1), {})
        mm = (f"  step r{rev}->r{int(rev) + 1}: logprob mismatch mean {m['mismatch_mean']:.4f} "
              f"max {m['mismatch_max']:.3f}" if "mismatch_mean" in m else "")
        print(f"  r{rev:>3}: {r:.3f}  ({s['rollouts_by_revision'][rev]} rollouts)  {parts}{mm}")
    if s["step_s"]:
        steps = s["step_s"]
        print(f"trainer step: mean {sum(steps) / len(steps):.1f}s over {len(steps)} steps; weight reload into "
              f"the server: {', '.join(f'{x:.2f}' for x in s['reload_s'][:8])}{' ...' if len(s['reload_s']) > 8 else ''} s")
    first = f" (the first training rollout {s['first_rollout_s']:.0f}s after the command started)" \
        if s.get("first_rollout_s") is not None else ""
    print(f"wall time {s['seconds']:.0f}s{first}\n")
    print("next: look at this run from the log")
    print("  .venv/bin/rollout runs                                # this run is listed first")
    print(f"  .venv/bin/rollout dashboard --prefix {s['topic_prefix']}    # its live page at http://127.0.0.1:8050")
    print("  .venv/bin/rollout replay --db run.duckdb              # the most recent run into DuckDB")
    print("  .venv/bin/rollout sql --db run.duckdb \"SELECT * FROM v_eval_accuracy_by_revision\"")
    print("  .venv/bin/rollout audit --db run.duckdb && .venv/bin/rollout report --db run.duckdb --out report.html")
