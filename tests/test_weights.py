"""``VllmWeights``' first load: a server still holding the folder it started on is not made to read it again.

A narrow unit test of that decision against a real HTTP server that answers the routes vLLM's dev mode adds the
way vLLM 0.32 does (``GET /weight_info`` is "default" until ``/update_weight_version`` sets it; ``/v1/models``
names the folder it started on). The swap on a real vLLM is ``tests/test_vllm.py``'s.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from policy.checkpoint import file_sha256
from producers.inference.weights import RevisionRefused, VllmWeights, WeightLoadError
from schemas.policy import CheckpointRef, PolicyRevision


class _Vllm(BaseHTTPRequestHandler):
    started_on: Path
    version = "default"
    posted: list[str]

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/weight_info":
            self._answer({"weight_version": type(self).version})
        else:  # /v1/models
            self._answer({"data": [{"id": "m", "root": str(self.started_on)}]})

    drops = 0  # requests answered by closing the connection (a kept-alive one closed by the server as it was reused)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"{}")
        type(self).posted.append(self.path)
        if type(self).drops:
            type(self).drops -= 1
            self.close_connection = True
            return
        if self.path == "/update_weight_version":
            type(self).version = body["new_version"]
        self._answer({})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def vllm(tmp_path):
    handler = type("Vllm", (_Vllm,), {"started_on": tmp_path / "model", "posted": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


def _revision(folder: Path, revision: int, digest: str | None = None) -> PolicyRevision:
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / "model.safetensors"
    weights.write_bytes(f"weights of r{revision}".encode())
    ref = CheckpointRef(uri=weights.resolve().as_uri(), digest=digest or file_sha256(weights))
    return PolicyRevision(run_id="t", producer="trainer", family="f", revision=revision, checkpoint=ref)


async def test_revision_zero_on_the_folder_a_fresh_server_started_on_is_checked_not_reloaded(vllm, tmp_path):
    handler, url = vllm
    r0, r1 = _revision(tmp_path / "model", 0), _revision(tmp_path / "r1", 1)
    loader = VllmWeights(url)
    async with httpx.AsyncClient() as http:
        await loader.load(http, r0)
        assert "/collective_rpc" not in handler.posted and handler.version == "r0"
        await loader.load(http, r1)
    assert handler.posted.count("/collective_rpc") == 1 and handler.version == "r1"


@pytest.mark.parametrize("why", ["another folder", "a server loaded since it started"])
async def test_anything_else_is_reloaded(vllm, tmp_path, why):
    handler, url = vllm
    if why == "a server loaded since it started":  # a previous run's revision, whatever folder it started on
        handler.version = "r24"
    r0 = _revision(tmp_path / ("model" if why != "another folder" else "elsewhere"), 0)
    async with httpx.AsyncClient() as http:
        await VllmWeights(url).load(http, r0)
    assert handler.posted.count("/collective_rpc") == 1


async def test_bytes_that_are_not_the_digest_are_refused_even_unreloaded(vllm, tmp_path):
    handler, url = vllm
    r0 = _revision(tmp_path / "model", 0, digest="0" * 64)
    async with httpx.AsyncClient() as http:
        with pytest.raises(RevisionRefused, match="has sha256"):
            await VllmWeights(url).load(http, r0)
    assert "/update_weight_version" not in handler.posted


@pytest.mark.parametrize("drops", [1, 2])
async def test_a_connection_dropped_with_no_answer_is_tried_once_more(vllm, tmp_path, drops):
    """The arena's swap after a trainer step of ~5 s met vLLM closing the idle kept-alive connection it reused (a
    ReadError; the newcomer check's demo stopped at r17): it is sent again once; twice dropped is the server's
    failure."""
    handler, url = vllm
    handler.version = "r3"  # a reload, not the started-on check
    handler.drops = drops
    r0 = _revision(tmp_path / "model", 0)
    async with httpx.AsyncClient() as http:
        if drops == 1:
            await VllmWeights(url).load(http, r0)
            assert handler.posted.count("/collective_rpc") == 2 and handler.version == "r0"
        else:
            with pytest.raises(WeightLoadError, match="failed twice"):
                await VllmWeights(url).load(http, r0)


async def test_a_probe_the_server_does_not_answer_leaves_the_revision_served_but_not_exact(vllm, tmp_path):
    """A server that took the weights but answers no prompt logprobs for the revision's probe (this one answers
    ``{}``): the swap stands, and its figures say the revision's calls are not exact (the arena stamps them so)."""
    from schemas.policy import LogprobProbe

    handler, url = vllm
    r1 = _revision(tmp_path / "r1", 1).model_copy(update={"probe": LogprobProbe(token_ids=[1, 2, 3],
                                                                                 logprobs=[-1.0, -2.0])})
    async with httpx.AsyncClient() as http:
        figures = await VllmWeights(url).load(http, r1)
    assert handler.version == "r1" and "/v1/completions" in handler.posted and figures["inexact"] == 1.0
