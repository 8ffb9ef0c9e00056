"""The records that cross the Ray boundary between the engine and its callers (the HTTP edge, routers,
the load test), each defined once: how a request samples (``SamplingParams``), what an engine says of
its model (``ModelInfo``), one streamed update of a request (``StreamItem``) and a replica's load
(``Load``). ``SamplingParams`` is a frozen dataclass that checks itself; the others are typed dicts:
plain data on the wire, one declaration of their keys here (``tests/test_contracts.py`` holds the
producers to them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypedDict

from kvmanager.checks import is_int, is_number
from workers.protocol import SamplingSpec


@dataclass(frozen=True)
class SamplingParams(SamplingSpec):
    """How a request samples (the workers' ``SamplingSpec`` knobs, sent as ``spec``), plus the engine's
    limits and stops. A knob added to ``SamplingSpec`` is a knob here, and on the HTTP edge when its
    request body has a field of that name (``cluster/serve/server.py``)."""

    max_tokens: int | None = None          # None: the rest of the context, as far as the pool lets one request go;
                                           # 0: compute (and score, with prompt_logprobs) the prompt only
    stop_token_ids: tuple[int, ...] = ()
    # ``seed``: any integer in [-2**63, 2**64), kept reduced mod 2**64 (what the workers take)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be None or an integer >= 0, got {self.max_tokens!r}")
        if not is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if self.seed is not None:
            if not is_int(self.seed) or not -2**63 <= self.seed < 2**64:
                raise ValueError(f"seed must be None or an integer in [-2**63, 2**64), got {self.seed!r}")
            object.__setattr__(self, "seed", self.seed % 2**64)
        super().__post_init__()            # checks every knob: ValueError names it
        knobs = {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingSpec)}
        object.__setattr__(self, "spec", SamplingSpec(**knobs))


class _BuiltModelInfo(TypedDict):

    model: str                      # the name clients use: a model directory's last component, or as given
    model_path: str                 # what the workers loaded (a directory, a tiny-model or preset name)
    max_model_len: int
    num_blocks: int                 # KV pool units
    num_groups: int
    group_widths: list[int]         # pool units per block of each KV-cache group
    block_size: int
    simulated_gpu: str | None
    vocab_size: int
    eos_token_ids: list[int]        # the model's own EOS ids (generation_config.json / config)
    sliding_as_full: bool
    kv_memory_bytes: int            # per device
    num_host_blocks: int            # host KV tier units (0: no tier)
    kv_host_memory_bytes: int       # the host tier's bytes for the whole replica (0: no tier)
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_num_batched_tokens: int
    kv_groups: list[dict]           # each group as the KV events describe it (``kv_events.group_metadata``)


class ModelInfo(_BuiltModelInfo, total=False):
    """What an engine tells of itself once built (``build_engine``; ``EngineService.ready`` adds ``replica``)."""

    replica: int                    # the engine actor's data-parallel rank


class StreamItem(TypedDict):
    """One update of one request (one step's): ``EngineService.subscribe`` sends a list of them per step,
    ``EngineService.generate`` yields them one by one."""

    request_id: str                 # the engine's own id for the request (``label#n``), what ``abort`` takes
    token_ids: list[int]            # new tokens
    finished: bool
    finish_reason: str | None       # length | stop | abort | error, once finished
    logprobs: list | None           # per new token: (raw logprob, top ids, top logprobs), if asked
    num_cached_tokens: int          # prompt tokens its first admission found in the prefix cache
    error: str | None               # why, when finish_reason is "error"
    error_type: str | None          # request_failed | engine_unavailable | server_shutting_down
    prompt_logprobs: list | None    # per prompt position after those of earlier items: (raw logprob, top ids,
                                    # top logprobs, rank), if asked (positions 1 .. len(prompt) - 1 in all)


class Load(TypedDict):
    """What a router weighs of a replica (``EngineService.kv_events`` carries it with every reply)."""

    status: str                     # starting | ready | restarting | no_workers | stopping
    running: int
    waiting: int
    kv_usage: float
    prefill_backlog: int            # prompt tokens admitted or queued and not yet computed
