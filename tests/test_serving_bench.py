"""The serving bench's client counts what a server streams: tokens per event (several when coalesced),
events split across HTTP chunks, the end marker, error events and refusals, against a local HTTP server
that sends exactly the bytes of each scenario (no Ray)."""
from __future__ import annotations

import asyncio
import json

from bench.serving import cpu_per_token_us, references, stream_completion


def _event(token_ids: list[int]) -> bytes:
    body = {"choices": [{"index": 0, "text": "x", "token_ids": token_ids, "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def _serve_once(response: bytes):
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(response)
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _run(response: bytes, timeout_s: float = 10.0):
    async def main():
        server, port = await _serve_once(response)
        async with server:
            return await stream_completion("127.0.0.1", port, b"{}", timeout_s)
    return asyncio.run(main())


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_tokens_are_counted_per_event_even_when_events_straddle_chunks_and_carry_several():
    stream = _event([1]) + _event([2, 3, 4]) + _event([5]) + b"data: [DONE]\n\n"
    pieces = [stream[:10], stream[10:95], stream[95:]]           # events cut mid-way
    out = _run(HEAD + _chunked(pieces))
    assert (out.tokens, len(out.times), out.done, out.error) == (5, 3, True, None)


def test_events_without_tokens_do_not_count_and_a_stream_without_done_is_not_done():
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\n'
    out = _run(HEAD + _chunked([_event([7]) + usage + _event([8])]))
    assert (out.tokens, len(out.times), out.done) == (2, 2, False)


def test_an_error_event_and_a_refusal_are_reported_with_their_message():
    error = b'data: {"error": {"message": "the engine restarted", "type": "engine_restarted"}}\n\n'
    out = _run(HEAD + _chunked([_event([1]) + error + b"data: [DONE]\n\n"]))
    assert (out.tokens, out.error, out.done) == (1, "the engine restarted", True)
    refused = _run(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 21\r\n\r\n{\"error\": \"no engine\"}")
    assert refused.error.startswith("HTTP 503: {\"error\": \"no engine\"}") and refused.tokens == 0


def test_a_server_that_stops_answering_is_a_timeout_not_a_hang():
    async def main():
        async def handle(reader, writer):
            try:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(HEAD + b"%x\r\n%s\r\n" % (len(_event([1])), _event([1])))
                await writer.drain()
                await asyncio.sleep(3)
            finally:
                writer.close()
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            return await stream_completion("127.0.0.1", server.sockets[0].getsockname()[1], b"{}", 0.5)
    out = asyncio.run(main())
    assert out.tokens == 1 and out.error == "no end within 0.5 s (1 tokens)" and not out.done


def test_cpu_per_token_sums_the_server_processes_over_the_run():
    run = {"server_cpu": [{"name": "ray::HTTPEdge", "cpu": 0.5}, {"name": "ray::EngineService", "cpu": 0.25}],
           "wall_s": 2.0, "tokens": 1000}
    assert cpu_per_token_us(run) == 1500.0    # 0.75 of a core for 2 s over 1,000 tokens


def test_the_slept_itl_goal_is_also_read_against_the_in_process_engine_on_the_same_trace():
    def cfg(served_itl):
        return {"sleep_factor": 1, "runs": [{"streams": 64, "itl_p50": served_itl, "engine": {"itl_p50": 0.0234}}]}
    assert references(cfg(0.0239)) == [("64 streams ITL p50 <= 1.1 x the in-process engine's 23.4 ms on this trace + 1 ms", True)]
    assert references(cfg(0.0268))[0][1] is False     # 1.1 x 23.4 + 1 = 26.74 ms
    assert references({**cfg(0.0239), "sleep_factor": 0}) == []
