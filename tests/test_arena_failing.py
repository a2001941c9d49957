"""A run that cannot make progress stops: `rollout arena` against a server that refuses every call (HTTP 400, a
real HTTP server) on a real broker, following revisions that will never come, exits 1 within its bound
(``--max-failed-groups``) naming the reason, instead of waiting for ever; every rollout it admitted is on the log,
failed, with that reason. Under the run's services too, when the bound is more groups than its last revision needs:
a failed group's slots are given back (``AdmissionRefund``), so the arena admits the groups that reach the bound."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from consumers import settings as service_settings
from consumers.registry import SERVICES
from consumers.runner import System
from consumers.trainer.step import initial_revision
from schemas import codec
from schemas.admission import AdmissionRefund
from schemas.plan_compiler import compile_plan
from streams import topics
from streams.revisions import publish
from tests.test_arena_fleet import PLAN
from tests.test_eos_pipeline import prefix, read_all  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


class _Refuses(BaseHTTPRequestHandler):
    """Up (``/health``), loads each revision (a local policy server's ``/load_weights``), and refuses every
    completion as a misconfigured vLLM does (a tool choice it was not started for)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self._answer(200, {"status": "ok"})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.endswith("/load_weights"):
            return self._answer(200, {})
        self._answer(400, {"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice',
                                     "type": "BadRequestError", "code": 400}})

    def _answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def _refusing_server() -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def test_an_arena_whose_every_rollout_fails_stops_naming_the_reason(kafka_bootstrap):
    server, url = _refusing_server()
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap,
           "ROLLOUT_TOPIC_PREFIX": f"tfail{uuid.uuid4().hex[:8]}."}
    t0 = time.monotonic()
    try:
        # --groups 0: for ever; following revisions that no trainer publishes
        out = subprocess.run([sys.executable, "-m", "rollout.cli", "arena", "examples/plans/arithmetic.toml",
                              "--groups", "0", "--follow-revisions", "--no-progress", "--policy-url", url,
                              "--max-failed-groups", "3"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=180)
    finally:
        server.shutdown()
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "every rollout of the last 3 groups failed" in out.stderr and "tool choice" in out.stderr, out.stderr
    assert "[inference.vllm] tool_call_parser" in out.stderr, out.stderr  # what to do
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["failed_groups_in_a_row"] >= 3 and stats["failed"] == stats["rollouts"] >= 3 * 8
    assert sum(stats["failure_reasons"].values()) == stats["failed"]
    assert all("400" in reason for reason in stats["failure_reasons"]), stats["failure_reasons"]
    print(f"\n[failing run] stopped after {took:.1f}s: {stats['groups']} groups, {stats['failed']} failed rollouts")


async def test_a_run_whose_every_rollout_fails_stops_though_its_last_revision_needs_fewer_groups(
        kafka_settings, prefix, tmp_path):  # noqa: F811 - fixture
    """Revision 1 takes 4 groups (batch 16, groups of 4); the bound is 6 failed groups. Their slots held by records
    that never come, the arena admitted 4 and waited for a revision (a recipe's run: 648 s, then exit 0)."""
    kw = kafka_settings.client_kwargs()
    plan_path = tmp_path / "plan.toml"
    plan_path.write_text(PLAN)
    plan = compile_plan(str(plan_path))
    await topics.create_topics(kw)
    await publish(kw, initial_revision(plan.family, tmp_path / "ckpt", seed=0, run_id="failing"))
    cfg = service_settings.build(plan=plan, credit=True, checkpoint_dir=str(tmp_path / "ckpt"), lr=1e-3)
    server, url = _refusing_server()
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_settings.bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix}
    try:
        async with System(SERVICES, cfg, kw):
            arena = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rollout.cli", "arena", str(plan_path), "--groups", "0", "--follow-revisions",
                "--until-revision", "1", "--no-progress", "--policy-url", url, "--run-id", "failing",
                "--max-failed-groups", "6", cwd=str(ROOT), env=env, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(arena.communicate(), 120)
            refunds = [e for r in await read_all(kw, topics.ADMISSIONS.name, idle_s=0.5, timeout_s=10)
                       if isinstance(e := codec.decode(r.value), AdmissionRefund)]
    finally:
        server.shutdown()
    assert arena.returncode == 1, out.decode()[-2000:] + err.decode()[-2000:]
    assert "every rollout of the last 6 groups failed" in err.decode(), err.decode()[-2000:]
    stats = json.loads(out.decode().strip().splitlines()[-1])
    assert stats["groups"] >= 6 and stats["failed"] == stats["rollouts"] >= 6 * 4
    assert len(refunds) >= 2 and all("every rollout of the group failed" in e.reason for e in refunds), refunds
