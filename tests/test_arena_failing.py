"""A run that cannot make progress stops: `rollout arena` against a server that refuses every call (HTTP 400, a
real HTTP server) on a real broker, following revisions that will never come, exits 1 within its bound
(``--max-failed-groups``) naming the reason, instead of waiting for ever; every rollout it admitted is on the log,
failed, with that reason."""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


class _Refuses(BaseHTTPRequestHandler):
    """Up (``/health``), and refuses every completion as a misconfigured vLLM does (a tool choice it was not
    started for)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self._answer(200, {"status": "ok"})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
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


def test_an_arena_whose_every_rollout_fails_stops_naming_the_reason(kafka_bootstrap):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
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
