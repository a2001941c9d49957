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

from producers.arena import STOP_GRACE_S

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
