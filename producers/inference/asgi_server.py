"""JSON endpoints on Starlette, served by uvicorn inside the running event loop (port 0: any free port).

The local policy server, the echo/scripted endpoints of tests and benchmarks and the verifiers capture proxy
are each a few JSON routes started and stopped in-process, often many in one test. Errors keep the OpenAI
shape ``{"error": {"message", "type", "code"}}``: an unknown route (404/405), a body that is not JSON (400),
one over ``MAX_BODY`` (413) and a handler bug (500, the server goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

MAX_BODY = 64 * 1024 * 1024
Handler = Callable[[Request], Awaitable[Response]]


class JSON(JSONResponse):
    """Compact JSON, NaN/Infinity written as Python's json does (a logprob can be -inf)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error(status: int, message: str, kind: str = "invalid_request_error",
          headers: dict[str, str] | None = None) -> JSON:
    """An OpenAI-style error body."""
    return JSON({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


async def body_json(request: Request) -> Any:
    """The request's JSON body (None when empty); a body that is not JSON becomes a 400 (see ``guarded``)."""
    return json.loads(await request.body() or b"null")


def guarded(handler: Handler) -> Handler:
    async def endpoint(request: Request) -> Response:
        if int(request.headers.get("content-length") or 0) > MAX_BODY:
            return error(413, "request body too large")
        try:
            return await handler(request)
        except json.JSONDecodeError as e:
            return error(400, f"invalid JSON body: {e}")
        except Exception as e:  # noqa: BLE001 - a handler bug is a 500, not a dead server
            return error(500, f"{type(e).__name__}: {e}", "server_error")
    return endpoint


async def _no_route(request: Request, exc: HTTPException) -> Response:
    return error(exc.status_code, f"no route {request.method} {request.url.path}", "not_found")


def json_app(routes: dict[tuple[str, str], Handler]) -> Starlette:
    """A Starlette app of ``{(method, path): handler}``."""
    return Starlette(routes=[Route(path, guarded(h), methods=[method]) for (method, path), h in routes.items()],
                     exception_handlers={HTTPException: _no_route})


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process that embeds the server owns its signals (uvicorn would take SIGINT/SIGTERM)


class AppServer:
    """``app`` on ``host:port`` (0: a free port, known after ``start``) until ``stop``; ``base_url`` ends in /v1."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> AppServer:
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (proto 0: ~40 ms per response, Nagle)
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._server = _Server(uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False,
                                              lifespan="off", timeout_graceful_shutdown=1,
                                              # longer than clients keep idle pooled connections: a server closing
                                              # one as a client reuses it fails that request (uvicorn's default: 5 s)
                                              timeout_keep_alive=75))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name=f"http-{self.port}")
        while not self._server.started:
            if self._task.done():  # it could not start: its exception (or SystemExit) says why
                sock.close()
                await self._task
                raise RuntimeError(f"HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.005)
        return self

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
            self._server = self._task = None

    async def __aenter__(self) -> AppServer:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
