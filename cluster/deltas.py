"""Wire format of a step: msgpack, with each table delta's leading nulls sent as a count.

A prefix hit on a sliding group starts a table with many null entries; sending them as one integer
keeps a step's payload proportional to the real blocks it adds.
"""
from __future__ import annotations

import msgpack

from workers.protocol import RequestError, ScheduledChunk, StepInput, StepOutput


def _pack_ids(ids: list[int]) -> list:
    nulls = 0
    while nulls < len(ids) and ids[nulls] == 0:
        nulls += 1
    return [nulls, ids[nulls:]]


def _chunk_fields(c) -> list:
    return [c.request_id, c.token_ids, c.start_pos, [_pack_ids(g) for g in c.new_block_ids], c.sample,
            c.temperature, c.seed]


def encode_step(step: StepInput) -> bytes:
    """The step's bytes; ``RequestError`` naming the chunk that msgpack cannot carry (an int beyond 64 bits)."""
    chunks = [_chunk_fields(c) for c in step.chunks]
    try:
        return msgpack.packb([step.step_id, chunks, step.forget])
    except (OverflowError, TypeError, ValueError) as exc:
        for c, fields in zip(step.chunks, chunks):   # rare: find the culprit, chunk by chunk
            try:
                msgpack.packb(fields)
            except (OverflowError, TypeError, ValueError) as bad:
                raise RequestError(c.request_id, f"request {c.request_id!r} cannot be encoded for the workers: "
                                                 f"{bad}") from exc
        raise


def decode_step(payload: bytes) -> StepInput:
    step_id, chunks, forget = msgpack.unpackb(payload)
    return StepInput(step_id, [
        ScheduledChunk(rid, tokens, start, [[0] * nulls + ids for nulls, ids in groups], sample, temp, seed)
        for rid, tokens, start, groups, sample, temp, seed in chunks], forget)


def encode_output(out: StepOutput) -> bytes:
    return msgpack.packb([out.step_id, out.sampled, out.simulated_time_s, out.failed])


def decode_output(payload: bytes) -> StepOutput:
    step_id, sampled, simulated_time_s, failed = msgpack.unpackb(payload)
    return StepOutput(step_id, sampled, simulated_time_s, failed)
