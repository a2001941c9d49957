"""A chaos run: the whole loop as an operator deploys it, each process SIGKILLed in turn, the disk filled, then counted.

    python -m benchmarks chaos [--quick] [--model tiny|smollm2] [--max-steps N] [--seed S]

The loop of ``rollout rl`` as separate processes (docs/DEPLOY.md): ``rollout serve`` verifier, credit, batcher and
trainer, a pool of inference servers (``rollout serve policy`` for the tiny byte-level model, ``rollout serve
vllm`` for SmolLM2-135M-Instruct) and ``rollout arena`` over the pool, on the broker (ROLLOUT_BOOTSTRAP_SERVERS, else
the local one). The recipe trains on the test package ``rlt-sum-quiz`` (found by id) whose reward raises on a fraction
of calls and never returns on another (``reward_error_rate``, ``reward_hang_rate``: a hung tool), the arena with a
short ``--rollout-timeout``. Once the first revision is on the log, a supervisor SIGKILLs each process group in turn
(verifier, credit, batcher, trainer, the arena, one server of the pool) at random moments and restarts it after a
moment, as an operator's supervisor would (anything that exits on its own is restarted too, and counted); once, it
fills the trainer's checkpoint disk (a tmpfs: run as root) and frees it ``--disk-full-s`` later.

When the arena has reached ``max_steps`` and the services are drained, everything is stopped and the run replayed
into DuckDB and audited. Printed: rollouts generated, failed (with reasons), records trained once and twice (must be
0), rollouts admitted but neither trained nor dead-lettered (must be 0), revisions reached against max_steps, the
checkpoint folder's size against what the last committed revision needs, and processes left alive (must be 0).
``--quick`` (CI's form): the tiny model, 6 revisions, each process killed once. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARK = "ROLLOUT_CHAOS_RUN"  # in every process this run starts: what is left alive is found by it

RECIPE = """
max_steps = {steps}
seq_len = 512

[model]
name = "{model}"

[orchestrator]
batch_size = 16
group_size = 4
max_off_policy_steps = 2

[orchestrator.train.sampling]
max_completion_tokens = 16

[[orchestrator.train.source]]
name = "rlt-sum-quiz"

[orchestrator.train.source.env.taskset]
id = "rlt-sum-quiz"
split = "train"
reward_error_rate = {error_rate}
reward_hang_rate = {hang_rate}

[orchestrator.train.source.env.agent.harness]
id = "null"

[orchestrator.train.source.env.agent.runtime]
type = "subprocess"
"""


class Proc:
    """One supervised process: started in a process group of its own, so a kill takes its children with it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logs: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, logs / f"{name}.log"
        self.p: subprocess.Popen | None = None
        self.kills = self.restarts = self.unplanned = 0
        self.done = False  # exited 0 on its own, for good (the arena at the run's end)

    def start(self) -> None:
        from producers.inference.children import die_with_parent

        out = open(self.log, "ab")
        try:
            self.p = subprocess.Popen([sys.executable, "-m", "rollout.cli", *self.argv], cwd=ROOT, env=self.env,
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=die_with_parent)
        finally:
            out.close()

    def kill(self) -> None:
        if self.p is not None and self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
            self.kills += 1

    def stop(self, grace_s: float = 20.0) -> None:
        if self.p is None or self.p.poll() is not None:
            return
        os.killpg(self.p.pid, signal.SIGTERM)
        try:
            self.p.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()

    def tail(self, n: int = 1500) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def _left_alive(run: str) -> list[str]:
    """Processes whose environment carries this run's mark."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if f"{MARK}={run}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")[:120].decode(errors="replace")
                found.append(f"{entry.name} {cmdline}")
        except OSError:
            continue
    return found


class Disk:
    """The checkpoint folder on a tmpfs of its own, which can be filled and freed."""

    def __init__(self, where: Path, size_mb: int) -> None:
        self.where, self.filler = where, where / "filler"
        where.mkdir(parents=True)
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"chaos: cannot mount a tmpfs for the checkpoints (run as root): {out.stderr.strip()}")

    def fill(self) -> None:
        free = shutil.disk_usage(self.where).free
        with open(self.filler, "wb") as f:  # tmpfs allocates on write: all but 1 MiB
            chunk = b"\0" * (1 << 20)
            for _ in range(max(0, free // len(chunk) - 1)):
                f.write(chunk)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.where)], check=False)


async def _latest(kw: dict, family: str) -> int:
    from streams.revisions import latest_revision

    rev = await latest_revision(kw, family)
    return -1 if rev is None else rev.revision


async def _drained(kw: dict, cfg: Any, services: list[str]) -> bool:
    from consumers.status import service_lag

    rows = {r["service"]: r for r in await service_lag(kw, sample_s=0.0, settings=cfg)}
    return all(s in rows and rows[s]["lag"] == 0 for s in services)


async def run(args: argparse.Namespace, settings) -> dict:
    from consumers import settings as service_settings
    from consumers.trainer.state import revision_files
    from consumers.trainer.step import initial_revision
    from policy.checkpoint import checkpoint_path
    from replay.audit import run_audit
    from replay.ingest import Replayer
    from schemas.plan_compiler import compile_plan
    from schemas.policy import TINY_FAMILY
    from streams import topics
    from streams.local_broker import free_port
    from streams.revisions import publish

    rng = random.Random(args.seed)
    kw = settings.client_kwargs()
    prefix, run_id = os.environ["ROLLOUT_TOPIC_PREFIX"], f"chaos-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="rollout-chaos-"))
    tiny = args.model == "tiny"
    recipe = work / "recipe.toml"
    recipe.write_text(RECIPE.format(steps=args.max_steps, model=TINY_FAMILY if tiny else
                                    "HuggingFaceTB/SmolLM2-135M-Instruct", error_rate=args.reward_error_rate,
                                    hang_rate=args.reward_hang_rate))
    plan = compile_plan(str(recipe))
    disk = Disk(work / "checkpoints", args.disk_mb or (64 if tiny else 6144))
    ck = disk.where
    keep = 3
    procs: dict[str, Proc] = {}
    figures: dict[str, Any] = {"run": run_id, "model": args.model, "max_steps": args.max_steps, "work": str(work)}
    try:
        await topics.create_topics(settings.admin_kwargs())
        served = None
        if not tiny:
            from policy.served import served_model

            served = served_model(plan.family)
            plan = plan.model_copy(update={"served_model": served.note})
        rev0 = initial_revision(plan.family, ck, seed=0, run_id=run_id, served=served)
        await publish(kw, rev0.model_copy(update={"plan": plan.model_dump(mode="json")}))
        env = {**os.environ, MARK: run_id, "ROLLOUT_BOOTSTRAP_SERVERS": settings.bootstrap,
               "ROLLOUT_TOPIC_PREFIX": prefix, "PYTHONPATH": str(ROOT)}
        logs = work / "logs"
        logs.mkdir()
        urls = []
        for i in range(args.pool):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}/v1")
            server = ["serve", "policy", "--port", str(port), "--checkpoint", str(checkpoint_path(rev0.checkpoint)),
                      "--metrics-port", "0"] if tiny else \
                ["serve", "vllm", "--port", str(port), "--max-model-len", "512", "--metrics-port", "0"]
            procs[f"server-{i}"] = Proc(f"server-{i}", server, env, logs)
        common = ["--plan", str(recipe), "--metrics-port", "0"]
        group = ["--group-timeout-s", "30"]  # credit holds an incomplete group this long; the batcher waits for it
        for name, extra in (("verifier", []), ("credit", group), ("batcher", group),
                            ("trainer", ["--checkpoint-dir", str(ck), "--keep-checkpoints", str(keep)])):
            procs[name] = Proc(name, ["serve", name, *common, *extra], env, logs)
        procs["arena"] = Proc("arena", [
            "arena", str(recipe), "--groups", "0", "--follow-revisions", "--until-revision", str(args.max_steps),
            "--policy", "local" if tiny else "vllm", "--policy-url", ",".join(urls), "--run-id", run_id,
            "--arena-id", f"{run_id}-arena", "--no-progress", "--await-servers", "600",
            "--rollout-timeout", str(args.rollout_timeout)], env, logs)
        for p in procs.values():
            p.start()

        victims = ["verifier", "credit", "batcher", "trainer", "arena"] + (["server-1"] if args.pool > 1 else [])
        schedule = [v for _ in range(args.rounds) for v in rng.sample(victims, len(victims))]
        fill_before = rng.randrange(len(schedule)) if schedule else None  # the disk fills before this many kills left
        start = time.monotonic()
        next_kill: float | None = None  # drawn once the first revision is on the log
        killed: list[dict[str, Any]] = []
        disk_full = None
        drained = ["verifier", "credit", "batcher", "trainer"]
        cfg = service_settings.build(plan=plan, credit=True)
        while time.monotonic() < start + args.timeout:
            await asyncio.sleep(1.0)
            for p in procs.values():  # the supervisor: whatever exited is started again
                if p.p is not None and p.p.poll() is not None and not p.done:
                    if p.name == "arena" and p.p.returncode == 0:
                        p.done = True
                        continue
                    print(f"chaos: {p.name} exited (rc {p.p.returncode}) on its own; restarting it\n{p.tail(600)}",
                          file=sys.stderr)
                    p.unplanned += 1
                    p.restarts += 1
                    p.start()
            now, latest = time.monotonic(), await _latest(kw, plan.family)
            if disk_full is not None and now - disk_full >= args.disk_full_s:
                disk.free()
                print(f"chaos: disk freed after {now - disk_full:.0f}s", file=sys.stderr)
                disk_full = None
            if procs["arena"].done:
                if disk_full is None and await _drained(kw, cfg, drained):
                    await asyncio.sleep(cfg.flush_after_s + 2.0)  # a partial batch is flushed, then trained or refused
                    if await _drained(kw, cfg, drained):
                        break
                continue
            if not schedule or latest < 1:
                continue
            if next_kill is None:
                next_kill = now + rng.uniform(*args.kill_every)
            if now < next_kill:
                continue
            if len(schedule) == fill_before + 1 and disk_full is None:
                disk.fill()
                disk_full = time.monotonic()
                print(f"chaos: checkpoint disk filled at r{latest}", file=sys.stderr)
            victim = schedule.pop(0)
            p = procs[victim]
            p.kill()
            killed.append({"process": victim, "at_revision": latest, "s": round(now - start, 1)})
            print(f"chaos: SIGKILLed {victim} at r{latest}", file=sys.stderr)
            await asyncio.sleep(rng.uniform(0.5, 3.0))
            p.restarts += 1
            p.start()
            next_kill = time.monotonic() + rng.uniform(*args.kill_every)
        else:
            figures["timed_out"] = True
        figures["run_s"] = round(time.monotonic() - start, 1)
        disk.free()
        figures["kills"] = killed
        figures["restarts"] = {n: p.restarts for n, p in procs.items() if p.restarts}
        figures["unplanned_exits"] = {n: p.unplanned for n, p in procs.items() if p.unplanned}
    finally:
        for name in ("arena", "verifier", "credit", "batcher", "trainer", *[n for n in procs if n.startswith("server")]):
            if name in procs:
                procs[name].stop()
        time.sleep(2.0)
        figures["processes_left_alive"] = _left_alive(run_id)
        files = revision_files(ck, plan.family) if ck.is_dir() else []
        figures["checkpoint_folder"] = _disk_figures(files, keep)
        disk.close()
    db = str(work / "chaos.duckdb")
    await Replayer(db, settings, run_id=run_id, prefix=prefix).run()
    report = run_audit(db)
    figures["audit_violations"] = [v.message for v in report.violations][:5]
    figures.update(_counts(db, plan.family))
    return figures


def _disk_figures(files: list[tuple[int, str, Path]], keep: int) -> dict[str, Any]:
    """The folder by kind, against what the last committed revision needs: its newest ``keep`` checkpoints and its
    newest training state (revision 0, the run's first weights, is kept and not counted)."""

    def size(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size

    later = [(n, kind, p) for n, kind, p in files if n > 0]
    ckpts = sorted((n, p) for n, kind, p in later if kind == "checkpoint")
    states = sorted((n, p) for n, kind, p in later if kind == "state")
    needed = {p for _, p in ckpts[-keep:]} | {p for _, p in states[-1:]}
    return {"files": dict(Counter(kind for _, kind, _ in later)), "mb": round(sum(size(p) for *_, p in later) / 1e6, 1),
            "needed_mb": round(sum(size(p) for p in needed) / 1e6, 1),
            "beyond_needed": sorted(p.name for *_, p in later if p not in needed)}


def _counts(db: str, family: str) -> dict[str, Any]:
    import duckdb

    with duckdb.connect(db, read_only=True) as con:
        one = lambda sql, *a: con.execute(sql, list(a)).fetchone()  # noqa: E731
        rollouts, distinct = one("SELECT count(*), count(DISTINCT rollout_id) FROM rollouts WHERE NOT evaluation")
        failed = dict(con.execute("""
            SELECT coalesce(split_part(failure_reason, ':', 1), '?'), count(*) FROM rollouts
            WHERE NOT evaluation AND status = 'failed' GROUP BY 1 ORDER BY 2 DESC""").fetchall())
        con.execute("""
            CREATE TEMP TABLE trained AS
            SELECT br.record_id, br.batch_id FROM batch_records br
            JOIN (SELECT DISTINCT batch_id FROM policy_revisions WHERE batch_id IS NOT NULL) t USING (batch_id)
            WHERE br.record_id NOT IN (SELECT raw_subject_id FROM dead_letters WHERE partial
                                       AND raw_subject_id IS NOT NULL)""")
        once, twice = one("SELECT count(DISTINCT record_id), count(*) - count(DISTINCT record_id) FROM trained")
        named_twice = one("SELECT count(*) - count(DISTINCT batch_id) FROM policy_revisions "
                          "WHERE batch_id IS NOT NULL AND family = ?", family)[0]
        lost = con.execute("""
            SELECT r.rollout_id FROM rollouts r
            WHERE NOT r.evaluation AND r.status <> 'failed'
              AND NOT EXISTS (SELECT 1 FROM training_records tr JOIN trained t USING (record_id)
                              WHERE tr.rollout_id = r.rollout_id)
              AND NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.raw_subject_id = r.rollout_id
                              OR d.raw_subject_id IN (SELECT record_id FROM training_records tr
                                                      WHERE tr.rollout_id = r.rollout_id)
                              OR d.raw_subject_id IN (SELECT br.batch_id FROM batch_records br
                                                      JOIN training_records tr USING (record_id)
                                                      WHERE tr.rollout_id = r.rollout_id))""").fetchall()
        letters = dict(con.execute("SELECT service || ':' || error_type, count(*) FROM dead_letters "
                                   "GROUP BY 1 ORDER BY 2 DESC").fetchall())
        reached = one("SELECT max(revision) FROM policy_revisions WHERE family = ?", family)[0]
    return {"rollouts": rollouts, "rollouts_doubled": rollouts - distinct, "failed": sum(failed.values()),
            "failed_reasons": failed, "records_trained_once": once, "records_trained_twice": twice,
            "batches_trained_twice": named_twice, "admitted_not_trained_not_dead_lettered": len(lost),
            "lost_examples": [r[0] for r in lost[:5]], "dead_letters": letters, "revisions_reached": reached}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI's form: the tiny model, 6 revisions, one round of kills")
    p.add_argument("--model", choices=("tiny", "smollm2"), help="default: tiny with --quick, else smollm2 on vLLM")
    p.add_argument("--max-steps", type=int, help="revisions to train (default 6 quick, 16)")
    p.add_argument("--pool", type=int, default=2, help="inference servers in the arena's pool (default 2)")
    p.add_argument("--rounds", type=int, help="times each process is killed (default 1 quick, 2)")
    p.add_argument("--kill-every", type=float, nargs=2, metavar=("MIN_S", "MAX_S"),
                   help="seconds between kills, drawn uniformly (default 4 10 quick, 15 40)")
    p.add_argument("--disk-full-s", type=float, default=40.0,
                   help="how long the checkpoint disk stays full (default 40: past the trainer's 30 s retry)")
    p.add_argument("--disk-mb", type=int, help="the checkpoint tmpfs's size (default 64 tiny, 6144 smollm2)")
    p.add_argument("--reward-error-rate", type=float, default=0.05)
    p.add_argument("--reward-hang-rate", type=float, default=0.03)
    p.add_argument("--rollout-timeout", type=float,
                   help="the arena's --rollout-timeout (default 15 tiny; 120 smollm2, whose rollouts queue behind "
                        "two vLLMs and a trainer on the machine's cores)")
    p.add_argument("--timeout", type=float, help="give up after this many seconds (default 900 quick, 3600)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.model = args.model or ("tiny" if args.quick else "smollm2")
    args.max_steps = args.max_steps or (6 if args.quick else 16)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.kill_every = tuple(args.kill_every or ((4.0, 10.0) if args.quick else (15.0, 40.0)))
    args.timeout = args.timeout or (900.0 if args.quick else 3600.0)
    args.rollout_timeout = args.rollout_timeout or (15.0 if args.model == "tiny" else 120.0)
    from benchmarks._shared import kafka_for, report

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: its processes stopped, its tmpfs unmounted
    settings = kafka_for("chaos")
    return report(lambda a: run(a, settings), args)


if __name__ == "__main__":
    sys.exit(main())
