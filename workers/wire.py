"""Wire format of a step: msgpack, with each table delta's leading nulls sent as a count.

A prefix hit on a sliding group starts a table with many null entries; sending them as one integer
keeps a step's payload proportional to the real blocks it adds. Compositions (the units of composites made
since the last step) travel once each, ahead of the tables, their units as runs of consecutive ids
(``[first, count, ...]``): a composite of never-used units is one run whatever its width, so the bytes
do not grow with the number of layers of a kind. Host-tier copies travel the same way: a store as
``[group, device block, host runs]``, a load as ``[group, host runs, device block]``. A chunk's ``RequestStart`` (sampling spec,
prompt length, seen tokens) is a nil on every chunk but a request's first on the workers.

Prompt logprobs come back as packed little-endian arrays (float32 logprobs, int32 top ids, float32 top
logprobs), not msgpack lists: a scored 32k-token prompt with its top 20 is a few MB of bytes, not a
million boxed numbers; the values are float32 on the worker, so nothing is lost.
"""
from __future__ import annotations

from dataclasses import fields

import msgpack
import numpy as np

from kvmanager import NULL_BLOCK_ID
from workers.protocol import RequestError, RequestStart, SamplingSpec, ScheduledChunk, StepInput, StepOutput

_SPEC_FIELDS = tuple(f.name for f in fields(SamplingSpec))


def _pack_ids(ids: list[int]) -> list:
    nulls = 0
    while nulls < len(ids) and ids[nulls] == NULL_BLOCK_ID:
        nulls += 1
    return [nulls, ids[nulls:]]


def _pack_runs(units) -> list[int]:
    """Units as ``[first, count, first, count, ...]`` runs of consecutive ids."""
    flat: list[int] = []
    for u in units:
        if flat and u == flat[-2] + flat[-1]:
            flat[-1] += 1
        else:
            flat += (u, 1)
    return flat


def _unpack_runs(flat: list[int]) -> tuple[int, ...]:
    return tuple(u for i in range(0, len(flat), 2) for u in range(flat[i], flat[i] + flat[i + 1]))


def _pack_start(start: RequestStart | None):
    if start is None:
        return None
    return [[getattr(start.sampling, name) for name in _SPEC_FIELDS], start.num_prompt_tokens, start.seen_token_ids]


def _unpack_start(packed) -> RequestStart | None:
    if packed is None:
        return None
    values, num_prompt_tokens, seen = packed
    return RequestStart(SamplingSpec(*values), num_prompt_tokens, seen)


def _chunk_fields(c) -> list:
    return [c.request_id, c.token_ids, c.start_pos, [_pack_ids(g) for g in c.new_block_ids], c.sample,
            _pack_start(c.start), c.from_last_step]


def encode_step(step: StepInput) -> bytes:
    """The step's bytes; ``RequestError`` naming the chunk that msgpack cannot carry (an int beyond 64 bits)."""
    chunks = [_chunk_fields(c) for c in step.chunks]
    compositions = [(g, block_id, _pack_runs(units)) for g, block_id, units in step.compositions]
    try:
        stores = [(g, block, _pack_runs(host)) for g, block, host in step.kv_stores]
        loads = [(g, _pack_runs(host), block) for g, host, block in step.kv_loads]
        return msgpack.packb([step.step_id, chunks, step.forget, compositions, stores, loads])
    except (OverflowError, TypeError, ValueError) as exc:
        for c, packed in zip(step.chunks, chunks):   # rare: find the culprit, chunk by chunk
            try:
                msgpack.packb(packed)
            except (OverflowError, TypeError, ValueError) as bad:
                raise RequestError(c.request_id, f"request {c.request_id!r} cannot be encoded for the workers: "
                                                 f"{bad}") from exc
        raise


def decode_step(payload: bytes) -> StepInput:
    step_id, chunks, forget, compositions, stores, loads = msgpack.unpackb(payload)
    return StepInput(step_id, [
        ScheduledChunk(rid, tokens, start, [[NULL_BLOCK_ID] * nulls + ids for nulls, ids in groups], sample,
                       _unpack_start(first), fed)
        for rid, tokens, start, groups, sample, first, fed in chunks], forget,
        [(g, block_id, _unpack_runs(runs)) for g, block_id, runs in compositions],
        [(g, block, _unpack_runs(runs)) for g, block, runs in stores],
        [(g, _unpack_runs(runs), block) for g, runs, block in loads])


def _pack_prompt_logprobs(entry) -> list:
    start, values, top_ids, top_values, ranks = entry
    k = len(top_ids[0]) if top_ids else 0
    return [start, k, np.asarray(values, "<f4").tobytes(), np.asarray(top_ids, "<i4").reshape(-1).tobytes(),
            np.asarray(top_values, "<f4").reshape(-1).tobytes(), np.asarray(ranks, "<i4").tobytes()]


def _unpack_prompt_logprobs(packed) -> tuple:
    start, k, values, top_ids, top_values, ranks = packed
    n = len(values) // 4
    rows = (np.frombuffer(top_ids, "<i4").reshape(n, k).tolist(), np.frombuffer(top_values, "<f4").reshape(n, k).tolist())
    return start, np.frombuffer(values, "<f4").tolist(), *rows, np.frombuffer(ranks, "<i4").tolist()


def encode_output(out: StepOutput) -> bytes:
    prompt = {rid: _pack_prompt_logprobs(e) for rid, e in out.prompt_logprobs.items()}
    return msgpack.packb([out.step_id, out.sampled, out.simulated_time_s, out.logprobs, out.failed,
                          out.device_time_s, prompt, out.transfers_done, out.transfers_failed, out.worker_time_s])


def decode_output(payload: bytes) -> StepOutput:
    step_id, sampled, simulated_time_s, logprobs, failed, device_time_s, prompt, done, lost, took = msgpack.unpackb(payload)
    return StepOutput(step_id, sampled, simulated_time_s, {rid: tuple(entry) for rid, entry in logprobs.items()},
                      failed, device_time_s, {rid: _unpack_prompt_logprobs(e) for rid, e in prompt.items()}, done, lost,
                      took)
