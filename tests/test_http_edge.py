"""The HTTP edge's uvicorn server (``QuietServer``), without Ray: it serves with a current Date header,
wakes about once a second while idle (stock uvicorn ticks ten times a second), a stop from another
thread ends it at once rather than at its next tick, and it keeps an idle connection open past the
clients' own keep-alive expiry."""
from __future__ import annotations

import asyncio
import email.utils
import socket
import threading
import time
import urllib.request

import httpx
import uvicorn

from cluster.serve.edge import QuietServer, bind, edge_config


async def hello(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hi"})


class Ticks(QuietServer):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


def serve_in_thread(server: QuietServer):
    """``server`` on a free loopback port, on a thread of its own; (socket, port, thread) once it serves."""
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    assert server.started
    return sock, sock.getsockname()[1], thread


def test_an_idle_edge_ticks_about_once_a_second_serves_a_current_date_and_stops_when_told():
    server = Ticks(uvicorn.Config(hello, log_level="warning", lifespan="off"))
    sock, port, thread = serve_in_thread(server)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
        assert r.read() == b"hi"
        date = email.utils.parsedate_to_datetime(r.headers["date"]).timestamp()
    assert abs(date - time.time()) < 3              # refreshed at each one-second tick, not frozen at start
    before = server.ticks
    time.sleep(2.5)
    assert server.ticks - before <= 4               # stock uvicorn: 25 ticks in 2.5 s
    server.request_stop()
    thread.join(5)                                  # the stop wakes its wait (its tick is 1 s, not 5)
    assert not thread.is_alive()
    sock.close()


def test_the_edge_keeps_an_idle_connection_open_past_the_clients_keep_alive_expiry():
    """The client, not the server, must be the one to drop an idle connection: a request sent as the server
    closes it is lost (httpx raised ReadError on connections it had held idle 4.1-4.9 s against uvicorn's
    default 5 s). So a connection idle a second past httpx's expiry (the OpenAI SDK's client) still serves."""
    server = QuietServer(edge_config(hello))
    sock, port, thread = serve_in_thread(server)
    request = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            replies = []
            for wait_s in (httpx.Limits().keepalive_expiry + 1, 0):
                conn.sendall(request)
                reply = b""
                while not reply.endswith(b"\r\n0\r\n\r\n"):    # the chunked body's end
                    data = conn.recv(65536)
                    assert data, f"the edge closed the connection after {len(replies)} response(s)"
                    reply += data
                replies.append(reply)
                time.sleep(wait_s)
            assert all(r.startswith(b"HTTP/1.1 200 ") and r.endswith(b"2\r\nhi\r\n0\r\n\r\n") for r in replies)
    finally:
        server.request_stop()
        thread.join(5)
        sock.close()
    assert not thread.is_alive()
