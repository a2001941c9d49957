"""A stopped arena stops in bounded time: `rollout arena` whose episodes wait on a server that never answers (a real
HTTP server that holds every completion), on a real broker, SIGTERMed: it exits 0 within ``STOP_GRACE_S`` and a few
seconds, its episodes cut short, none of them emitted (the log holds no half rollout)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from producers.arena.limits import STOP_GRACE_S

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


class _Holds(BaseHTTPRequestHandler):
    """Up (``/health``), and never answers a completion (a wedged server)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        data = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(120)

    def log_message(self, *args):
        pass


def test_a_sigtermed_arena_cuts_its_waiting_episodes_short_and_exits(kafka_bootstrap):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Holds)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap,
           "ROLLOUT_TOPIC_PREFIX": f"tstop{uuid.uuid4().hex[:8]}."}
    arena = subprocess.Popen([sys.executable, "-m", "rollout.cli", "arena", "examples/plans/arithmetic.toml",
                              "--groups", "0", "--no-progress", "--policy-url", url], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and arena.poll() is None:  # its first requests are held by now
            time.sleep(0.5)
            if time.monotonic() > deadline - 45:
                break
        assert arena.poll() is None, arena.communicate()[1][-2000:]
        sent = time.monotonic()
        arena.send_signal(signal.SIGTERM)
        out, err = arena.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if arena.poll() is None:
            arena.kill()
        server.shutdown()
    assert arena.returncode == 0, err[-2000:]
    assert took <= STOP_GRACE_S + 4, f"stopped {took:.1f}s after SIGTERM"
    assert "cut short" in err, err[-2000:]
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["groups"] >= 1 and stats["rollouts"] == 0 and stats["failed"] == 0, stats


def test_a_rollout_past_its_deadline_is_recorded_failed_and_its_group_closes(kafka_settings):
    """A server that never answers (a hung tool call stands for the same): with ``--rollout-timeout 3`` each rollout
    of the group is cut at its deadline and written as failed with the reason, and the group's claim is closed on
    the ledger (done), so nothing waits on it; without a deadline the claim was renewed, and owed, for ever."""
    import asyncio

    from schemas import codec
    from schemas.admission import AdmissionClaim, AdmissionDone
    from schemas.events import Rollout
    from streams import topics
    from tests.test_eos_pipeline import read_all

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Holds)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    prefix = f"tdead{uuid.uuid4().hex[:8]}."
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_settings.bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix}
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "rollout.cli", "arena", "examples/plans/arithmetic.toml",
                              "--groups", "1", "--no-progress", "--policy-url", url, "--rollout-timeout", "3"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["failed"] == stats["rollouts"] >= 2, stats
    assert list(stats["failure_reasons"]) == ["deadline: the rollout ran past 3 s (--rollout-timeout)"], stats

    kw = kafka_settings.client_kwargs()
    rollouts, ledger = ([codec.decode(r.value) for r in asyncio.run(read_all(kw, prefix + t.key, idle_s=0.5))]
                        for t in (topics.ROLLOUTS, topics.ADMISSIONS))
    assert len(rollouts) == stats["rollouts"] and all(isinstance(r, Rollout) and r.status == "failed"
                                                      and r.failure_reason.startswith("deadline") for r in rollouts)
    claims = [e.claim_id for e in ledger if isinstance(e, AdmissionClaim)]
    assert len(claims) == 1 and [e.claim_id for e in ledger if isinstance(e, AdmissionDone)] == claims
    print(f"\n[deadline] a group of {stats['rollouts']} hung rollouts closed {took:.1f}s after the arena started")
