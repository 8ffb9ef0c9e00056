"""The step protocol between the engine and its workers: plain dataclasses that msgpack can carry.

The engine owns every block table; a worker keeps an append-only mirror per request and KV-cache group,
fed by ``new_block_ids``. Dropped entries are never sent back to a worker: attention never reads
outside the window, so a stale id in the mirror is harmless. A table entry is one block id whatever the
number of layers: a block of a group of width ``k > 1`` is a composite of ``k`` pool units, and the step
carries each composite made since the last step (``compositions``), to apply before reading any table.

Sampling parameters travel once per request and worker, not in every chunk: a request's first chunk on
the workers carries a ``RequestStart`` (its ``SamplingSpec``, its prompt length and, when it has
penalties, the tokens before the chunk that the penalties count). The last stage keeps these with the
request's mirror and forgets them with it (``StepInput.forget``); a preempted or recomputed request is
new to the workers again, so its next first chunk carries them again. A start for a request the worker
already holds is refused (the two sides disagree), and a request that arrives without one is greedy.

Penalties need counts of the tokens a request has seen. The last stage keeps them itself, updated from
every chunk's ``token_ids`` (which, after the first, are exactly the tokens the request sampled). The
only tokens it cannot see are those before the first chunk, a prefix-cache hit: ``seen_token_ids``
carries them, and only what the penalties need (the whole prefix for a repetition penalty, which counts
prompt and output; for presence / frequency, which count output only, just the outputs inside the hit,
which is empty unless a recomputed request hits its own generated tokens).

Prompt logprobs (``SamplingSpec.prompt_logprobs``, for scoring a prompt): the last stage keeps, besides
each sampling row, the logits of every prompt position of the chunk and returns, per request, the raw
log-softmax of each prompt token given its prefix (and the top k, and its rank), as
``StepOutput.prompt_logprobs`` entries ``(first position, logprobs, top ids, top logprobs, ranks)``. The token at the start of a chunk is scored
by the last row of the chunk before it, which the last stage keeps until that token arrives; so every
position from 1 on is scored, however the prompt is chunked, provided the prompt is computed from
position 0 (the engine takes no prefix-cache hit for such a request until its positions are all scored).

Host-tier copies (``kvmanager/host_tier.py``): a step may carry ``kv_stores`` (group, device block, host
units: copy the block's units, as composed, to those host units) and ``kv_loads`` (group, host units,
device block: the reverse), which every worker runs for its own layers after the step's compositions and
before its compute (which reads neither: a store's source is pinned, a load's request is not computed
until its load is reported). The last stage reports each by its device block id in
``StepOutput.transfers_done`` or ``transfers_failed`` (a load from host units this worker never stored
since it started: its host memory was lost), as ``KVCacheManager.transfers_done`` takes them.

Faults are reported per request where they can be: a chunk a worker refuses raises ``RequestError``
naming its request before anything changes (the engine fails that request and runs the rest of the step
again); a row that cannot be sampled (NaN logits) lands in ``StepOutput.failed`` and the step stands.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvmanager.checks import is_int, is_number


MAX_LOGPROBS = 20                      # top logprobs a request may ask for (vLLM's default bound)
GREEDY_BELOW = 1e-5                    # temperatures below this are greedy (as vLLM's sampler treats them)
# Requests the engine runs before serving with ``compile_model``, so that the compiled forward meets each
# class of step shape first; a worker compiles no new shape after its first step without one of them.
WARM_UP_PREFIX = "swakv-warm-up-"


@dataclass(frozen=True)
class SamplingSpec:
    """How a request picks its next tokens (order of application: ``workers/runtime/sampling.py``)."""

    temperature: float = 0.0             # < GREEDY_BELOW: greedy (argmax after bias and penalties)
    top_p: float = 1.0                   # (0, 1]: the smallest set of tokens holding this much probability
    top_k: int = 0                       # 0: off; k: the k most likely tokens
    min_p: float = 0.0                   # [0, 1]: drop tokens below min_p x the most likely one's probability
    presence_penalty: float = 0.0        # OpenAI: minus this once for every token generated so far
    frequency_penalty: float = 0.0       # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0      # transformers / vLLM: over prompt and output, divide >0, multiply <0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit), sorted by token id
    logprobs: int | None = None          # None: none; k: the sampled token's raw logprob and the top k
    seed: int | None = None              # None: the worker's batch generator; else draws keyed by (seed, position)
    prompt_logprobs: int | None = None   # None: none; k: each prompt token's raw logprob and the top k (module doc)

    def __post_init__(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must be (token id, bias) pairs, got {self.logit_bias!r}") from None
        object.__setattr__(self, "logit_bias", bias)
        checks = (
            ("temperature", is_number(self.temperature) and self.temperature >= 0, "a finite number >= 0"),
            ("top_p", is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", is_int(self.top_k) and self.top_k >= 0, "an integer >= 0 (0: off)"),
            ("min_p", is_number(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("presence_penalty", is_number(self.presence_penalty), "a finite number"),
            ("frequency_penalty", is_number(self.frequency_penalty), "a finite number"),
            ("repetition_penalty", is_number(self.repetition_penalty) and self.repetition_penalty > 0,
             "a finite number > 0"),
            ("logit_bias", all(is_int(t) and t >= 0 and is_number(b) for t, b in bias)
             and len({t for t, _ in bias}) == len(bias), "distinct token ids >= 0 with finite biases"),
            ("logprobs", self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"None or an integer in [0, {MAX_LOGPROBS}]"),
            ("seed", self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**64),
             "None or an integer in [0, 2**64)"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"None or an integer in [0, {MAX_LOGPROBS}]"),
        )
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


GREEDY = SamplingSpec()


@dataclass
class RequestStart:
    """What the last stage keeps for a request, sent with the request's first chunk on the workers."""

    sampling: SamplingSpec
    num_prompt_tokens: int               # positions below this are prompt, the rest output (for penalties)
    seen_token_ids: list[int] = field(default_factory=list)   # tokens just before the chunk (see module doc)


@dataclass
class ScheduledChunk:
    """The tokens one request computes in one step."""

    request_id: str
    token_ids: list[int]                 # inputs of this step: a prefill chunk or the last sampled token
    start_pos: int                       # tokens already computed; these take positions start_pos..
    new_block_ids: list[list[int]]       # per KV-cache group: ids appended to the request's table (0 = null)
    sample: bool = True                  # this chunk reaches the last known token: produce the next one
    start: RequestStart | None = None    # the request's first chunk on the workers only (module doc)
    # Asynchronous scheduling: the chunk's one token is the one the workers' previous step drew for this
    # request, not yet known to the engine; ``token_ids`` holds a placeholder (0) the worker replaces.
    from_last_step: bool = False


@dataclass
class StepInput:
    step_id: int
    chunks: list[ScheduledChunk]
    forget: list[str] = field(default_factory=list)   # drop these mirrors before the step (freed, preempted)
    # (group, block_id, units) per composite made since the last step, in order: block ``block_id`` of
    # ``group`` now spans ``units`` (block_id first). Applied before the step; later entries win.
    compositions: list = field(default_factory=list)
    # Host-tier copies to run before the step's compute (module doc): (group, device block, host units)
    # per store, (group, host units, device block) per load.
    kv_stores: list = field(default_factory=list)
    kv_loads: list = field(default_factory=list)


@dataclass
class StepOutput:
    step_id: int
    sampled: dict[str, int]              # request_id -> next token, for chunks with sample=True
    simulated_time_s: float = 0.0        # simulated workers: the step's time on the modelled GPU
    # request_id -> (raw logprob of the sampled token, top token ids, their raw logprobs), if it asked
    logprobs: dict[str, tuple[float, list[int], list[float]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)   # request_id -> why its row could not be sampled
    device_time_s: float = 0.0           # real workers on CUDA: the step's span on the device (events)
    # request_id -> (first prompt position scored, raw logprob of each prompt token from there, per token
    # the top ids and their raw logprobs, each token's rank: 1 + the tokens likelier than it), for requests
    # with prompt_logprobs (module doc)
    prompt_logprobs: dict[str, tuple[int, list[float], list[list[int]], list[list[float]], list[int]]] = \
        field(default_factory=dict)
    transfers_done: list[int] = field(default_factory=list)     # device block ids of the step's copies that ran
    transfers_failed: list[int] = field(default_factory=list)   # ... that could not (module doc)
    worker_time_s: float = 0.0           # wall time the worker took, from reading the step to its answer


class RequestError(ValueError):
    """A step cannot run because of one request's chunk; raised before anything changed.

    Pickles as itself (its args are its fields), so the engine finds ``request_id`` through Ray's
    exception wrapping (``find_request_error``)."""

    def __init__(self, request_id: str, message: str):
        super().__init__(request_id, message)
        self.request_id, self.message = request_id, message

    def __str__(self) -> str:
        return self.message


def find_request_error(exc: BaseException) -> RequestError | None:
    """The ``RequestError`` inside ``exc``: itself, a Ray task error's ``cause``, or a ``__cause__``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RequestError) and isinstance(getattr(exc, "request_id", None), str):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def ints_in(values: list, end: int) -> bool:
    """A non-empty list of ints (no bools) in [0, end), checked at C speed: this runs for every chunk."""
    if len(values) == 1:   # a decode chunk's token, a decode step's new block
        return type(values[0]) is int and 0 <= values[0] < end
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) < end


def check_compositions(compositions, widths, num_blocks: int) -> dict[int, dict[int, list[int]]]:
    """Every composition well formed; returns, per group, block id -> units (the last entry for an id wins)."""
    if not isinstance(compositions, list):
        raise ValueError(f"compositions must be a list, got {type(compositions).__name__}")
    out: dict[int, dict[int, list[int]]] = {}
    for item in compositions:
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise ValueError(f"a composition must be (group, block_id, units), got {item!r}")
        g, block_id, units = item
        if not is_int(g) or not 0 <= g < len(widths) or widths[g] == 1:
            groups = [i for i, w in enumerate(widths) if w > 1]
            raise ValueError(f"composition {item!r}: group must be one of the groups wider than one unit {groups}")
        if not isinstance(units, (list, tuple)) or len(units) != widths[g] \
                or not all(is_int(u) and 0 < u < num_blocks for u in units) or len(set(units)) != len(units):
            raise ValueError(f"composition {item!r}: group {g} needs {widths[g]} distinct units in [1, {num_blocks})")
        if block_id != units[0]:
            raise ValueError(f"composition {item!r}: a composite is named by its first unit, {units[0]}")
        out.setdefault(g, {})[block_id] = list(units)
    return out


def check_transfers(stores, loads, widths, num_blocks: int, num_host_units: int) -> None:
    """The step's host-tier copies well formed: lists of triples, a known group, a real device block
    (``[1, num_blocks)``) and ``widths[group]`` distinct host units in ``[0, num_host_units)`` each; one
    copy per device block, and no host unit a store writes is in another copy of the step (two loads may
    read one host copy: two requests hit it at once). Whether a wide group's block is a named composite is
    the worker's check (it knows the compositions)."""
    if not stores and not loads:
        return
    if num_host_units == 0:
        raise ValueError("the step carries host-tier copies, but this worker has no host KV pool "
                         "(num_host_blocks=0)")
    blocks: set = set()
    written: set = set()     # host units stores write
    read: set = set()        # host units loads read
    for name, items, at in (("kv_stores", stores, (1, 2)), ("kv_loads", loads, (2, 1))):
        if not isinstance(items, list):
            raise ValueError(f"{name} must be a list, got {type(items).__name__}")
        for item in items:
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                raise ValueError(f"{name}: a copy must be a (group, ...) triple, got {item!r}")
            g, block, host = item[0], item[at[0]], item[at[1]]
            if not is_int(g) or not 0 <= g < len(widths):
                raise ValueError(f"{name}: copy {item!r}: group must be an integer in [0, {len(widths)})")
            if not is_int(block) or not 0 < block < num_blocks:
                raise ValueError(f"{name}: copy {item!r}: the device block must be an integer in [1, {num_blocks})")
            if not isinstance(host, (list, tuple)) or len(host) != widths[g] \
                    or not all(is_int(u) and 0 <= u < num_host_units for u in host) or len(set(host)) != len(host):
                raise ValueError(f"{name}: copy {item!r}: group {g} needs {widths[g]} distinct host units in "
                                 f"[0, {num_host_units})")
            if block in blocks:
                raise ValueError(f"{name}: copy {item!r}: device block {block} has two copies in one step")
            clash = written.intersection(host) if name == "kv_loads" else (written | read).intersection(host)
            if clash:
                raise ValueError(f"{name}: copy {item!r}: host units {sorted(clash)} are written by one copy of "
                                 f"the step and in another")
            blocks.add(block)
            (written if name == "kv_stores" else read).update(host)


def check_chunk_fields(chunk: ScheduledChunk, step_id: int, seen: set[str], num_groups: int, num_blocks: int,
                       vocab_size: int) -> None:
    """Every field of a chunk has the right type and range, and its request is not already in the step
    (``seen``, which this adds it to); tables are each worker's own check."""
    if not isinstance(chunk, ScheduledChunk):
        raise TypeError(f"step {step_id}: chunks must hold ScheduledChunk, got {type(chunk).__name__}")
    rid = chunk.request_id
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"request_id must be a non-empty str, got {rid!r}")
    if rid in seen:
        raise ValueError(f"step {step_id}: request_id {rid!r} appears twice")
    seen.add(rid)

    def fail(message: str):
        raise RequestError(rid, message)

    if not isinstance(chunk.token_ids, list) or not chunk.token_ids:
        fail(f"request {rid!r}: token_ids must be a non-empty list")
    if not ints_in(chunk.token_ids, vocab_size):
        fail(f"request {rid!r}: token_ids must be integers in [0, {vocab_size})")
    if not is_int(chunk.start_pos) or chunk.start_pos < 0:
        fail(f"request {rid!r}: start_pos must be an integer >= 0, got {chunk.start_pos!r}")
    if chunk.from_last_step is not False and (chunk.from_last_step is not True or len(chunk.token_ids) != 1):
        fail(f"request {rid!r}: from_last_step must be a bool, and a chunk fed by the last step holds one token")
    start = chunk.start
    if start is not None:
        if not isinstance(start, RequestStart) or not isinstance(start.sampling, SamplingSpec):
            fail(f"request {rid!r}: start must be a RequestStart holding a SamplingSpec, got {start!r}")
        if not is_int(start.num_prompt_tokens) or start.num_prompt_tokens < 1:
            fail(f"request {rid!r}: num_prompt_tokens must be an integer >= 1, got {start.num_prompt_tokens!r}")
        seen = start.seen_token_ids
        if not isinstance(seen, list) or len(seen) > chunk.start_pos \
                or not all(is_int(t) and 0 <= t < vocab_size for t in seen):
            fail(f"request {rid!r}: seen_token_ids must be at most start_pos={chunk.start_pos} "
                 f"token ids in [0, {vocab_size})")
        bad = [t for t, _ in start.sampling.logit_bias if t >= vocab_size]
        if bad:
            fail(f"request {rid!r}: logit_bias names token ids outside [0, {vocab_size}): {bad[:8]}")
    ids = chunk.new_block_ids
    if not isinstance(ids, list) or len(ids) != num_groups or not all(isinstance(g, list) for g in ids):
        fail(f"request {rid!r}: new_block_ids must be {num_groups} lists, one per KV-cache group, got {ids!r}")
    if not any(ids):
        return   # the common decode step adds no block
    for g, group_ids in enumerate(ids):
        if group_ids and not ints_in(group_ids, num_blocks):
            bad = [b for b in group_ids if not is_int(b) or not 0 <= b < num_blocks]
            fail(f"request {rid!r}: new_block_ids[{g}] holds ids outside [0, {num_blocks}): {bad}")
