"""A derived run (`rollout derive`) against the live services on the same rollouts: seconds per 1,000 rollouts.

    python -m benchmarks derive [--quick] [--rollouts N] [--batch-records B]

Broker: ROLLOUT_BOOTSTRAP_SERVERS, else the local one. N single-turn arithmetic rollouts (groups of 4, the tiny
byte-level model, revision 0) are written once, on fresh topics, then:

* live: the verifier, credit, batcher and trainer (one ``System``) score, credit, batch and train them, as they
  would behind an arena; the clock runs from their start until the revision of the last batch is on the log;
* derived: ``rollout derive`` of that run (re-scored with another rubric, the same batch size), its own services
  on its own topics; the clock is the command's own (start to caught up, its quiet wait left out).

Both use an off-policy bound of N/B, so no record is refused on either side: the figure is the work, not the
rule. The derived batcher stays at most four batches ahead of its trainer (no arena paces history), the live one
builds every batch it can, so the difference is mostly that pacing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid


async def _seed(kw, run_id: str, groups: int) -> None:
    from aiokafka import AIOKafkaProducer

    from consumers import testing
    from streams import serde, topics
    from streams.settings import MAX_MESSAGE_BYTES

    prod = AIOKafkaProducer(**kw, transactional_id=f"bench-derive-{uuid.uuid4().hex[:6]}", enable_idempotence=True,
                            max_request_size=MAX_MESSAGE_BYTES)
    await prod.start()
    try:
        for chunk in range(0, groups, 100):
            async with prod.transaction():
                for g in range(chunk, min(chunk + 100, groups)):
                    for steps, ro in testing.arithmetic_group(f"g{g:06d}", 4, run_id=run_id):
                        for ev in (*steps, ro):
                            k, v, h = serde.to_message(ev)
                            await prod.send(topics.STEPS.name if ev is not ro else topics.ROLLOUTS.name, v, key=k,
                                            headers=h)
    finally:
        await prod.stop()


async def run(args: argparse.Namespace, settings) -> dict:
    from consumers import testing
    from consumers.runner import System
    from consumers.settings import ServiceSettings
    from consumers.trainer.step import initial_revision
    from rollout.cli import build_parser
    from rollout.derive_cmd import run_derived
    from streams import topics
    from streams.revisions import latest_revision, publish

    kw = settings.client_kwargs()
    n = args.rollouts - args.rollouts % 4
    revisions = -(-n // args.batch_records)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    os.environ["ROLLOUT_TOPIC_PREFIX"] = f"{run_id}."
    ckpt = f".state/bench-derive/{run_id}"
    await topics.create_topics(settings.admin_kwargs())
    await publish(kw, initial_revision(testing.FAMILY, ckpt, seed=0, run_id=run_id))
    await _seed(kw, run_id, n // 4)

    cfg = ServiceSettings(family=testing.FAMILY, batch_records=args.batch_records, flush_after_s=1.0,
                          max_off_policy_steps=revisions, checkpoint_dir=ckpt)
    t0 = time.perf_counter()
    async with System(("verifier", "credit", "batcher", "trainer"), cfg, kw):
        while (rev := await latest_revision(kw, testing.FAMILY)) is None or rev.revision < revisions:
            await asyncio.sleep(0.2)
    live_s = time.perf_counter() - t0
    out = await run_derived(build_parser().parse_args([
        "derive", run_id, "--rubric", "tests._rewards:fixed_sum", "--batch-records", str(args.batch_records),
        "--max-off-policy-steps", str(revisions), "--flush-after-s", "1", "--no-progress",
        "--checkpoint-dir", f"{ckpt}-derived"]), settings)
    derived_s = out["seconds"]
    return {"benchmark": "derive", "rollouts": n, "batch_records": args.batch_records, "revisions": revisions,
            "live_s": round(live_s, 2), "derived_s": round(derived_s, 2),
            "live_s_per_1000": round(live_s * 1000 / n, 2), "derived_s_per_1000": round(derived_s * 1000 / n, 2),
            "derived_over_live": round(derived_s / live_s, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks derive", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (about a minute)")
    ap.add_argument("--rollouts", type=int, default=None, help="source rollouts (default 2,000; 400 with --quick)")
    ap.add_argument("--batch-records", type=int, default=64)
    args = ap.parse_args(argv)
    args.rollouts = args.rollouts or (400 if args.quick else 2000)

    import logging

    logging.basicConfig(level=logging.ERROR)
    from streams.config import KafkaSettings, ensure_broker

    settings = KafkaSettings.from_env()
    if not settings.external:
        settings = settings.with_bootstrap(ensure_broker(settings))
    t0 = time.perf_counter()
    out = asyncio.run(run(args, settings))
    out["quick"], out["wall_s"] = args.quick, round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0
