"""Wire format of a step: msgpack, with each table delta's leading nulls sent as a count.

A prefix hit on a sliding group starts a table with many null entries; sending them as one integer
keeps a step's payload proportional to the real blocks it adds. Compositions (the units of composites made
since the last step) travel once each, ahead of the tables.
"""
from __future__ import annotations

import msgpack

from workers.protocol import ScheduledChunk, StepInput, StepOutput


def _pack_ids(ids: list[int]) -> list:
    nulls = 0
    while nulls < len(ids) and ids[nulls] == 0:
        nulls += 1
    return [nulls, ids[nulls:]]


def encode_step(step: StepInput) -> bytes:
    chunks = [[c.request_id, c.token_ids, c.start_pos, [_pack_ids(g) for g in c.new_block_ids], c.sample,
               c.temperature, c.seed] for c in step.chunks]
    return msgpack.packb([step.step_id, chunks, step.forget, step.compositions])


def decode_step(payload: bytes) -> StepInput:
    step_id, chunks, forget, compositions = msgpack.unpackb(payload)
    return StepInput(step_id, [
        ScheduledChunk(rid, tokens, start, [[0] * nulls + ids for nulls, ids in groups], sample, temp, seed)
        for rid, tokens, start, groups, sample, temp, seed in chunks], forget, compositions)


def encode_output(out: StepOutput) -> bytes:
    return msgpack.packb([out.step_id, out.sampled, out.simulated_time_s])


def decode_output(payload: bytes) -> StepOutput:
    step_id, sampled, simulated_time_s = msgpack.unpackb(payload)
    return StepOutput(step_id, sampled, simulated_time_s)
