"""A small asyncio HTTP/1.1 JSON server (stdlib only), shared by the local policy server and the
echo/scripted endpoints used in tests and benchmarks.

Keep-alive, Content-Length bodies (no chunked requests), JSON in and out. Handlers are
``async def handler(request: Request) -> Response``; routes are matched on (method, path).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

MAX_BODY = 64 * 1024 * 1024


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"null")


@dataclass
class Response:
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)

    def encode(self, keep_alive: bool) -> bytes:
        payload = b"" if self.body is None else json.dumps(self.body, separators=(",", ":")).encode()
        reason = HTTPStatus(self.status).phrase if self.status in HTTPStatus._value2member_map_ else "Status"
        head = [f"HTTP/1.1 {self.status} {reason}", "Content-Type: application/json",
                f"Content-Length: {len(payload)}", f"Connection: {'keep-alive' if keep_alive else 'close'}"]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload


def error(status: int, message: str, kind: str = "invalid_request_error") -> Response:
    """An OpenAI-style error body."""
    return Response(status, {"error": {"message": message, "type": kind, "code": status}})


Handler = Callable[[Request], Awaitable[Response]]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class JsonHttpServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self.routes: dict[tuple[str, str], Handler] = {}
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()

    def route(self, method: str, path: str, handler: Handler) -> None:
        self.routes[(method.upper(), path)] = handler

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> JsonHttpServer:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_BODY)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._conns):
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def serve_forever(self) -> None:
        if self._server is None:
            await self.start()
        assert self._server is not None
        await self._server.serve_forever()

    async def __aenter__(self) -> JsonHttpServer:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                try:
                    method, target, version = line.decode("latin-1").strip().split(" ", 2)
                except ValueError:
                    writer.write(error(400, "malformed request line").encode(False))
                    return
                headers: dict[str, str] = {}
                while True:
                    h = await reader.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length") or 0)
                if length > MAX_BODY:
                    writer.write(error(413, "request body too large").encode(False))
                    return
                body = await reader.readexactly(length) if length else b""
                keep_alive = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
                path = target.split("?", 1)[0]
                handler = self.routes.get((method.upper(), path))
                if handler is None:
                    resp = error(404, f"no route {method} {path}", "not_found")
                else:
                    try:
                        resp = await handler(Request(method.upper(), path, headers, body))
                    except json.JSONDecodeError as e:
                        resp = error(400, f"invalid JSON body: {e}")
                    except Exception as e:  # noqa: BLE001 - a handler bug is a 500, not a dead server
                        resp = error(500, f"{type(e).__name__}: {e}", "server_error")
                writer.write(resp.encode(keep_alive))
                await writer.drain()
                if not keep_alive:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            return
        finally:
            self._conns.discard(task)
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass
