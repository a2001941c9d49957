"""The README's main job, `rollout demo`, end to end on the test broker: the real loop (vLLM serving
SmolLM2-135M-Instruct, the HF trainer) closes, revisions are served by vLLM and evaluated at the cadence asked and
at the run's last, and the replayed run audits clean; the fast tiny-model loop closes and learns."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from policy.hf import cpu_bf16

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


def test_demo_closes_the_loop_and_reward_rises(kafka_bootstrap, tmp_path):
    groups = 192
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    # run from the user's own folder, the plan named relative to it (the arena, a child in the project's folder,
    # once could not find it there)
    (tmp_path / "plan.toml").write_text((ROOT / "examples" / "plans" / "arithmetic.toml").read_text())
    out = subprocess.run([sys.executable, "-m", "rollout.cli", "demo", "--policy", "tiny", "--groups", str(groups),
                          "--plan", "plan.toml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout[-2500:])
    s = json.loads(out.stdout.strip().splitlines()[-1])
    rollouts = groups * 8
    assert s["rollouts"] == s["scored"] == rollouts
    # every rollout's one trainable step is in exactly one batch, or was refused as stale by the batcher (with
    # its reason); the trainer may still refuse a batched record that is stale from the revision it holds
    reasons = s["dead_letter_reasons"]
    stale, at_trainer = reasons.get("batcher: StaleRecordError", 0), reasons.get("trainer: StaleRecordError", 0)
    assert s["records_in_batches"] + stale == rollouts and s["dead_letters"] == stale + at_trainer, reasons
    assert stale + at_trainer <= rollouts // 20, reasons
    assert s["revisions"] >= 10
    assert 0 < s["first_rollout_s"] < s["seconds"]  # the first training rollout, from the command's start
    rewards = [s["mean_reward_by_revision"][k] for k in sorted(s["mean_reward_by_revision"], key=int)]
    # learning, not noise: the last three revisions' rollouts score clearly above revision 0's
    assert sum(rewards[-3:]) / 3 > max(2 * rewards[0], rewards[0] + 0.1), rewards


@pytest.mark.timeout(1500)  # a CPU without fast bf16 kernels trains and serves in float32: slower steps
def test_demo_on_vllm_trains_serves_and_evaluates_revisions(kafka_bootstrap, vllm_server, tmp_path):
    groups = 16  # 128 rollouts: 4 batches of the plan's 32
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    env.pop("ROLLOUT_TOPIC_PREFIX", None)
    out = subprocess.run([sys.executable, "-m", "rollout.cli", "demo", "--groups", str(groups), "--no-progress",
                          "--eval-interval", "3", "--vllm-url", vllm_server.base_url, "--cores", "turns"], cwd=ROOT,
                         env=env,
                         capture_output=True, text=True, timeout=1400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout[-3000:])
    s = json.loads(out.stdout.strip().splitlines()[-1])
    assert s["policy"] == "vllm" and s["rollouts"] == s["scored"] == groups * 8
    assert s["failed_rollouts"] == 0, s["failure_reasons"]
    stale = sum(n for k, n in s["dead_letter_reasons"].items() if k.endswith(": StaleRecordError"))
    assert s["records_in_batches"] + stale == groups * 8 and s["dead_letters"] == stale
    # one batch, one optimizer step of the plan's batch_size (32), one revision; paced, nothing went stale
    assert s["batches"] == s["revisions"] and s["records_in_batches"] == 32 * s["batches"] == groups * 8
    # --cores turns with the fixture's server (on this machine): generation and training took turns, bound 0
    assert s["cores"] == "turns" and all(n == 32 for n in s["rollouts_by_revision"].values())
    # 4 revisions trained from batches; revision 0, every 3rd and the last (4) answer the held-out set, each loaded
    # into the running vLLM first (one with no evaluation due may be skipped for a newer one)
    assert s["revisions"] == 4
    evaluated = sorted(int(k) for k in s["eval_accuracy_by_revision"])
    assert evaluated == s["arena"]["evaluated_revisions"] == [0, 3, 4]
    assert len(s["reload_s"]) >= len(evaluated) and s["arena"]["eval_s"] > 0
    each = s["arena"]["eval_s_each"]  # one a revision evaluated, adding up to the whole
    assert len(each) == 3 and min(each) > 0 and sum(each) == pytest.approx(s["arena"]["eval_s"], abs=0.02)
    # the first training rollout on the log, from the command's start: after the run began, before it ended
    assert 0 < s["first_rollout_s"] < s["seconds"]
    assert set(s["eval_questions_by_revision"].values()) == {48}
    for r in range(1, s["revisions"] + 1):  # every trained revision carries the trainer-inference mismatch
        m = s["trainer_metrics_by_revision"][str(r)]
        assert m["step_s"] > 0 and ("mismatch_mean" in m) == (m["mismatch_tokens"] > 0)
    measured = [m["mismatch_mean"] for m in s["trainer_metrics_by_revision"].values() if "mismatch_mean" in m]
    assert measured and all(0 <= x < 0.5 for x in measured), measured
    if not cpu_bf16():  # float32 on both sides, the served weights exactly the trained ones: float noise at most
        assert max(measured) < 1e-4, measured
    else:  # bf16: vLLM's kernels and torch's round differently, and the trainer measures it
        assert max(measured) > 0, measured
    # the finished run keeps its checkpoints (derive forks from them), not its training states (no take-over comes)
    ckdir = ROOT / ".state" / "demo" / s["run"] / "checkpoints"
    assert list(ckdir.glob("*/model.safetensors")) and not list(ckdir.glob("*.train")), list(ckdir.iterdir())
    # the run is found with no prefix set, replays, and audits clean: every Step's revision is on the log
    db = tmp_path / "run.duckdb"
    for cmd in (["replay", "--db", str(db), "--run", s["run"]], ["audit", "--db", str(db), "--format", "json"]):
        res = subprocess.run([sys.executable, "-m", "rollout.cli", *cmd], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    report = json.loads(res.stdout)
    assert report["checked"]["trainable_steps"] == groups * 8 + sum(s["eval_questions_by_revision"].values())
    assert not report["checked"].get("inexact_steps"), report["checked"]
    assert report["checked"]["chain_links"] == s["revisions"]  # revision -> batch -> ... -> r0, unbroken
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    unknown = con.execute("""SELECT count(*) FROM steps s LEFT JOIN policy_revisions p
                             ON p.family = s.policy_family AND p.revision = s.policy_revision
                             WHERE s.trainable AND p.revision IS NULL""").fetchone()[0]
    accuracy = con.execute("SELECT count(*) FROM v_eval_accuracy_by_revision").fetchone()[0]
    assert unknown == 0 and accuracy == len(evaluated)


def _newest_revision(bootstrap: str, run: str) -> int:
    """The newest revision on demo run ``run``'s revisions topic (-1: none yet)."""
    import asyncio

    from streams.revisions import RevisionFollower

    async def read() -> int:
        async with RevisionFollower({"bootstrap_servers": bootstrap}, topic=f"demo-{run}.policy-revisions") as f:
            return max((rev.revision for _, rev in await f.read_to_end()), default=-1)

    try:
        return asyncio.run(read())
    except RuntimeError:  # the topic is not created yet
        return -1


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_a_demo_killed_mid_run_leaves_no_process_behind(kafka_bootstrap, sig, tmp_path):
    """SIGKILL (the OOM killer), SIGTERM (a scheduler) or SIGINT (Ctrl-C) to `rollout demo` once its arena runs:
    within 10 s no process it started is alive (its children end with it: ``producers.inference.children``). SIGTERM and
    SIGINT are handled: the demo stops within 10 s with 128 + the signal and one line, and what it committed is
    intact (the run replays and audits clean)."""
    import time

    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    out = tmp_path / "demo.out"
    with out.open("wb") as f:
        demo = subprocess.Popen([sys.executable, "-m", "rollout.cli", "demo", "--policy", "tiny", "--groups", "400",
                                 "--no-progress"], cwd=ROOT, env=env, stdout=f, stderr=subprocess.PIPE)

    def children(pid: int) -> set[int]:
        found = set()
        for task in Path(f"/proc/{pid}/task").glob("*"):
            kids = (task / "children")
            found |= {int(c) for c in kids.read_text().split()} if kids.exists() else set()
        return found

    deadline = time.monotonic() + 120
    arena: set[int] = set()
    while not arena and time.monotonic() < deadline:
        arena = {c for c in children(demo.pid)
                 if b"arena" in Path(f"/proc/{c}/cmdline").read_bytes()} if demo.poll() is None else set()
        time.sleep(0.2)
    assert arena, "the demo's arena never started"
    run = re.search(r"^run (\w+):", out.read_text(), re.M).group(1)
    deadline = time.monotonic() + 120
    while _newest_revision(kafka_bootstrap, run) < 1:  # mid-run: a revision trained, rollouts in flight (a fixed
        assert time.monotonic() < deadline and demo.poll() is None, "no revision trained"  # wait missed it on a
        time.sleep(0.5)  # busy machine)
    time.sleep(1.0)
    started = arena | {g for a in arena for g in children(a)}
    sent = time.monotonic()
    demo.send_signal(sig)
    _, err = demo.communicate(timeout=30)
    took = time.monotonic() - sent
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in started):
        time.sleep(0.1)
    assert not [p for p in started if _alive(p)], "processes of the run still alive 10 s after the demo ended"
    if sig == signal.SIGKILL:
        return
    assert demo.returncode == 128 + sig and took <= 10, (demo.returncode, took, err.decode()[-2000:])
    assert b"Traceback" not in err and f"stopped by {signal.Signals(sig).name}".encode() in err, err.decode()[-2000:]
    db = tmp_path / "run.duckdb"
    for cmd in (["replay", "--db", str(db), "--run", run, "--quiet"], ["audit", "--db", str(db)]):
        done = subprocess.run([sys.executable, "-m", "rollout.cli", *cmd], cwd=ROOT, env=env, capture_output=True)
        assert done.returncode == 0, (cmd, done.stdout.decode()[-2000:], done.stderr.decode()[-2000:])
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM policy_revisions WHERE revision > 0").fetchone()[0] >= 1


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
