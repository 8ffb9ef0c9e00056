"""Prefix-cache retention: hit rate of swakv vs vLLM 0.33 (dense and semantic retention), side by side.

Three workloads (token ids only, seeded; a request's answer is fixed by the seed, so every system sees
the same tokens):
- chat: 48 sessions x 6 turns; a session's first message is 200-1000 tokens, later ones 30-400, answers
  50-400; a turn's prompt is the whole history (every earlier message and answer) plus the new message.
- siblings: 6 system prompts of 1500-3000 tokens; 240 requests, each a system prompt (drawn at random)
  plus its own question of 20-200 tokens; answers 20-200.
- agent: 24 sessions x 8 tool-loop turns; every session starts with the same 2000-token system prompt
  (the tools) and its own task of 100-400 tokens; each answer (a tool call) is 30-150 tokens and each
  later turn appends a tool result of 100-1500 tokens to the whole history.

One serving loop drives every system (``serve``), so ordering and preemption follow the same rules:
up to 8 requests at once, a budget of 512 tokens a step (chunked prefill: running requests first, in
admission order, then waiting ones after a prefix lookup), decode one token a step, free on finish. A
session's next turn joins the back of the queue when its previous answer is complete. When the pool is
short, the most recently admitted running request is preempted (it recomputes later, through the prefix
cache), exactly as ``cluster/scheduler.py`` does.

Layouts (block 16, window 512): full (one full-attention group), sliding (one sliding-window group),
hybrid (one of each); with ``--layouts`` also real models' shapes: gemma3 (five sliding groups of W 1024
per full group: gemma-3's 5:1 layer ratio), gpt-oss (full + sliding W 128), and gemma3-units (swakv's
real gemma-3-27b layout, ``kv_layout``: one sliding group of 26 pool units per block, one full group of
5; the same KV bytes as gemma3; the other columns are gemma3's). **Pool size "per group"**: ``N`` blocks
per group means one pool of ``N x G`` allocatable blocks plus the null block, ``G`` the layout's number of
groups, for both systems. Both draw every group's blocks from that one pool, and a block holds one
group's layers for 16 tokens, so with the same layer count per group both get exactly the same KV bytes
(vLLM's planner builds this layout for hybrid models: groups of equal page size alias the same bytes;
here ``KVCacheConfig(num_blocks=N x G + 1)`` with one aliasing tensor per group).

Hit rate = tokens served from the prefix cache at each request's first admission / its prompt tokens
(a preempted request's recompute is counted in ``computed``, not as a hit). Columns: the unbounded-pool
ceiling (a simulated pool that never evicts, ``bench/retention_sim.py``), vLLM dense (a hand-built
``KVCacheConfig``: every full sliding block cached, LRU), vLLM sem. (its engine default
``prefix_cache_retention_interval=0``; after each lookup ``request.shared_prefix_boundary`` is set to the
third value of ``get_computed_blocks``, as its scheduler does), swakv, and swakv / the better vLLM.
Below the table, the issue's goals per cell: swakv >= the better vLLM column, and, at the run's two
tightest pools for chat and agent on sliding and hybrid layouts, >= 1.10x it (or the ceiling, if lower).
``--sim`` adds simulated policies (``retention_sim.py``): ``adaptive`` (swakv's policy, re-implemented:
the bench checks it equals the swakv column hit for hit), ``drop-front`` (swakv before issue 8), ``lru``
(vLLM dense's order), ``tiered`` and ``reuse`` (the first proposal), ``belady`` (clairvoyant); then a
second table gives their ratio to the better vLLM column, the cached blocks each evicted while
never-filled blocks were free, and where each lost hits (by the class of block evicted). ``--oracle``
instead runs tiny instances of the three workloads and searches every eviction choice for the best hit
rate any policy can reach, next to swakv and the simulated policies.

Run with vLLM's venv (kvmanager is standard library only); without vLLM it prints swakv's columns:

    PYTHONPATH=$PWD /tmp/vllm-venv/bin/python bench/retention.py --sim adaptive --jsonl out.jsonl
    PYTHONPATH=$PWD /tmp/vllm-venv/bin/python bench/retention.py --layouts gemma3,gpt-oss,gemma3-units
    python bench/retention.py --plot-from out.jsonl --plot out.png      # matplotlib is not in vLLM's venv
    python bench/retention.py --workloads chat --layouts sliding --pools 2000,4000     # a subset
    python bench/retention.py --oracle

Time on this 2-core machine: the full grid (3 x 3 x 5 cells, 3 systems + ceiling) about 5 minutes, 12
with the five simulated policies; ``--oracle`` about 2 minutes. Results: ``bench/results/``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvmanager import FullAttention, KVCacheManager, Request, SlidingWindow  # noqa: E402
from retention_sim import Belady, Branch, Scripted, SimManager, SimRequest, Spec, chain_hashes  # noqa: E402

BLOCK = 16
WINDOW = 512
STEP_TOKENS = 512          # chunked prefill: token budget of one step
MAX_RUNNING = 8
MAX_MODEL_LEN = 65536
VOCAB = 32000
# Window per group (None: full attention). The grid: full, sliding, hybrid. Extra shapes of real
# models, one group per layer slot as both systems would hold them: gemma3 = five sliding groups
# (W 1024) per full one, gemma-3's ratio of sliding to full layers; gpt-oss = full + sliding W 128.
LAYOUTS = {"full": (None,), "sliding": (WINDOW,), "hybrid": (None, WINDOW),
           "gemma3": (1024,) * 5 + (None,), "gpt-oss": (None, 128), "gemma3-units": (1024,) * 5 + (None,)}
# swakv's real layout for gemma-3-27b (kvmanager.planning.kv_layout: 52 sliding + 10 full layers, a unit
# is 2 layers' pages): one sliding group of 26 units, one full group of 5. The same KV bytes as "gemma3"
# (whose 6 groups' blocks hold 62 / 6 layers each): N blocks per group there = 31 N units here. The
# other columns (vLLM, ceiling, simulated policies) are gemma3's.
UNITS = {"gemma3-units": ((26, 5), 31)}
GRID_LAYOUTS = ("full", "sliding", "hybrid")
POOLS = (2000, 4000, 8000, 16000, 100000)
SYSTEMS = ("vllm-dense", "vllm-sem", "swakv")


# -- workloads -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    new: tuple[int, ...]       # tokens appended to the session's history to form this turn's prompt
    output: tuple[int, ...]    # the answer (fixed by the seed)


@dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]


def _ids(rng: random.Random, lo: int, hi: int) -> tuple[int, ...]:
    return tuple(rng.randint(1, VOCAB) for _ in range(rng.randint(lo, hi)))


def chat(seed: int, sessions: int = 48, turns: int = 6, first=(200, 1000), message=(30, 400),
         answer=(50, 400)) -> list[Session]:
    rng = random.Random(f"chat/{seed}")
    return [Session(tuple(Turn(_ids(rng, *(first if t == 0 else message)), _ids(rng, *answer))
                          for t in range(turns))) for _ in range(sessions)]


def siblings(seed: int, prompts: int = 6, requests: int = 240, system=(1500, 3000), question=(20, 200),
             answer=(20, 200)) -> list[Session]:
    rng = random.Random(f"siblings/{seed}")
    systems = [_ids(rng, *system) for _ in range(prompts)]
    return [Session((Turn(rng.choice(systems) + _ids(rng, *question), _ids(rng, *answer)),))
            for _ in range(requests)]


def agent(seed: int, sessions: int = 24, turns: int = 8, system: int = 2000, task=(100, 400),
          tool=(100, 1500), answer=(30, 150)) -> list[Session]:
    rng = random.Random(f"agent/{seed}")
    shared = _ids(rng, system, system)
    return [Session(tuple(Turn(shared + _ids(rng, *task) if t == 0 else _ids(rng, *tool), _ids(rng, *answer))
                          for t in range(turns))) for _ in range(sessions)]


WORKLOADS = {"chat": chat, "siblings": siblings, "agent": agent}


def prompts(sessions: list[Session]) -> list[list[list[int]]]:
    """Per session, per turn: the prompt (the whole history, then the turn's new tokens)."""
    out = []
    for s in sessions:
        history: list[int] = []
        turns = []
        for t in s.turns:
            history = history + list(t.new)
            turns.append(history)
            history = history + list(t.output)
        out.append(turns)
    return out


# -- managers behind one interface -----------------------------------------------------------------
class SwakvAdapter:
    """swakv's manager, through its public API only (so the bench outlives internal restructures)."""

    def __init__(self, windows, num_blocks: int, block_size: int = BLOCK, units=None):
        specs = [FullAttention(block_size) if w is None else SlidingWindow(block_size, window=w) for w in windows]
        if units is not None:      # one group per kind, composites of pool units (``UNITS``)
            (widths, per_block), groups = units, len(windows)
            kinds = list(dict.fromkeys(windows))
            specs = [specs[windows.index(w)] for w in kinds]
            num_blocks = (num_blocks - 1) // groups * per_block + 1
            self.mgr = KVCacheManager(specs, num_blocks=num_blocks, enable_prefix_caching=True,
                                      max_model_len=MAX_MODEL_LEN, widths=widths)
            return
        self.mgr = KVCacheManager(specs, num_blocks=num_blocks, enable_prefix_caching=True,
                                  max_model_len=MAX_MODEL_LEN)

    def request(self, rid: str, prompt: list[int]):
        return Request(rid, prompt)

    def lookup(self, req):
        return self.mgr.get_computed_blocks(req)

    def allocate(self, req, n: int, hit: int = 0, blocks=None) -> bool:
        return self.mgr.allocate_slots(req, n, hit, blocks) is not None

    def admitted(self, req, hit: int, index: int) -> None:
        req.num_computed_tokens += hit

    def advance(self, req, n: int) -> None:
        req.num_computed_tokens += n

    def append(self, req, token: int) -> None:
        req.append_output_token_ids([token])

    def preempt(self, req) -> None:
        self.mgr.preempt(req)

    def free(self, req) -> None:
        self.mgr.free(req)


class SimAdapter(SwakvAdapter):
    """The trace simulator; with ``num_blocks=None`` the unbounded-pool ceiling, which also records, per
    first admission, the blocks its hit needed (the clairvoyant policy's future)."""

    def __init__(self, windows, num_blocks: int | None, policy="adaptive", record: bool = False,
                 block_size: int = BLOCK, **kw):
        self.mgr = SimManager([Spec(block_size, w) for w in windows], num_blocks, policy, **kw)
        self.block_size = block_size
        self.record = record
        self.hit_tokens = 0
        self.needs: dict = {}
        self.need_sets: dict = {}

    def request(self, rid: str, prompt: list[int]):
        return SimRequest(rid, prompt)

    def admitted(self, req, hit: int, index: int) -> None:
        req.num_computed_tokens += hit
        if index < 0:
            return
        self.hit_tokens += hit
        self.mgr.admitted(index)
        if self.record:
            hashes = req.block_hashes(self.block_size)
            keys = {(g, hashes[i]) for g, spec in enumerate(self.mgr.specs) for i in spec.needed_blocks(hit)}
            self.need_sets[index] = keys
            for k in keys:
                self.needs.setdefault(k, []).append(index)


def vllm_adapter_class():
    """An adapter class for vLLM 0.33's manager, or None when vLLM is not importable here."""
    try:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VKVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                                KVCacheTensor, SlidingWindowSpec)
        from vllm.v1.request import Request as VRequest, RequestStatus
    except Exception as exc:  # noqa: BLE001 - any import failure means "no baseline here"
        print(f"[vLLM baseline unavailable: {type(exc).__name__}: {exc}]", file=sys.stderr)
        return None
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    params = SamplingParams(max_tokens=1 << 20)

    class VllmAdapter:
        def __init__(self, windows, num_blocks: int, semantic: bool):
            kw = dict(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
            specs = [FullAttentionSpec(**kw) if w is None else SlidingWindowSpec(**kw, sliding_window=w)
                     for w in windows]
            groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
            page = specs[0].page_size_bytes
            # As vLLM's planner lays out groups of equal page size: each group's tensor aliases the same
            # bytes from offset 0 (a block id belongs to one group at a time).
            tensors = [KVCacheTensor(size=page * num_blocks, layers=[f"layer.{i}"], layer_stride=page * num_blocks,
                                     block_stride=page) for i in range(len(specs))]
            cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
            if semantic:
                cfg.prefix_cache_retention_interval = 0      # the engine default (CacheConfig)
            self.mgr = VKVCacheManager(cfg, max_model_len=MAX_MODEL_LEN, scheduler_block_size=BLOCK,
                                       hash_block_size=BLOCK, enable_caching=True)

        def request(self, rid: str, prompt: list[int]):
            return VRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                            pooling_params=None, block_hasher=hasher)

        def lookup(self, req):
            blocks, n, boundary = self.mgr.get_computed_blocks(req)
            req.shared_prefix_boundary = boundary     # what its scheduler does after every lookup
            return blocks, n

        def allocate(self, req, n: int, hit: int = 0, blocks=None) -> bool:
            return self.mgr.allocate_slots(req, n, hit, blocks) is not None

        def admitted(self, req, hit: int, index: int) -> None:
            req.num_computed_tokens += hit
            req.status = RequestStatus.RUNNING

        def advance(self, req, n: int) -> None:
            req.num_computed_tokens += n

        def append(self, req, token: int) -> None:
            req.append_output_token_ids(token)

        def preempt(self, req) -> None:       # as its scheduler's _preempt_request
            self.mgr.free(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.num_preemptions += 1

        def free(self, req) -> None:
            self.mgr.free(req)
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED

    return VllmAdapter


# -- the serving loop ------------------------------------------------------------------------------
class Live:
    __slots__ = ("rid", "session", "turn", "prompt", "output", "handle", "num_out", "index")

    def __init__(self, session: int, turn: int, prompt: list[int], output: tuple[int, ...]):
        self.rid = f"s{session}t{turn}"
        self.session, self.turn, self.prompt, self.output = session, turn, prompt, output
        self.handle = None
        self.num_out = 0
        self.index = -1            # first-admission order; -1 until admitted


def serve(sessions: list[Session], adapter, progress=None, *, step_tokens: int = STEP_TOKENS,
          max_running: int = MAX_RUNNING) -> dict:
    """Serve every turn of ``sessions`` through ``adapter``; hits are counted at first admissions."""
    all_prompts = prompts(sessions)
    ready = deque(Live(s, 0, all_prompts[s][0], sessions[s].turns[0].output) for s in range(len(sessions)))
    running: list[Live] = []
    stats = dict(hit_tokens=0, prompt_tokens=0, computed=0, preemptions=0, steps=0, requests=0)
    admissions = 0
    while ready or running:
        stats["steps"] += 1
        budget, preempted, scheduled = step_tokens, False, []
        i = 0
        while i < len(running) and budget > 0:
            live = running[i]
            req = live.handle
            n = min(len(live.prompt) + live.num_out - req.num_computed_tokens, budget)
            ok = adapter.allocate(req, n)
            while not ok:
                victim = running.pop()
                adapter.preempt(victim.handle)
                stats["preemptions"] += 1
                preempted = True
                ready.appendleft(victim)
                if victim is live:
                    break
                ok = adapter.allocate(req, n)
            if not ok:
                break
            scheduled.append((live, n))
            budget -= n
            i += 1
        while ready and budget > 0 and not preempted and len(running) < max_running:
            live = ready[0]
            if live.handle is None:
                live.handle = adapter.request(live.rid, live.prompt)
            req = live.handle
            blocks, hit = adapter.lookup(req)
            n = min(len(live.prompt) + live.num_out - hit, budget)
            ok = adapter.allocate(req, n, hit, blocks)
            while not ok and not running and n > 1:       # alone and still short: smaller chunks
                n //= 2
                ok = adapter.allocate(req, n, hit, blocks)
            if not ok:
                break
            ready.popleft()
            first = live.index < 0
            if first:
                live.index = admissions
                admissions += 1
                stats["hit_tokens"] += hit
                stats["prompt_tokens"] += len(live.prompt)
            adapter.admitted(req, hit, live.index if first else -1)
            running.append(live)
            scheduled.append((live, n))
            budget -= n
        if not scheduled:
            raise RuntimeError(f"no progress: {ready[0].rid} ({len(ready[0].prompt)} tokens) fits nowhere")
        for live, n in scheduled:
            req = live.handle
            adapter.advance(req, n)
            stats["computed"] += n
            if req.num_computed_tokens == len(live.prompt) + live.num_out:   # sampled: the answer's next token
                adapter.append(req, live.output[live.num_out])
                live.num_out += 1
                if live.num_out == len(live.output):
                    adapter.free(req)
                    running.remove(live)
                    stats["requests"] += 1
                    if progress is not None:
                        progress.update(1)
                    turns = sessions[live.session].turns
                    if live.turn + 1 < len(turns):
                        t = live.turn + 1
                        ready.append(Live(live.session, t, all_prompts[live.session][t], turns[t].output))
    stats["hit_rate"] = stats["hit_tokens"] / stats["prompt_tokens"]
    return stats


# -- the grid --------------------------------------------------------------------------------------
def run_grid(args) -> list[dict]:
    from tqdm import tqdm
    vllm_cls = None if args.no_vllm else vllm_adapter_class()
    systems = ["swakv"] + (["vllm-dense", "vllm-sem"] if vllm_cls else [])
    sims = [s for s in args.sim.split(",") if s]
    cells = [(w, lay) for w in args.workloads for lay in args.layouts]
    workloads = {w: WORKLOADS[w](args.seed) for w in args.workloads}
    per_run = {w: sum(len(s.turns) for s in ws) for w, ws in workloads.items()}
    runs_per_cell = 1 + len(args.pools) * (len(systems) + len(sims))
    total = sum(per_run[w] * runs_per_cell for w, _ in cells)
    rows = []
    out = open(args.jsonl, "w") if args.jsonl else None
    bar = tqdm(total=total, unit="req", desc="retention", disable=args.quiet)
    for w, lay in cells:
        windows = LAYOUTS[lay]
        groups = len(windows)

        def record(system, pool, stats, seconds, **extra):
            row = dict(workload=w, layout=lay, pool_per_group=pool, num_blocks=None if pool is None else
                       pool * groups + 1, system=system, seconds=round(seconds, 2), **stats, **extra)
            rows.append(row)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()

        bar.set_postfix_str(f"{w}/{lay} ceiling")
        t0 = time.process_time()
        ceiling = SimAdapter(windows, None, record="belady" in sims)
        record("ceiling", None, serve(workloads[w], ceiling, bar), time.process_time() - t0)
        for pool in args.pools:
            num_blocks = pool * groups + 1
            for system in systems + sims:
                bar.set_postfix_str(f"{w}/{lay} {pool} {system}")
                t0 = time.process_time()
                extra = {}
                if system == "swakv":
                    adapter = SwakvAdapter(windows, num_blocks, units=UNITS.get(lay))
                elif system.startswith("vllm"):
                    adapter = vllm_cls(windows, num_blocks, semantic=system == "vllm-sem")
                else:
                    policy = Belady(ceiling.needs, ceiling.need_sets) if system == "belady" else system
                    adapter = SimAdapter(windows, num_blocks, policy, checkpoint=args.checkpoint)
                stats = serve(workloads[w], adapter, bar)
                if isinstance(adapter, SimAdapter):
                    extra = adapter.mgr.report()
                    system = "sim:" + system
                record(system, pool, stats, time.process_time() - t0, **extra)
    bar.close()
    if out:
        out.close()
    return rows


# -- the best any eviction policy can do, on tiny instances ----------------------------------------
TINY_BLOCK, TINY_WINDOW, TINY_STEP, TINY_RUNNING = 4, 8, 16, 2
TINY = {   # the three workloads' shapes, scaled down so that every eviction choice can be tried
    "chat": lambda seed: chat(seed, sessions=2, turns=3, first=(6, 10), message=(2, 4), answer=(1, 3)),
    "siblings": lambda seed: siblings(seed, prompts=2, requests=5, system=(8, 12), question=(1, 3), answer=(1, 2)),
    "agent": lambda seed: agent(seed, sessions=2, turns=3, system=8, task=(1, 3), tool=(2, 6), answer=(1, 2)),
}
TINY_POOLS = (4, 5, 6)


def exhaustive_best(sessions: list[Session], windows, num_blocks: int, max_nodes: int = 20_000) -> dict:
    """The most hit tokens any eviction policy reaches on this trace with the serving loop (tiny scale):
    a depth-first search over every choice of which live cached block to evict (branch and bound: a
    branch is cut when even full hits for every request not yet admitted could not beat the best)."""
    runs = []      # (rid, tokens of prompt + answer, longest possible hit)
    for si, (sess, turn_prompts) in enumerate(zip(sessions, prompts(sessions))):
        for t, (turn, prompt) in enumerate(zip(sess.turns, turn_prompts)):
            runs.append((f"s{si}t{t}", prompt + list(turn.output), (len(prompt) - 1) // TINY_BLOCK * TINY_BLOCK))
    chains = {rid: set(chain_hashes(tokens, TINY_BLOCK)) for rid, tokens, _ in runs}
    max_hit = {rid: m for rid, _, m in runs}

    def attempt(choices):
        finished: set[str] = set()
        live_cache: list = [None]

        def live():
            if live_cache[0] is None:
                live_cache[0] = set().union(*(c for rid, c in chains.items() if rid not in finished))
            return live_cache[0]
        full = frozenset(g for g, w in enumerate(windows) if w is None)
        adapter = SimAdapter(windows, num_blocks, Scripted(choices, live, full), block_size=TINY_BLOCK)
        free, admitted = adapter.free, set()
        adapter.free = lambda req: (finished.add(req.request_id), live_cache.__setitem__(0, None), free(req))
        admit = adapter.admitted
        adapter.admitted = lambda req, hit, index: (index >= 0 and admitted.add(req.request_id),
                                                    admit(req, hit, index))
        try:
            stats = serve(sessions, adapter, step_tokens=TINY_STEP, max_running=TINY_RUNNING)
            return stats["hit_tokens"], stats["prompt_tokens"], None, None
        except Branch as b:
            bound = adapter.hit_tokens + sum(m for rid, m in max_hit.items() if rid not in admitted)
            return None, None, b.n, bound

    best, prompt_tokens, nodes, stack = -1, 0, 0, [[]]
    while stack:
        choices = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise RuntimeError(f"more than {max_nodes} runs: instance too large for an exhaustive search")
        hits, total, n, bound = attempt(choices)
        if hits is not None:
            if hits > best:
                best, prompt_tokens = hits, total
        elif bound > best:
            stack.extend(choices + [i] for i in range(n - 1, -1, -1))
    return {"hit_tokens": best, "prompt_tokens": prompt_tokens, "hit_rate": best / prompt_tokens, "runs": nodes}


def run_oracle(args) -> list[dict]:
    """Tiny instances: the exhaustive best next to the ceiling and every simulated policy."""
    rows = []
    sims = [s for s in args.sim.split(",") if s] or ["drop-front", "lru", "tiered", "reuse", "adaptive"]
    for w in args.workloads:
        for lay in args.layouts:
            windows = tuple(None if x is None else TINY_WINDOW for x in LAYOUTS[lay])
            for seed in range(args.oracle_seeds):
                sessions = TINY[w](seed)
                ceiling = serve(sessions, SimAdapter(windows, None, block_size=TINY_BLOCK),
                                step_tokens=TINY_STEP, max_running=TINY_RUNNING)
                for pool in TINY_POOLS:
                    num_blocks = pool * len(windows) + 1
                    row = dict(workload=w, layout=lay, seed=seed, pool_per_group=pool, ceiling=ceiling["hit_rate"])
                    try:
                        row["best"] = exhaustive_best(sessions, windows, num_blocks)["hit_rate"]
                    except RuntimeError as exc:      # a single request that never fits, or too many runs
                        row["best"] = None
                        row["note"] = str(exc)
                    for sim in ["swakv"] + sims:
                        adapter = (SwakvAdapter(windows, num_blocks, block_size=TINY_BLOCK) if sim == "swakv" else
                                   SimAdapter(windows, num_blocks, sim, block_size=TINY_BLOCK))
                        try:
                            row[sim] = serve(sessions, adapter, step_tokens=TINY_STEP,
                                             max_running=TINY_RUNNING)["hit_rate"]
                        except RuntimeError:
                            row[sim] = None
                    rows.append(row)
    print(f"\nexhaustive best over every eviction choice, tiny instances (block {TINY_BLOCK}, W {TINY_WINDOW}, "
          f"{TINY_RUNNING} running, {TINY_STEP} tokens a step); hit tokens / prompt tokens")
    cols = ["swakv"] + sims
    print(f"{'workload':<9}{'layout':<9}{'seed':>5}{'blocks':>7}{'ceiling':>9}{'best':>8}" + "".join(f"{s:>11}" for s in cols))
    fmt = lambda v: f"{v:.3f}" if v is not None else "-"   # noqa: E731
    for r in rows:
        print(f"{r['workload']:<9}{r['layout']:<9}{r['seed']:>5}{r['pool_per_group']:>7}{fmt(r['ceiling']):>9}"
              f"{fmt(r['best']):>8}" + "".join(f"{fmt(r[s]):>11}" for s in cols))
    done = [r for r in rows if r["best"] is not None and all(r[s] is not None for s in cols)]
    print(f"\n{len(done)} instances searched to the end; mean hit rate, instances at the exhaustive best, "
          "and against lru (vLLM dense's order): below / above")
    print(f"{'best':<12}{sum(r['best'] for r in done) / max(1, len(done)):>7.3f}{len(done):>5}")
    for s in cols:
        below = sum(r[s] < r["lru"] - 1e-9 for r in done) if "lru" in cols else "-"
        above = sum(r[s] > r["lru"] + 1e-9 for r in done) if "lru" in cols else "-"
        print(f"{s:<12}{sum(r[s] for r in done) / max(1, len(done)):>7.3f}"
              f"{sum(abs(r[s] - r['best']) < 1e-9 for r in done):>5}{below:>5}{above:>5}")
    return rows


def print_table(rows: list[dict]) -> None:
    by = {(r["workload"], r["layout"], r["pool_per_group"], r["system"]): r for r in rows}
    systems = list(dict.fromkeys(r["system"] for r in rows if r["system"] != "ceiling"))
    vllm = [s for s in ("vllm-dense", "vllm-sem") if s in systems]
    others = [s for s in systems if s not in vllm and s != "swakv"]
    names = {"vllm-dense": "vLLM dense", "vllm-sem": "vLLM sem."}
    head = (f"{'workload':<9}{'layout':<9}{'blocks':>8}{'ceiling':>9}" + "".join(f"{names[s]:>12}" for s in vllm)
            + f"{'swakv':>9}" + (f"{'swakv/best':>12}" if vllm else "") + "".join(f"{s:>14}" for s in others))
    print("\nhit rate = prefix-cache hit tokens / prompt tokens (first admissions); blocks = pool per group; "
          f"block {BLOCK}, W {WINDOW} (gemma3: 1024, gpt-oss: 128), {MAX_RUNNING} running, {STEP_TOKENS} tokens a step")
    print(head)
    cells = list(dict.fromkeys((r["workload"], r["layout"], r["pool_per_group"]) for r in rows
                               if r["pool_per_group"] is not None))
    for w, lay, pool in cells:
        ceil = by.get((w, lay, None, "ceiling"))
        line = f"{w:<9}{lay:<9}{pool:>8}{ceil['hit_rate'] if ceil else float('nan'):>9.3f}"
        for s in vllm:
            line += f"{by[(w, lay, pool, s)]['hit_rate']:>12.3f}"
        sw = by.get((w, lay, pool, "swakv"))
        line += f"{sw['hit_rate']:>9.3f}" if sw else f"{'-':>9}"
        if vllm and sw:
            best = max(by[(w, lay, pool, s)]["hit_rate"] for s in vllm)
            line += f"{sw['hit_rate'] / best:>11.2f}x" if best else f"{'inf' if sw['hit_rate'] else '-':>12}"
        for s in others:
            r = by.get((w, lay, pool, s))
            line += f"{r['hit_rate']:>14.3f}" if r else f"{'-':>14}"
        print(line)


GOAL3 = {("chat", "sliding"), ("chat", "hybrid"), ("agent", "sliding"), ("agent", "hybrid")}


def print_goals(rows: list[dict]) -> None:
    """The issue's goals, cell by cell: swakv >= the better vLLM column (goal 2); at the two tightest pools
    of the run, chat and agent on sliding and hybrid layouts, >= 1.10x it or the ceiling (goal 3). Also,
    where the simulated ``adaptive`` policy ran, that it equals swakv hit for hit (the simulator's check)."""
    by = {(r["workload"], r["layout"], r["pool_per_group"], r["system"]): r for r in rows}
    cells = list(dict.fromkeys((r["workload"], r["layout"], r["pool_per_group"]) for r in rows
                               if r["system"] == "swakv"))
    if any((w, lay, p, "vllm-dense") in by for w, lay, p in cells):
        tight = sorted({p for _, _, p in cells})[:2]
        fails2, fails3, n3 = [], [], 0
        for w, lay, p in cells:
            sw = by[(w, lay, p, "swakv")]["hit_rate"]
            best = max(by[(w, lay, p, s)]["hit_rate"] for s in ("vllm-dense", "vllm-sem"))
            if sw < best:
                fails2.append(f"{w}/{lay}/{p}: {sw:.3f} < {best:.3f}")
            if (w, lay) in GOAL3 and p in tight:
                n3 += 1
                target = min(1.10 * best, by[(w, lay, None, "ceiling")]["hit_rate"])
                if sw < target - 1e-12:
                    fails3.append(f"{w}/{lay}/{p}: {sw:.3f} < {target:.3f}")
        print(f"\ngoal 2 (swakv >= the better vLLM): {len(cells) - len(fails2)} of {len(cells)} cells"
              + (f"; short: {', '.join(fails2)}" if fails2 else ""))
        if n3:
            print(f"goal 3 (>= 1.10x the better vLLM or the ceiling, pools {tight[0]} and {tight[-1]}, chat and "
                  f"agent, sliding and hybrid): {n3 - len(fails3)} of {n3} cells"
                  + (f"; short: {', '.join(fails3)}" if fails3 else ""))
    sims = [(w, lay, p) for w, lay, p in cells if (w, lay, p, "sim:adaptive") in by and lay not in UNITS]
    if sims:
        differ = [f"{w}/{lay}/{p}" for w, lay, p in sims if any(
            by[(w, lay, p, "swakv")][k] != by[(w, lay, p, "sim:adaptive")][k]
            for k in ("hit_tokens", "computed", "preemptions"))]
        print(f"sim:adaptive equals swakv (hit tokens, computed tokens, preemptions) in {len(sims) - len(differ)} "
              f"of {len(sims)} cells" + (f"; differs: {', '.join(differ)}" if differ else ""))


def print_analysis(rows: list[dict]) -> None:
    """Simulated policies: the better vLLM column they must beat, and where each one loses hits."""
    by = {(r["workload"], r["layout"], r["pool_per_group"], r["system"]): r for r in rows}
    sims = list(dict.fromkeys(r["system"] for r in rows if r["system"].startswith("sim:")))
    if not sims:
        return
    vllm = [s for s in ("vllm-dense", "vllm-sem") if any(r["system"] == s for r in rows)]
    print("\nsimulated policies / the better vLLM column (hit rate ratio); violations = cached blocks evicted "
          "while a never-filled block was free")
    print(f"{'workload':<9}{'layout':<9}{'blocks':>8}" + "".join(f"{s[4:]:>12}" for s in sims)
          + "".join(f"{'viol. ' + s[4:]:>16}" for s in sims))
    for r in rows:
        if r["system"] != sims[0]:
            continue
        w, lay, pool = r["workload"], r["layout"], r["pool_per_group"]
        best = max((by[(w, lay, pool, v)]["hit_rate"] for v in vllm), default=None)
        line = f"{w:<9}{lay:<9}{pool:>8}"
        for s in sims:
            rate = by[(w, lay, pool, s)]["hit_rate"]
            if best is None:            # no vLLM here: the rate itself
                line += f"{rate:>12.3f}"
            else:
                line += f"{rate / best:>11.2f}x" if best else f"{'inf' if rate else '-':>12}"
        line += "".join(f"{by[(w, lay, pool, s)]['violations']:>16}" for s in sims)
        print(line)
    print("\nwhere hits were lost (shortfall vs every block ever filled, % of prompt tokens, charged to the "
          "class the rightmost missing block had when released)")
    for s in sims:
        print(f"  {s}:")
        for r in rows:
            if r["system"] != s or not r.get("lost_tokens"):
                continue
            lost = sorted(r["lost_tokens"].items(), key=lambda kv: -kv[1])
            parts = ", ".join(f"{k} {100 * v / r['prompt_tokens']:.1f}%" for k, v in lost if v)
            print(f"    {r['workload']:<9}{r['layout']:<9}{r['pool_per_group']:>8}  {parts}")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[no matplotlib in this interpreter: plot it with `python bench/retention.py --plot-from "
              f"OUT.jsonl --plot {path}`]", file=sys.stderr)
        return
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(len(workloads), len(layouts), figsize=(4.2 * len(layouts), 3.2 * len(workloads)),
                             squeeze=False, sharex=True)
    systems = list(dict.fromkeys(r["system"] for r in rows if r["system"] != "ceiling"))
    for i, w in enumerate(workloads):
        for j, lay in enumerate(layouts):
            ax = axes[i][j]
            for s in systems:
                pts = sorted((r["pool_per_group"], r["hit_rate"]) for r in rows
                             if r["workload"] == w and r["layout"] == lay and r["system"] == s)
                if pts:   # measured systems solid, simulated policies dashed
                    ax.plot(*zip(*pts), marker="o", label=s, ls="--" if s.startswith("sim:") else "-",
                            lw=1 if s.startswith("sim:") else 2, ms=3 if s.startswith("sim:") else 5)
            ceil = [r["hit_rate"] for r in rows if r["workload"] == w and r["layout"] == lay and r["system"] == "ceiling"]
            if ceil:
                ax.axhline(ceil[0], ls="--", color="gray", label="unbounded pool")
            ax.set_xscale("log")
            ax.set_ylim(0, 1)
            ax.set_title(f"{w}, {lay}")
            ax.grid(alpha=0.3)
            if i == len(workloads) - 1:
                ax.set_xlabel("pool blocks per group")
            if j == 0:
                ax.set_ylabel("hit tokens / prompt tokens")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=list(GRID_LAYOUTS),
                    help=f"default: {','.join(GRID_LAYOUTS)}; also {','.join(k for k in LAYOUTS if k not in GRID_LAYOUTS)}")
    ap.add_argument("--pools", type=lambda s: [int(x) for x in s.split(",")], default=list(POOLS),
                    help="pool sizes in blocks per group")
    ap.add_argument("--sim", default="", help="comma-separated simulated policies to add: "
                    "adaptive (swakv's policy), drop-front, lru, tiered, reuse, belady (bench/retention_sim.py)")
    ap.add_argument("--checkpoint", type=int, default=0, help="simulated policies: protect the window "
                    "below every multiple of this many tokens (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM columns even if importable")
    ap.add_argument("--jsonl", help="write one JSON line per run here")
    ap.add_argument("--plot", help="write a plot of hit rate vs pool size here (needs matplotlib)")
    ap.add_argument("--plot-from", help="only print the table and plot from an earlier --jsonl file")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--oracle", action="store_true", help="instead of the grid: tiny instances of each "
                    "workload, the best any eviction policy reaches (exhaustive search) next to the policies")
    ap.add_argument("--oracle-seeds", type=int, default=3, help="tiny instances per workload and layout")
    args = ap.parse_args()
    for name, chosen, known in (("workload", args.workloads, WORKLOADS), ("layout", args.layouts, LAYOUTS)):
        bad = [c for c in chosen if c not in known]
        if bad:
            ap.error(f"unknown {name}(s) {bad}; known: {', '.join(known)}")
    if any(p < 1 for p in args.pools):
        ap.error("pool sizes must be >= 1")

    t0 = time.time()
    if args.oracle:
        rows = run_oracle(args)
        if args.jsonl:
            with open(args.jsonl, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"\n{len(rows)} instances in {time.time() - t0:.0f} s")
        return
    if args.plot_from:
        with open(args.plot_from) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = run_grid(args)
    print_table(rows)
    print_goals(rows)
    print_analysis(rows)
    if args.plot:
        plot(rows, args.plot)
    if not args.plot_from:
        print(f"\n{len(rows)} runs in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
