"""The HTTP edge without Serve: the OpenAI app under uvicorn in a plain Ray actor, one hop from the engines.

Behind Ray Serve a token crosses two more processes (Serve's proxy, then its replica) before the client;
those two were the busiest processes of the served path at every concurrency and capped it at 2-3.6k SSE
events/s on this machine (``docs/serving-path-diagnosis.md``). Here the actor that holds the engines'
subscriptions (``feed.py``) writes the HTTP responses itself.

``HTTPEdge`` is the plain class: it binds the port when constructed (a port in use fails the actor's
creation with the OS's error), then runs uvicorn on a thread of its own with its own event loop, so the
edge serves as soon as it exists, also when Ray restarts a crashed actor. Serve's proxy did two things
for the app that uvicorn does not, so ``ClientWatch`` does them: it cancels a request's handler when its
client goes away (which aborts the engine requests), and echoes ``X-Request-Id``.
"""
from __future__ import annotations

import asyncio
import socket
import threading

import uvicorn

from cluster.ray.heap import freeze_startup_heap

from .server import OpenAIServer, make_app

STARTUP_TIMEOUT_S = 30.0
GRACEFUL_S = 10.0      # how long a stop waits for open responses (the engines have ended them by then)
# How long an idle keep-alive connection stays open. HTTP/1.1 has no way to close one safely: a request the
# client sends as the server closes is lost (a reset, or EOF before any response), and clients do not resend
# a POST. So the server must outwait the clients: they drop idle connections first, after their own expiry.
# uvicorn's default (5 s) equals httpx's (the OpenAI SDK's) pool expiry, and the server's clock starts when it
# queues a response's last byte, the client's when it has read it (later, by its lag under load), so a
# client reused connections it held idle 4.1-4.9 s and got ReadError (bench/results/keepalive_race.txt).
# 120 s outlasts the idle expiry of common clients and proxies (undici 4 s, httpx 5 s, aiohttp 15 s, nginx
# upstream and AWS ALB 60 s, Go net/http 90 s; Ray Serve's proxy, which this edge replaces, keeps 90 s); an
# idle connection costs the edge one socket, and a stop closes idle ones at once.
KEEP_ALIVE_S = 120


class ClientWatch:
    """ASGI middleware: once a request's body is read, a disconnect cancels its handler (streaming or not);
    responses carry the request's ``X-Request-Id``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        body_read, finished = asyncio.Event(), False

        async def tracked_receive():
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()
            return message

        async def tracked_send(message):
            nonlocal finished
            if message["type"] == "http.response.start" and request_id is not None:
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        handler = asyncio.create_task(self.app(scope, tracked_receive, tracked_send))

        async def watch():
            await body_read.wait()
            # after the body, uvicorn's receive returns only once the client has gone (or the response is over)
            if (await receive())["type"] == "http.disconnect" and not finished:
                handler.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await handler
        except asyncio.CancelledError:
            if not handler.cancelled():
                raise
        finally:
            watcher.cancel()


class QuietServer(uvicorn.Server):
    """uvicorn's server ticking once a second, not ten times: its tick refreshes the Date header (one-second
    resolution) and looks for a stop, and ``stop`` now wakes it at once, so an idle edge need not wake more."""

    _wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000    # on_tick refreshes the Date header when counter % 10 == 0
            try:
                await asyncio.wait_for(self._wake.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    def request_stop(self) -> None:
        """From any thread: stop accepting and end (after open responses, within the graceful bound)."""
        self.should_exit = True
        if self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:   # the loop has ended already
                pass


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket on ``host:port``; ``reuse_port`` lets several edges share it (the kernel spreads
    connections over them); without it, a port in use is an error rather than a silent share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def edge_config(app) -> uvicorn.Config:
    """uvicorn's settings for the edge (``HTTPEdge``'s, and the tests')."""
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                          timeout_graceful_shutdown=GRACEFUL_S, timeout_keep_alive=KEEP_ALIVE_S, backlog=2048)


class HTTPEdge:
    """The OpenAI app (an ``OpenAIServer`` over the named engines) served by uvicorn on ``host:port``."""

    def __init__(self, server_args: tuple, host: str, port: int, reuse_port: bool = False):
        sock = bind(host, port, reuse_port)
        self.server = OpenAIServer(*server_args)
        self.uvicorn = QuietServer(edge_config(ClientWatch(make_app(self.server))))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(sock,), name="http-edge", daemon=True)
        self.thread.start()
        for _ in range(int(STARTUP_TIMEOUT_S / 0.01)):
            if self.uvicorn.started or not self.thread.is_alive():
                break
            self.thread.join(0.01)
        if not self.uvicorn.started:
            raise RuntimeError(f"the HTTP edge did not start on {host}:{port}: {self.error!r}")
        freeze_startup_heap()

    def _run(self, sock: socket.socket) -> None:
        try:
            asyncio.run(self.uvicorn.serve(sockets=[sock]))
        except BaseException as exc:  # noqa: BLE001 - reported by the constructor or ``stop``
            self.error = exc
        finally:
            sock.close()

    def ready(self) -> bool:
        return self.uvicorn.started and self.thread.is_alive()

    def stop(self, timeout_s: float = GRACEFUL_S + 5) -> bool:
        """Stop accepting, let open responses end (within uvicorn's graceful bound); True when it stopped."""
        self.uvicorn.request_stop()
        self.thread.join(timeout_s)
        return not self.thread.is_alive()
